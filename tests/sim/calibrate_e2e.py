"""End-to-end check of scripts/calibrate on a small grid (issue 6).

Usage: calibrate_e2e.py SOURCE_DIR KVCAP KVSIM WORK_DIR

Runs the calibration on 6 held-out samples x 3 policies x 2 budgets of the shipped tiny model, writing
only under WORK_DIR (never docs/), and checks: the report, the scatter PNGs and the correlation table
exist and parse; the joined point table has every point; `kvcap eval --answers` rows agree with the
accuracy `kvcap eval` reports; the captures are a dataset (docs/datasets.md) in the workdir; a dataset
written by `kvcap run --samples` (--dataset) is what calibrate sweeps, with the same numbers as its own
captures; `kvcap run --samples --first` captures the given indices; bad input exits 2 with one line on
stderr.
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

    # The captures are a dataset: the chunk's manifest (traces removed once swept), its answers = captured.
    man = pd.read_csv(os.path.join(work, "run", "dataset", "c00000", "manifest.csv"), dtype=str,
                      keep_default_na=False)
    check(list(man["index"]) == [str(i) for i in range(6)], f"workdir dataset indices {list(man['index'])}")
    check(not glob.glob(os.path.join(work, "run", "dataset", "c00000", "*.h5")), "swept traces not removed")

    # --dataset: a dataset kvcap wrote is what calibrate reads (its traces, kept), 3 samples, same numbers.
    ds = os.path.join(work, "ds")
    r = subprocess.run([kvcap, "run", "--model", model, "--samples", "3", "--max-new", "10", "--dtype", "float32",
                        "--threads", "1", "-q", "-o", ds], capture_output=True, text=True)
    check(r.returncode == 0, f"kvcap run --samples: {r.stderr}")
    doc2 = os.path.join(work, "validation-ds.md")
    dcmd = [sys.executable, script, "--model", model, "--dataset", ds, "--policies", "h2o,streamingllm",
            "--budgets", "0.1,0.5", "--kvcap", kvcap, "--kvsim", kvsim, "--jobs", "2", "--workdir",
            os.path.join(work, "run-ds"), "--doc", doc2, "--img-dir", img, "-q"]
    r = subprocess.run(dcmd, capture_output=True, text=True)
    check(r.returncode == 0, f"calibrate --dataset exit {r.returncode}: {r.stderr}")
    check("3/3 samples" in open(doc2).read(), "--dataset: captured answers differ from kvcap eval's")
    check(len(glob.glob(os.path.join(ds, "s*.h5"))) == 3, "--dataset removed the dataset's traces")
    check(not os.path.exists(os.path.join(work, "run-ds", "dataset", "c00000")), "--dataset captured anyway")
    for i in range(3):  # the sweep of the dataset's trace i = the sweep of calibrate's own capture i
        a = pd.read_csv(os.path.join(work, "run-ds", "sweeps", f"s{i}.csv"))
        b = pd.read_csv(os.path.join(work, "run", "sweeps", f"s{i}.csv"))
        b = b[b.policy.isin(["h2o", "streamingllm"])].reset_index(drop=True)
        cols = ["policy", "budget", "layer", "modality", "output_error", "attention_recall", "bytes_ratio"]
        check(a[cols].equals(b[cols]), f"sample {i}: the dataset's sweep differs from the capture's")
    # A dataset without the samples 0..N-1 that kvcap eval runs: one line, exit 2.
    ds2 = os.path.join(work, "ds-first")
    r = subprocess.run([kvcap, "run", "--model", model, "--samples", "2", "--first", "4", "--max-new", "10",
                        "--threads", "1", "-q", "-o", ds2], capture_output=True, text=True)
    check(r.returncode == 0, f"kvcap run --first: {r.stderr}")
    m2 = pd.read_csv(os.path.join(ds2, "manifest.csv"), dtype=str, keep_default_na=False)
    check(list(m2["sample"]) == ["s00004", "s00005"] and list(m2["index"]) == ["4", "5"] and
          m2.capture_command[0].split().count("--heldout") == 1 and "--heldout 4" in m2.capture_command[0],
          f"kvcap run --first 4: {m2[['sample', 'index', 'capture_command']].values.tolist()}")
    bad = subprocess.run(dcmd[:5] + [ds2] + dcmd[6:], capture_output=True, text=True)
    check(bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "index 0" in bad.stderr,
          f"dataset without sample 0: {bad.stderr}")

    # Bad input: one line on stderr, exit 2.
    bad = subprocess.run([sys.executable, script, "--model", work, "--kvcap", kvcap, "--kvsim", kvsim,
                          "--doc", os.path.join(work, "bad.md")], capture_output=True, text=True)
    check(bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, f"bad model dir: {bad.stderr}")
    check(not os.path.exists(os.path.join(work, "bad.md")), "report written on failure")
    print("calibrate_e2e: OK")


if __name__ == "__main__":
    main()
