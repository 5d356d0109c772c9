"""Smoke training (< 90 s): the loss decreases, the written model loads, evaluates and exports."""

import json
import os
import sys
import tempfile
import time
import unittest

import torch

from kvscope.tinyvlm import safetensors_io, train
from kvscope.tinyvlm.evaluate import evaluate
from kvscope.tinyvlm.export_reference import export
from kvscope.tinyvlm.model import load_model


class SmokeTrainTest(unittest.TestCase):
    def test_smoke_training(self):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.time()
            self.assertEqual(train.main(["--out", d, "--smoke", "--seed", "3", "--threads", "1"]), 0)
            print(f"smoke training took {time.time() - t0:.1f}s", file=sys.stderr)
            with open(os.path.join(d, "train_log.json")) as f:
                log = json.load(f)
            self.assertEqual(log["steps"], 40)
            self.assertLess(log["last_loss"], 0.8 * log["first_loss"], log)
            model, vocab = load_model(d)
            acc = evaluate(model, vocab, 8)
            self.assertTrue(0.0 <= acc["overall"] <= 1.0)
            export(model, vocab, os.path.join(d, "reference.safetensors"), max_new=4)
            ref, meta = safetensors_io.load_file(os.path.join(d, "reference.safetensors"))
            self.assertEqual(int(meta["n_samples"]), 5)
            ids = ref["sample.2.input_ids"].long()
            self.assertEqual(int((ids == -1).sum()), 128)  # the two-image sample
            with torch.no_grad():
                logits = model(ids, ref["sample.2.images"])
            self.assertLess(float((logits - ref["sample.2.logits"]).abs().max()), 1e-5)

    def test_bad_arguments(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(train.main(["--out", d, "--steps", "0"]), 2)


if __name__ == "__main__":
    unittest.main()
