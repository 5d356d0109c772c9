"""Model: KV-cache generation equals full recompute, padding invariance, RoPE scaling rules, save/load,
and the checked-in random fixtures still match the code (reference logits)."""

import os
import tempfile
import unittest

import torch

from kvscope.tinyvlm import safetensors_io
from kvscope.tinyvlm.dataset import heldout_sample
from kvscope.tinyvlm.export_reference import random_fixture_model
from kvscope.tinyvlm.model import RotaryEmbedding, load_model, save_model
from kvscope.tinyvlm.vocab import Vocab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        cls.vocab = Vocab()

    def test_cache_generation_equals_full_recompute(self):
        for scaling in (None, {"type": "linear", "factor": 2.0}, {"type": "ntk", "factor": 4.0}):
            model = random_fixture_model(self.vocab, scaling, seed=5).eval()
            steps = 0
            for k in range(6):
                s = heldout_sample(self.vocab, k)
                images = torch.from_numpy(s.images)
                cached = model.generate(s.prompt_ids, images, max_new=10)
                full = model.generate(s.prompt_ids, images, max_new=10, use_cache=False)
                self.assertEqual(cached, full)
                steps += len(cached)
                # step logits from the cache path equal the full-sequence logits
                ids = torch.tensor(s.prompt_ids + cached[:-1])
                all_logits = model(ids, images)
                logits, cache = model(torch.tensor(s.prompt_ids), images, return_cache=True)
                pos = len(s.prompt_ids)
                self.assertLess(float((logits[-1] - all_logits[pos - 1]).abs().max()), 1e-4)
                for tok in cached[:-1][:3]:
                    logits, cache = model(torch.tensor([tok]), None, past=cache, start_pos=pos,
                                          return_cache=True)
                    self.assertLess(float((logits[-1] - all_logits[pos]).abs().max()), 1e-4)
                    pos += 1
            self.assertGreater(steps, 30)  # enough decode steps were compared

    def test_right_padding_does_not_change_logits(self):
        model = random_fixture_model(self.vocab, None, seed=2).eval()
        a, b = heldout_sample(self.vocab, 0), heldout_sample(self.vocab, 3)  # fine-grained, two-image
        self.assertNotEqual(len(a.prompt_ids), len(b.prompt_ids))
        length = max(len(a.prompt_ids), len(b.prompt_ids))
        ids = torch.zeros(2, length, dtype=torch.long)
        ids[0, :len(a.prompt_ids)] = torch.tensor(a.prompt_ids)
        ids[1, :len(b.prompt_ids)] = torch.tensor(b.prompt_ids)
        images = torch.cat([torch.from_numpy(a.images), torch.from_numpy(b.images)])
        with torch.no_grad():
            batched = model(ids, images)
            la = model(torch.tensor(a.prompt_ids), torch.from_numpy(a.images))
            lb = model(torch.tensor(b.prompt_ids), torch.from_numpy(b.images))
        self.assertLess(float((batched[0, :len(a.prompt_ids)] - la).abs().max()), 1e-4)
        self.assertLess(float((batched[1, :len(b.prompt_ids)] - lb).abs().max()), 1e-4)

    def test_rope_scaling(self):
        none = RotaryEmbedding(8, 10000.0, None)
        linear = RotaryEmbedding(8, 10000.0, {"type": "linear", "factor": 2.0})
        ntk = RotaryEmbedding(8, 10000.0, {"type": "ntk", "factor": 4.0})
        pos = torch.arange(0, 40)
        c1, s1 = none.cos_sin(pos)
        c2, s2 = linear.cos_sin(pos * 2)
        self.assertTrue(torch.allclose(c1, c2) and torch.allclose(s1, s2))
        base = 10000.0 * 4.0 ** (8 / 6)
        self.assertAlmostEqual(float(ntk.inv_freq[1]), base ** (-2 / 8), places=12)
        self.assertAlmostEqual(float(ntk.inv_freq[0]), 1.0)
        # rotate_half convention: element i pairs with i + Dh/2
        q = torch.zeros(1, 1, 1, 8)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, 1, 8)
        rq, _ = none(q, k, torch.tensor([3]))
        self.assertAlmostEqual(float(rq[..., 0]), float(torch.cos(torch.tensor(3.0))), places=6)
        self.assertAlmostEqual(float(rq[..., 4]), float(torch.sin(torch.tensor(3.0))), places=6)

    def test_save_load_and_checked_in_fixtures(self):
        model = random_fixture_model(self.vocab, {"type": "linear", "factor": 2.0}, seed=1).eval()
        with tempfile.TemporaryDirectory() as d:
            save_model(model, self.vocab, d)
            loaded, vocab = load_model(d)
            self.assertEqual(vocab.tokens, self.vocab.tokens)
            s = heldout_sample(self.vocab, 1)
            ids = torch.tensor(s.prompt_ids)
            images = torch.from_numpy(s.images)
            with torch.no_grad():
                self.assertTrue(torch.equal(model(ids, images), loaded(ids, images)))
            tensors, _ = safetensors_io.load_file(os.path.join(d, "model.safetensors"))
            del tensors["lm_head.weight"]
            safetensors_io.save_file(tensors, os.path.join(d, "model.safetensors"))
            with self.assertRaisesRegex(ValueError, "lm_head.weight"):
                load_model(d)
        for name in ("none", "linear", "ntk"):
            fdir = os.path.join(ROOT, "tests", "data", f"tinyvlm-random-{name}")
            fmodel, _ = load_model(fdir)
            ref, meta = safetensors_io.load_file(os.path.join(fdir, "reference.safetensors"))
            for i in range(int(meta["n_samples"])):
                ids = ref[f"sample.{i}.input_ids"].long()
                images = ref.get(f"sample.{i}.images")
                with torch.no_grad():
                    logits = fmodel(ids, images)
                self.assertLess(float((logits - ref[f"sample.{i}.logits"]).abs().max()), 1e-5, (name, i))
                gen = fmodel.generate(ids.tolist(), images, max_new=int(meta["max_new"]))
                self.assertEqual(gen, ref[f"sample.{i}.generated"].tolist())


if __name__ == "__main__":
    unittest.main()
