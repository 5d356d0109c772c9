"""The shipped real captures (traces/tiny-shapes-*.h5, listed in traces/README.md) are what `kvcap run`
captures today from the shipped model: same tokens, same answer, same Q/K/V (up to float rounding of
BLAS thread partitioning). Fails when the model's weights change and the traces were not regenerated.

usage: shipped_traces.py KVCAP SOURCE_DIR WORK_DIR"""
import os
import subprocess
import sys

import h5py
import numpy as np

CAPTURES = {
    "tiny-shapes-fine.h5": ("5301195113", "what color is the cross ?", "the cross is blue"),
    "tiny-shapes-count.h5": ("5231273933", "how many shapes ?", "there are three shapes"),
    "tiny-shapes-two.h5": ("7259973033,7530073792", "which image has the green circle ?", "the second image"),
}


def main():
    kvcap, src, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    model = os.path.join(src, "traces", "models", "tiny-shapes")
    failures = 0
    for name, (scene, question, answer) in CAPTURES.items():
        shipped = os.path.join(src, "traces", name)
        fresh = os.path.join(work, name)
        out = subprocess.run([kvcap, "run", "--model", model, "--scene", scene, "--question", question,
                              "-o", fresh], capture_output=True, text=True, check=True).stdout
        got = out.splitlines()[0].removeprefix("answer: ")
        if got != answer:
            print(f"{name}: model now answers {got!r}, traces/README.md says {answer!r}")
            failures += 1
        with h5py.File(shipped, "r") as a, h5py.File(fresh, "r") as b:
            for key in ("tokens/modality", "tokens/token_id", "tokens/position", "tokens/segment",
                        "tokens/grid", "decode/tokens/token_id"):
                if not np.array_equal(a[key][()], b[key][()]):
                    print(f"{name}: {key} differs from a fresh capture")
                    failures += 1
            worst = 0.0
            for group in ("layers", "decode/layers"):
                for layer in a[group]:
                    for t in ("q", "k", "v"):
                        x = a[f"{group}/{layer}/{t}"][()].astype(np.float64)
                        y = b[f"{group}/{layer}/{t}"][()].astype(np.float64)
                        if x.shape != y.shape:
                            print(f"{name}: {group}/{layer}/{t} shape {x.shape} vs fresh {y.shape}")
                            failures += 1
                            continue
                        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
            if worst > 1e-4:
                print(f"{name}: q/k/v differ from a fresh capture by {worst:.3g} (relative), tolerance 1e-4")
                failures += 1
            print(f"{name}: answer {got!r}, worst relative q/k/v difference {worst:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
