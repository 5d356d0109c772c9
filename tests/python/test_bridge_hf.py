"""Bridge on transformers models built from tiny in-code configs (random weights, no download):
LlamaForCausalLM and LlavaForConditionalGeneration are captured through kvscope.bridge during generate(),
the traces pass `kvcap validate`, the recorded K/V (prefill + decode) equal the model's own KV cache, the
recorded queries reproduce the model's own attention probabilities (output_attentions), decode tokens are
the fed generated ids at positions T.., and LLaVA image tokens are labelled vision on the patch grid.
Skips (exit 0, message "transformers is not importable") without transformers; needs KVSCOPE_CAPTURE_LIB
and KVSCOPE_KVCAP (set by ctest)."""

import os
import subprocess
import sys
import tempfile
import unittest

try:
    import transformers
except ImportError:
    print("SKIPPED: transformers is not importable in this Python "
          f"({sys.executable}); install it (see scripts/setup) to run the transformers bridge tests")
    sys.exit(0)

import h5py
import numpy as np
import torch

from kvscope import bridge, hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVCAP = os.environ.get("KVSCOPE_KVCAP", os.path.join(ROOT, "build", "bin", "kvcap"))
L, HQ, HKV, D = 2, 4, 2, 8


def tiny_llama_config(vocab_size):
    return transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=HQ * D, intermediate_size=64,
                                    num_hidden_layers=L, num_attention_heads=HQ, num_key_value_heads=HKV,
                                    max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, rope_theta=500.0, attn_implementation="eager")


def recorded(f, layer, t):
    return np.concatenate([f[f"layers/{layer:03d}/{t}"][:], f[f"decode/layers/{layer:03d}/{t}"][:]], axis=1)


class BridgeTransformersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        torch.manual_seed(0)

    def tearDown(self):
        self.tmp.cleanup()

    def validate(self, path):
        r = subprocess.run([KVCAP, "validate", path], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("valid kvscope trace", r.stdout)

    def check_against_cache(self, path, out, T):
        """K/V in the trace == the model's returned cache; queries reproduce its attention probabilities."""
        with h5py.File(path, "r") as f:
            S = f["decode/tokens/token_id"].shape[0]
            for layer in range(L):
                k_cache = out.past_key_values[layer][0][0].numpy()  # [Hkv, T + S, D]
                v_cache = out.past_key_values[layer][1][0].numpy()
                self.assertEqual(k_cache.shape[1], T + S)
                np.testing.assert_array_equal(recorded(f, layer, "k"), k_cache)
                np.testing.assert_array_equal(recorded(f, layer, "v"), v_cache)
                # prefill attention of the model vs softmax(q k^T / sqrt(D)) from the recorded q and k
                q = f[f"layers/{layer:03d}/q"][:]
                k = np.repeat(f[f"layers/{layer:03d}/k"][:], HQ // HKV, axis=0)
                scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)
                scores[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                model_probs = out.attentions[0][layer][0].numpy()  # step 0 = prefill, [Hq, T, T]
                np.testing.assert_allclose(probs, model_probs, atol=1e-5)
                # decode step 1's attention row from the recorded decode query
                qd = f[f"decode/layers/{layer:03d}/q"][:, 0]
                kd = np.repeat(k_cache[:, :T + 1], HQ // HKV, axis=0)
                s = np.einsum("hd,htd->ht", qd, kd) / np.sqrt(D)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                np.testing.assert_allclose(p, out.attentions[1][layer][0, :, 0].numpy(), atol=1e-5)
            return f["decode/tokens/token_id"][:], f["decode/tokens/position"][:]

    def test_llama_generate_captured(self):
        model = transformers.LlamaForCausalLM(tiny_llama_config(64)).eval()
        ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
        T, new = ids.shape[1], 5
        path = os.path.join(self.tmp.name, "llama.h5")
        tokens = hf.text_tokens(model.config, ids[0], token_text=lambda i: f"tok{i}")
        self.assertEqual(tokens.modality, [3, 0, 0, 0, 0, 0])  # <bos> special
        with bridge.capture(model, path, tokens=tokens, token_text=lambda i: f"tok{i}") as cap:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, return_dict_in_generate=True, output_attentions=True,
                                 pad_token_id=0)
        self.validate(path)
        generated = out.sequences[0, T:].tolist()
        self.assertEqual(cap.decode_steps, len(generated) - 1)  # generate() does not feed its last token
        token_ids, positions = self.check_against_cache(path, out, T)
        self.assertEqual(token_ids.tolist(), generated[:-1])
        self.assertEqual(positions.tolist(), list(range(T, T + cap.decode_steps)))
        with h5py.File(path, "r") as f:
            self.assertEqual(float(f.attrs["rope_theta"]), 500.0)
            self.assertEqual(f["decode/tokens/text"][0].decode(), f"tok{generated[0]}")
        self.assertNotIn("forward", vars(model.model.layers[0].self_attn))

    def test_multi_token_forward_after_prefill_is_decode_steps(self):
        """A question fed in one forward after the context: one decode step per token, equal to feeding
        the tokens one at a time and to the prefill of the whole prompt; roles recorded."""
        model = transformers.LlamaForCausalLM(tiny_llama_config(64)).eval()
        ids = torch.tensor([[1, 5, 6, 7, 9, 11, 13, 17, 19]])
        T, n = 5, 4  # context ids[:5], then 4 tokens in one forward (or one at a time), then one generated
        runs = {}
        for name, chunks in (("one", [n]), ("each", [1] * n), ("whole", [])):
            path = os.path.join(self.tmp.name, f"{name}.h5")
            ctx = ids if name == "whole" else ids[:, :T]
            tokens = hf.text_tokens(model.config, ctx[0])
            if name != "whole":
                tokens.role = [3] + [0] * (T - 1)
            with bridge.capture(model, path, tokens=tokens) as cap, torch.no_grad():
                out = model(ctx, use_cache=True)
                past, at = out.past_key_values, ctx.shape[1]
                for c in chunks:
                    out = model(ids[:, at:at + c], past_key_values=past, use_cache=True,
                                position_ids=torch.arange(at, at + c)[None])
                    past, at = out.past_key_values, at + c
                nxt = out.logits[:, -1:].argmax(-1)
                model(nxt, past_key_values=past, use_cache=True, position_ids=torch.tensor([[at]]))
                if name != "whole":
                    cap.set_decode_roles([1, 1, 1, 3, 2])
            self.validate(path)
            runs[name] = h5py.File(path, "r")
        one, each, whole = runs["one"], runs["each"], runs["whole"]
        self.assertEqual(one["decode/tokens/token_id"][:n].tolist(), ids[0, T:].tolist())
        self.assertEqual(one["decode/tokens/position"][:].tolist(), list(range(T, T + n + 1)))
        self.assertEqual(one["decode/tokens/role"][:].tolist(), [1, 1, 1, 3, 2])
        self.assertEqual(one["tokens/role"][:].tolist(), [3, 0, 0, 0, 0])
        self.assertEqual(one.attrs["version"], "1.1")
        for layer in range(L):
            for t in "qkv":
                a = one[f"decode/layers/{layer:03d}/{t}"][:]
                np.testing.assert_allclose(a, each[f"decode/layers/{layer:03d}/{t}"][:], atol=1e-5)
                np.testing.assert_allclose(a[:, :n], whole[f"layers/{layer:03d}/{t}"][:, T:], atol=1e-5)
                np.testing.assert_allclose(a[:, n:], whole[f"decode/layers/{layer:03d}/{t}"][:], atol=1e-5)
        for f in runs.values():
            f.close()

    def test_llava_generate_captured(self):
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8)
        image_token = 79
        config = transformers.LlavaConfig(vision_config=vision, text_config=tiny_llama_config(80),
                                          image_token_index=image_token, vision_feature_layer=-1)
        model = transformers.LlavaForConditionalGeneration(config).eval()
        ids = torch.tensor([[1, 5, image_token, 6, 7, 8]])
        pixels = torch.randn(1, 3, 32, 32)
        grid = 32 // 8
        tokens = hf.llava_tokens(model.config, ids[0])
        T = ids.shape[1] - 1 + grid * grid
        self.assertEqual(len(tokens), T)
        self.assertEqual(tokens.modality[2:2 + grid * grid], [1] * grid * grid)
        self.assertEqual(tokens.grid_row[2:2 + grid * grid], [n // grid for n in range(grid * grid)])
        self.assertEqual(tokens.grid_col[2:2 + grid * grid], [n % grid for n in range(grid * grid)])
        self.assertEqual(tokens.segment[-1], 1)  # text after the image
        path = os.path.join(self.tmp.name, "llava.h5")
        with bridge.capture(model, path, tokens=tokens) as cap:
            out = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                 output_attentions=True, pad_token_id=0)
        self.validate(path)
        self.assertGreater(cap.decode_steps, 0)
        token_ids, positions = self.check_against_cache(path, out, T)
        self.assertEqual(token_ids.tolist(), out.sequences[0, ids.shape[1]:-1].tolist())
        self.assertEqual(positions.tolist(), list(range(T, T + cap.decode_steps)))
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["tokens/modality"][:], tokens.modality)
            np.testing.assert_array_equal(f["tokens/grid"][:, 0], tokens.grid_row)

    def test_use_cache_false_is_refused(self):
        model = transformers.LlamaForCausalLM(tiny_llama_config(64)).eval()
        ids = torch.tensor([[1, 5, 6]])
        path = os.path.join(self.tmp.name, "nocache.h5")
        with self.assertRaises(bridge.BridgeError) as ctx:
            with bridge.capture(model, path, tokens=hf.text_tokens(model.config, ids[0])):
                model(ids, use_cache=False)
        self.assertIn("use_cache=True", str(ctx.exception))
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 0)


if __name__ == "__main__":
    unittest.main()
