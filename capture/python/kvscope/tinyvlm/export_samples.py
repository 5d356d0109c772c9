"""Export held-out samples of the tiny-shapes dataset for the C++ closed-loop evaluation (kvcap eval).

  python3 -m kvscope.tinyvlm.export_samples --model DIR [--count N]

Writes DIR/heldout.json:
  {"split": "heldout", "split_base": <int>, "image_offset": <int>, "count": N,
   "families": ["fine-grained", "counting", "two-image", "text-only"],
   "samples": [{"index": k, "family": "...", "question": "...", "answer": "...",
                "image_seeds": [seed, ...]}, ...]}
Sample k is dataset.heldout_sample(vocab, k) (k = 0..N-1); the C++ side renders the scenes from the seeds
(bit-exact, spec "Scenes") and builds the prompt from the question. Every question and answer is checked
against DIR/vocab.json. The file is written to a temporary name and renamed, so a crash never leaves a
partial heldout.json.
"""

import argparse
import json
import os
import sys

from .dataset import FAMILIES, HELDOUT_BASE, HELDOUT_IMAGE_OFFSET, heldout_sample
from .vocab import Vocab


def export(model_dir: str, count: int) -> str:
    with open(os.path.join(model_dir, "vocab.json"), encoding="utf-8") as f:
        vocab = Vocab(json.load(f)["tokens"])
    samples = []
    for k in range(count):
        s = heldout_sample(vocab, k)
        samples.append({"index": k, "family": s.family, "question": s.question, "answer": s.answer,
                        "image_seeds": [int(x) for x in s.image_seeds]})
    doc = {"split": "heldout", "split_base": HELDOUT_BASE, "image_offset": HELDOUT_IMAGE_OFFSET,
           "count": count, "families": list(FAMILIES), "samples": samples}
    path = os.path.join(model_dir, "heldout.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=0, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Write DIR/heldout.json: N held-out samples (scene seeds, question, answer, family) "
                    "for kvcap eval.",
        epilog="example: python3 -m kvscope.tinyvlm.export_samples --model traces/models/tiny-shapes "
               "--count 1000")
    ap.add_argument("--model", required=True, help="model directory (must contain vocab.json)")
    ap.add_argument("--count", type=int, default=1000, help="number of samples (default 1000)")
    a = ap.parse_args(argv)
    if a.count < 1:
        print("export_samples: --count must be >= 1", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.model, "vocab.json")):
        print(f"export_samples: {a.model}/vocab.json not found", file=sys.stderr)
        return 2
    path = export(a.model, a.count)
    print(f"wrote {path} ({a.count} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
