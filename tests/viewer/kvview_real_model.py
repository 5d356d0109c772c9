#!/usr/bin/python3
"""kvview on a real pretrained model's trace (SmolLM2-135M-Instruct, imported by scripts/setup).

Usage: kvview_real_model.py KVVIEW KVCAP KVSIM WORKDIR

Captures the chat question of the README with `kvcap run` (30 layers, 9/3 heads, text and special
tokens), sweeps it with `kvsim`, and renders the views a user opens on it under Xvfb: each must exit 0,
have the requested size and not be blank, the token map of two policies must differ, and the layer
selector must reach the last of the 30 layers. Exits 77 (ctest skip) without the model or xvfb-run.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from kvview_screenshots import decode_png, rerun_under_xvfb, variance  # noqa: E402
from real_model import require_model  # noqa: E402

SIZE = (960, 600)
FAILURES = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg)
    if not cond:
        FAILURES.append(msg)


if __name__ == "__main__":
    KVVIEW, KVCAP, KVSIM, WORK = sys.argv[1:5]
    model = require_model()
    rerun_under_xvfb()
    os.makedirs(WORK, exist_ok=True)
    trace, results = os.path.join(WORK, "paris.h5"), os.path.join(WORK, "results.h5")
    r = subprocess.run([KVCAP, "run", "--model", str(model), "--chat", "--prompt", "What is the capital of France?",
                        "--max-new", "8", "--threads", "2", "-o", trace], capture_output=True, text=True, timeout=600)
    check(r.returncode == 0 and "Paris" in r.stdout, f"kvcap run answers Paris (stderr: {r.stderr.strip()[-300:]})")
    r = subprocess.run([KVSIM, "sweep", "--trace", trace, "--policies", "h2o,streamingllm", "--budgets", "0.3",
                        "-o", results, "-q", "--threads", "2"], capture_output=True, text=True, timeout=600)
    check(r.returncode == 0, f"kvsim sweep of the real trace (stderr: {r.stderr.strip()[-300:]})")

    def shot(name, extra):
        png = os.path.join(WORK, name + ".png")
        r = subprocess.run([KVVIEW, trace, "--results", results, "--screenshot", png,
                            "--size", f"{SIZE[0]}x{SIZE[1]}"] + extra, capture_output=True, text=True, timeout=300)
        check(r.returncode == 0, f"{name}: exit 0 (got {r.returncode}; stderr: {r.stderr.strip()})")
        if r.returncode != 0:
            return None
        w, h, rows = decode_png(png)
        check((w, h) == SIZE, f"{name}: {w}x{h} is the requested size")
        check(variance(rows) > 100, f"{name}: not blank")
        return rows

    for view in ["overview", "tokens", "budgets", "attention", "quality", "collapse"]:
        shot(view, ["--view", view, "--point", "h2o@0.3"])
    h2o = shot("tokens-h2o-layer29", ["--view", "tokens", "--point", "h2o@0.3", "--layer", "29"])
    sllm = shot("tokens-streamingllm-layer29", ["--view", "tokens", "--point", "streamingllm@0.3", "--layer", "29"])
    check(h2o is not None and sllm is not None and h2o != sllm, "layer 29: h2o and streamingllm keep different tokens")
    r = subprocess.run([KVVIEW, trace, "--results", results, "--view", "tokens", "--layer", "30", "--screenshot",
                        os.path.join(WORK, "bad-layer.png")], capture_output=True, text=True, timeout=300)
    check(r.returncode == 2 and "--layer: 30 is not below 30 layers" in r.stderr,
          f"--layer 30 of a 30-layer trace: exit 2 naming the layer count ({r.stderr.strip()})")
    sys.exit(1 if FAILURES else 0)
