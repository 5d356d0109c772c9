"""Held-out exact-match evaluation of a tiny-VLM model directory (greedy generation, KV cache).

  evaluate.py --model DIR [--samples N] [--json]
"""

import argparse
import json
import sys
from collections import Counter

import torch

from .dataset import FAMILIES, heldout_sample
from .model import TinyVlm, load_model
from .vocab import Vocab


@torch.no_grad()
def evaluate(model: TinyVlm, vocab: Vocab, n: int, start: int = 0) -> dict:
    """Exact match of the greedy answer (up to and including <eos>) on held-out samples start..start+n-1.
    Returns {"overall", "<family>": accuracy, "n_<family>": count}."""
    model.eval()
    hits, totals = Counter(), Counter()
    for k in range(start, start + n):
        s = heldout_sample(vocab, k)
        out = model.generate(s.prompt_ids, torch.from_numpy(s.images), max_new=len(s.answer_ids) + 2)
        totals[s.family] += 1
        hits[s.family] += int(out == s.answer_ids)
    res = {"overall": sum(hits.values()) / max(1, n)}
    for f in FAMILIES:
        res[f] = hits[f] / totals[f] if totals[f] else float("nan")
        res["n_" + f] = totals[f]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Held-out exact-match accuracy of a tiny-VLM model, overall and per family.",
        epilog="example: evaluate.py --model traces/models/tiny-shapes --samples 200")
    ap.add_argument("--model", required=True,
                    help="model directory (config.json, model.safetensors, vocab.json)")
    ap.add_argument("--samples", type=int, default=500, help="held-out samples (default 500)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if args.samples < 1:
        print("evaluate: --samples must be >= 1", file=sys.stderr)
        return 2
    try:
        model, vocab = load_model(args.model)
    except (OSError, ValueError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    res = evaluate(model, vocab, args.samples)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"held-out exact match ({args.samples} samples): {res['overall']:.4f}")
        for f in FAMILIES:
            print(f"  {f:13s} {res[f]:.4f}  ({res['n_' + f]} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
