"""The shipped model traces/models/tiny-shapes keeps the held-out accuracy its README records (at least
MIN_ACCURACY exact match on 200 held-out samples), and its reference.safetensors matches the current code.

Issue 5 asks for >= 90 %; the shipped weights do not reach it yet (see traces/models/tiny-shapes/README.md).
This test guards what was measured, so that a regression in the model code or the weights is caught."""

import os
import sys
import unittest

import torch

from kvscope.tinyvlm import safetensors_io
from kvscope.tinyvlm.dataset import FAMILIES
from kvscope.tinyvlm.evaluate import evaluate
from kvscope.tinyvlm.model import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "traces", "models", "tiny-shapes")
MIN_ACCURACY = 0.75  # measured: see the README's table (400 samples); the target is 0.90


class ShippedModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        cls.model, cls.vocab = load_model(MODEL_DIR)

    def test_heldout_accuracy(self):
        acc = evaluate(self.model, self.vocab, 200)
        print("held-out exact match: " + " ".join(f"{k}={v}" for k, v in acc.items()), file=sys.stderr)
        self.assertGreaterEqual(acc["overall"], MIN_ACCURACY)
        for f in FAMILIES:
            self.assertGreater(acc["n_" + f], 20)

    def test_reference_matches(self):
        ref, meta = safetensors_io.load_file(os.path.join(MODEL_DIR, "reference.safetensors"))
        for i in range(int(meta["n_samples"])):
            ids = ref[f"sample.{i}.input_ids"].long()
            images = ref.get(f"sample.{i}.images")
            with torch.no_grad():
                logits = self.model(ids, images)
            self.assertLess(float((logits - ref[f"sample.{i}.logits"]).abs().max()), 1e-4)
            gen = self.model.generate(ids.tolist(), images, max_new=int(meta["max_new"]))
            self.assertEqual(gen, ref[f"sample.{i}.generated"].tolist())


if __name__ == "__main__":
    unittest.main()
