"""End-to-end check of scripts/calibrate on a small grid (issue 6).

Usage: calibrate_e2e.py SOURCE_DIR KVCAP KVSIM WORK_DIR

Runs the calibration on 6 held-out samples x 3 policies x 2 budgets of the shipped tiny model, writing
only under WORK_DIR (never docs/), and checks: the report, the scatter PNGs and the correlation table
exist and parse; the joined point table has every point; `kvcap eval --answers` rows agree with the
accuracy `kvcap eval` reports; bad input exits 2 with one line on stderr.
"""
import glob
import os
import shutil
import subprocess
import sys

import pandas as pd


def check(cond, msg):
    if not cond:
        print("FAIL: " + msg, file=sys.stderr)
        sys.exit(1)


def main():
    src, kvcap, kvsim, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    script = os.path.join(src, "scripts", "calibrate")
    model = os.path.join(src, "traces", "models", "tiny-shapes")
    doc = os.path.join(work, "validation.md")
    img = os.path.join(work, "img")
    cmd = [sys.executable, script, "--model", model, "--samples", "6", "--policies",
           "h2o,vision-stride,streamingllm", "--budgets", "0.1,0.5", "--kvcap", kvcap, "--kvsim", kvsim,
           "--jobs", "2", "--workdir", os.path.join(work, "run"), "--doc", doc, "--img-dir", img,
           "--points-csv", os.path.join(work, "points.csv"), "-q"]
    # A hand-written real-model section after the generated report survives regeneration.
    with open(doc, "w") as f:
        f.write("# old report\n\nstale\n\n## Real model: SmolLM2-135M-Instruct\n\nkept table\n")
    r = subprocess.run(cmd, capture_output=True, text=True)
    check(r.returncode == 0, f"calibrate exit {r.returncode}: {r.stderr}")

    text = open(doc).read()
    check(text.endswith("## Real model: SmolLM2-135M-Instruct\n\nkept table\n") and "stale" not in text,
          "the real-model section was not kept (or the old report was)")
    check("scripts/calibrate" in text and "--samples 6" in text, "command missing from the report")
    for section in ("## Correlations", "## Points", "## Open-loop vs closed-loop gap",
                    "## Collapse flags against truth", "## Conclusion"):
        check(section in text, f"section {section} missing")
    check("6/6 samples" in text, "captured answers differ from kvcap eval's uncompressed answers")

    pngs = sorted(glob.glob(os.path.join(img, "validation-*.png")))
    check(len(pngs) == 7, f"expected 7 scatter PNGs, got {len(pngs)}")
    for p in pngs:
        with open(p, "rb") as f:
            check(f.read(8) == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG")
        check(os.path.relpath(p, work) in text, f"{p} not linked from the report")

    corr = pd.read_csv(os.path.join(work, "validation-correlations.csv"))
    check(len(corr) == 8, f"correlation table has {len(corr)} rows, expected 8")
    for c in ("spearman_accuracy_loss", "spearman_vision_loss", "spearman_closed_kl"):
        v = corr[c].dropna()
        check(((v >= -1 - 1e-9) & (v <= 1 + 1e-9)).all(), f"{c} outside [-1, 1]")
    check(corr.spearman_accuracy_loss.notna().sum() >= 4, "most correlations are NaN")

    pts = pd.read_csv(os.path.join(work, "points.csv"), dtype={"budget": str})
    check(len(pts) == 6, f"points table has {len(pts)} rows, expected 6")
    check(set(pts.policy) == {"h2o", "vision-stride", "streamingllm"}, "policies missing from points")

    # kvcap eval --answers: one row per point x sample; `correct` reproduces the reported accuracy.
    ans = pd.concat([pd.read_csv(a, dtype={"budget": str})
                     for a in glob.glob(os.path.join(work, "run", "eval", "answers*.csv"))])
    ev = pd.concat([pd.read_csv(e, dtype={"budget": str})
                    for e in glob.glob(os.path.join(work, "run", "eval", "eval*.csv"))])
    ans = ans.drop_duplicates(["policy", "budget", "sample"])
    check(len(ans) == 6 * 7, f"answers rows {len(ans)}, expected 42 (6 points + full, 6 samples)")
    check((ans.correct == (ans.generated == ans.expected + " <eos>")).all(), "correct column wrong")
    for e in ev.drop_duplicates(["policy", "budget"]).itertuples():
        a = ans[(ans.policy == e.policy) & (ans.budget == e.budget)]
        check(abs(a.correct.mean() - e.accuracy) < 1e-9, f"{e.policy}@{e.budget}: answers disagree")

    # Bad input: one line on stderr, exit 2.
    bad = subprocess.run([sys.executable, script, "--model", work, "--kvcap", kvcap, "--kvsim", kvsim,
                          "--doc", os.path.join(work, "bad.md")], capture_output=True, text=True)
    check(bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, f"bad model dir: {bad.stderr}")
    check(not os.path.exists(os.path.join(work, "bad.md")), "report written on failure")
    print("calibrate_e2e: OK")


if __name__ == "__main__":
    main()
