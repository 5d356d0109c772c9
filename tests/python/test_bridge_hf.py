"""Bridge on transformers models built from tiny in-code configs (random weights, no download):
LlamaForCausalLM, Qwen2ForCausalLM, LlavaForConditionalGeneration and Qwen2VLForConditionalGeneration are
captured through kvscope.bridge (transformers' AttentionInterface, no forward wrappers) during generate()
with sdpa and eager attention; the traces pass `kvcap validate`, the recorded K/V (prefill + decode) equal
the model's own KV cache, the recorded queries reproduce the model's own attention probabilities
(output_attentions), decode tokens are the fed generated ids at the model's positions, LLaVA image tokens
are vision on the patch grid, Qwen2-VL's merged 2x2 patches are vision on the merged grid with the model's
M-RoPE positions; the model's attention implementation is restored after the block; runs the bridge cannot
record raise BridgeError. Run with scripts/py (exit 77 = skipped without kvscope's Python environment);
needs KVSCOPE_CAPTURE_LIB and KVSCOPE_KVCAP (set by ctest)."""

import os
import subprocess
import sys
import tempfile
import unittest

try:
    import transformers
except ImportError:
    print(f"SKIPPED: transformers is not importable in this Python ({sys.executable}); run with scripts/py "
          "after scripts/setup")
    sys.exit(77)

import h5py
import numpy as np
import torch

from kvscope import bridge, hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVCAP = os.environ.get("KVSCOPE_KVCAP", os.path.join(ROOT, "build", "bin", "kvcap"))
L, HQ, HKV, D = 2, 4, 2, 8


def text_config(kind, vocab_size, attn="eager", **extra):
    common = dict(vocab_size=vocab_size, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=L,
                  num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn)
    common.update(extra)
    if kind == "llama":
        return transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **common)
    return transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **common)


def recorded(f, layer, t):
    return np.concatenate([f[f"layers/{layer:03d}/{t}"][:], f[f"decode/layers/{layer:03d}/{t}"][:]], axis=1)


def softmax_rows(scores):
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


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

    def check_against_cache(self, path, out, T, check_probs=True):
        """K/V in the trace == the model's returned cache; queries reproduce its attention probabilities."""
        with h5py.File(path, "r") as f:
            S = f["decode/tokens/token_id"].shape[0]
            for layer in range(L):
                k_cache = out.past_key_values.layers[layer].keys[0].numpy()  # [Hkv, T + S, D]
                v_cache = out.past_key_values.layers[layer].values[0].numpy()
                self.assertEqual(k_cache.shape[1], T + S)
                np.testing.assert_array_equal(recorded(f, layer, "k"), k_cache)
                np.testing.assert_array_equal(recorded(f, layer, "v"), v_cache)
                if not check_probs:
                    continue
                # prefill attention of the model vs softmax(q k^T / sqrt(D)) from the recorded q and k
                q = f[f"layers/{layer:03d}/q"][:]
                k = np.repeat(f[f"layers/{layer:03d}/k"][:], HQ // HKV, axis=0)
                scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)
                scores[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
                model_probs = out.attentions[0][layer][0].numpy()  # step 0 = prefill, [Hq, T, T]
                np.testing.assert_allclose(softmax_rows(scores), model_probs, atol=1e-5)
                # decode step 0's attention row from the recorded decode query
                qd = f[f"decode/layers/{layer:03d}/q"][:, 0]
                kd = np.repeat(k_cache[:, :T + 1], HQ // HKV, axis=0)
                s = np.einsum("hd,htd->ht", qd, kd) / np.sqrt(D)
                np.testing.assert_allclose(softmax_rows(s), out.attentions[1][layer][0, :, 0].numpy(), atol=1e-5)
            return f["decode/tokens/token_id"][:], f["decode/tokens/position"][:]

    def generate_captured(self, model, path, ids, tokens, new=5, **kw):
        with bridge.capture(model, path, tokens=tokens, token_text=lambda i: f"tok{i}") as cap:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 return_dict_in_generate=True, output_attentions=True, pad_token_id=0,
                                 min_new_tokens=new, **kw)
        self.validate(path)
        return out, cap

    def text_model_captured(self, kind, attn):
        model = transformers.AutoModelForCausalLM.from_config(text_config(kind, 64, attn)).eval()
        ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
        T = ids.shape[1]
        path = os.path.join(self.tmp.name, f"{kind}-{attn}.h5")
        tokens = hf.tokens_for(model, ids[0], token_text=lambda i: f"tok{i}")
        self.assertEqual(tokens.modality, [3, 0, 0, 0, 0, 0])  # <bos> special
        out, cap = self.generate_captured(model, path, ids, tokens)
        generated = out.sequences[0, T:].tolist()
        self.assertEqual(cap.decode_steps, len(generated) - 1)  # generate() does not feed its last token
        token_ids, positions = self.check_against_cache(path, out, T, check_probs=attn == "eager")
        self.assertEqual(token_ids.tolist(), generated[:-1])
        self.assertEqual(positions.tolist(), list(range(T, T + cap.decode_steps)))
        with h5py.File(path, "r") as f:
            self.assertEqual(float(f.attrs["rope_theta"]), 500.0)
            self.assertEqual(f["decode/tokens/text"][0].decode(), f"tok{generated[0]}")
        self.assertEqual(model.config._attn_implementation, attn)  # restored
        self.assertEqual(hf._ROUTES, {})

    def test_llama_eager(self):
        self.text_model_captured("llama", "eager")

    def test_llama_sdpa(self):
        self.text_model_captured("llama", "sdpa")

    def test_qwen2_eager(self):
        self.text_model_captured("qwen2", "eager")

    def test_qwen2_sdpa(self):
        self.text_model_captured("qwen2", "sdpa")

    def test_sdpa_and_eager_record_the_same(self):
        """The same weights under sdpa and eager give the same trace (to float rounding)."""
        traces = {}
        for attn in ("eager", "sdpa"):
            torch.manual_seed(1)
            model = transformers.AutoModelForCausalLM.from_config(text_config("llama", 64, attn)).eval()
            ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
            path = os.path.join(self.tmp.name, f"same-{attn}.h5")
            with bridge.capture(model, path, tokens=hf.tokens_for(model, ids[0])):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                               min_new_tokens=4, pad_token_id=0)
            traces[attn] = h5py.File(path, "r")
        for layer in range(L):
            for t in "qkv":
                np.testing.assert_allclose(recorded(traces["eager"], layer, t), recorded(traces["sdpa"], layer, t),
                                           atol=1e-5)
        for f in traces.values():
            f.close()

    def test_multi_token_forward_after_prefill_is_decode_steps(self):
        """A question fed in one forward after the context: one decode step per token, equal to feeding
        the tokens one at a time and to the prefill of the whole prompt; roles recorded."""
        model = transformers.LlamaForCausalLM(text_config("llama", 64, "sdpa")).eval()
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
                    out = model(ids[:, at:at + c], past_key_values=past, use_cache=True)
                    past, at = out.past_key_values, at + c
                nxt = out.logits[:, -1:].argmax(-1)
                model(nxt, past_key_values=past, use_cache=True)
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

    def test_generate_continues_a_prefilled_cache(self):
        """generate() on the whole prompt with the context already in the cache feeds the rest in one
        forward (decode steps), then generates: the same tokens as generate() on the whole prompt."""
        model = transformers.LlamaForCausalLM(text_config("llama", 64, "sdpa")).eval()
        ids = torch.tensor([[1, 5, 6, 7, 9, 11, 13, 17, 19]])
        T = 5
        path = os.path.join(self.tmp.name, "continue.h5")
        with bridge.capture(model, path, tokens=hf.text_tokens(model.config, ids[0, :T])) as cap:
            cache = transformers.DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids[:, :T], past_key_values=cache, use_cache=True)
            out = model.generate(ids, past_key_values=cache, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 min_new_tokens=3, do_sample=False, pad_token_id=0)
        self.validate(path)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                             do_sample=False, pad_token_id=0)
        self.assertEqual(out.tolist(), ref.tolist())
        self.assertEqual(cap.decode_steps, ids.shape[1] - T + 2)
        with h5py.File(path, "r") as f:
            self.assertEqual(f["decode/tokens/token_id"][:].tolist(), ids[0, T:].tolist() + out[0, -3:-1].tolist())

    def test_llava_generate_captured(self):
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8)
        image_token = 79
        config = transformers.LlavaConfig(vision_config=vision, text_config=text_config("llama", 80),
                                          image_token_index=image_token, vision_feature_layer=-1,
                                          attn_implementation={"text_config": "eager", "vision_config": "sdpa"})
        model = transformers.LlavaForConditionalGeneration(config).eval()
        grid = 32 // 8
        ids = torch.tensor([[1, 5] + [image_token] * grid * grid + [6, 7, 8]])  # as LlavaProcessor expands it
        pixels = torch.randn(1, 3, 32, 32)
        tokens = hf.tokens_for(model, ids[0])
        T = ids.shape[1]
        self.assertEqual(len(tokens), T)
        self.assertEqual(tokens.modality[2:2 + grid * grid], [1] * grid * grid)
        self.assertEqual(tokens.token_id[2:2 + grid * grid], [-1] * grid * grid)
        self.assertEqual(tokens.grid_row[2:2 + grid * grid], [n // grid for n in range(grid * grid)])
        self.assertEqual(tokens.grid_col[2:2 + grid * grid], [n % grid for n in range(grid * grid)])
        self.assertEqual(tokens.segment[-1], 1)  # text after the image
        vision_before = model.config.vision_config._attn_implementation
        path = os.path.join(self.tmp.name, "llava.h5")
        out, cap = self.generate_captured(model, path, ids, tokens, new=4, pixel_values=pixels)
        self.assertGreater(cap.decode_steps, 0)
        token_ids, positions = self.check_against_cache(path, out, T)
        self.assertEqual(token_ids.tolist(), out.sequences[0, T:-1].tolist())
        self.assertEqual(positions.tolist(), list(range(T, T + cap.decode_steps)))
        self.assertEqual(model.config.vision_config._attn_implementation, vision_before)
        self.assertEqual(model.config.text_config._attn_implementation, "eager")
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["tokens/modality"][:], tokens.modality)
            np.testing.assert_array_equal(f["tokens/grid"][:, 0], tokens.grid_row)
        with self.assertRaises(ValueError) as ctx:  # an unexpanded <image> (the pre-4.48 prompt format)
            hf.tokens_for(model, [1, image_token, 6])
        self.assertIn("expected 16", str(ctx.exception))

    def qwen2vl(self, attn="eager"):
        text = dict(vocab_size=128, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=L,
                    num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=256,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
        vision = dict(depth=1, embed_dim=16, hidden_size=HQ * D, num_heads=2, patch_size=2, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=100,
                                            video_token_id=101, vision_start_token_id=102, vision_end_token_id=103,
                                            attn_implementation=attn)
        return transformers.Qwen2VLForConditionalGeneration(config).eval()

    def test_qwen2vl_generate_captured(self):
        model = self.qwen2vl()
        grid_thw = torch.tensor([[1, 4, 6], [1, 2, 2]])  # two images: 4x6 and 2x2 patches -> 2x3, 1x1 tokens
        ids = torch.tensor([[1, 5, 102] + [100] * 6 + [103, 6, 7, 102, 100, 103, 8, 9]])
        pixels = torch.randn(int((grid_thw[:, 1] * grid_thw[:, 2]).sum()), 3 * 2 * 2 * 2)
        tokens = hf.tokens_for(model, ids[0], image_grid_thw=grid_thw)
        T = ids.shape[1]
        self.assertEqual(tokens.modality, [3, 0, 3] + [1] * 6 + [3, 0, 0, 3, 1, 3, 0, 0])
        self.assertEqual(tokens.grid_row[3:9], [0, 0, 0, 1, 1, 1])
        self.assertEqual(tokens.grid_col[3:9], [0, 1, 2, 0, 1, 2])
        self.assertEqual(tokens.segment[3:9], [0] * 6)
        self.assertEqual(tokens.segment[13], 1)
        self.assertEqual(tokens.segment[-1], 2)
        # M-RoPE: the model's own 3-D positions are (position, position + row, position + col) for vision
        rope, _ = model.model.get_rope_index(ids, grid_thw)
        rope = rope[:, 0].tolist()
        self.assertEqual(rope[0], tokens.position)
        self.assertEqual(rope[1], [p + max(r, 0) for p, r in zip(tokens.position, tokens.grid_row)])
        self.assertEqual(rope[2], [p + max(c, 0) for p, c in zip(tokens.position, tokens.grid_col)])
        self.assertEqual(tokens.position[:12], [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8])
        path = os.path.join(self.tmp.name, "qwen2vl.h5")
        out, cap = self.generate_captured(model, path, ids, tokens, new=4, pixel_values=pixels,
                                          image_grid_thw=grid_thw)
        self.assertEqual(cap.decode_steps, 3)
        token_ids, positions = self.check_against_cache(path, out, T, check_probs=False)
        self.assertEqual(token_ids.tolist(), out.sequences[0, T:-1].tolist())
        # decode positions: consecutive, after every context position, as the model's rope deltas give them
        self.assertGreater(positions[0], max(max(r) for r in rope))
        self.assertEqual(positions.tolist(), list(range(positions[0], positions[0] + 3)))
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["tokens/position"][:], tokens.position)
            np.testing.assert_array_equal(f["tokens/grid"][:, 1], tokens.grid_col)
            # prefill attention (M-RoPE rotated q and k) reproduces the model's probabilities
            for layer in range(L):
                q = f[f"layers/{layer:03d}/q"][:]
                k = np.repeat(f[f"layers/{layer:03d}/k"][:], HQ // HKV, axis=0)
                scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)
                scores[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
                np.testing.assert_allclose(softmax_rows(scores), out.attentions[0][layer][0].numpy(), atol=1e-5)

    def test_qwen2vl_wrong_positions_refused(self):
        """Labels whose positions are not the model's M-RoPE positions are refused by the bridge."""
        model = self.qwen2vl("sdpa")
        grid_thw = torch.tensor([[1, 4, 4]])
        ids = torch.tensor([[1, 102] + [100] * 4 + [103, 6]])
        pixels = torch.randn(16, 24)
        tokens = hf.text_tokens(model.config, ids[0])  # 1-D positions 0..T-1: wrong for the image
        path = os.path.join(self.tmp.name, "wrong.h5")
        with self.assertRaises(bridge.BridgeError) as ctx:
            with bridge.capture(model, path, tokens=tokens), torch.no_grad():
                model(ids, pixel_values=pixels, image_grid_thw=grid_thw, use_cache=True)
        self.assertIn("position", str(ctx.exception))

    def test_use_cache_false_is_refused(self):
        model = transformers.LlamaForCausalLM(text_config("llama", 64)).eval()
        ids = torch.tensor([[1, 5, 6]])
        path = os.path.join(self.tmp.name, "nocache.h5")
        with self.assertRaises(bridge.BridgeError) as ctx:
            with bridge.capture(model, path, tokens=hf.text_tokens(model.config, ids[0])), torch.no_grad():
                model(ids, use_cache=True)
                model(ids, use_cache=False)
        self.assertIn("use_cache=True", str(ctx.exception))
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 0)
        self.assertEqual(model.config._attn_implementation, "eager")

    def test_exception_in_the_model_aborts(self):
        model = transformers.LlamaForCausalLM(text_config("llama", 64, "sdpa")).eval()
        path = os.path.join(self.tmp.name, "raise.h5")
        with self.assertRaises(IndexError):
            with bridge.capture(model, path, tokens=hf.text_tokens(model.config, [1, 5, 6])), torch.no_grad():
                model(torch.tensor([[1, 5, 99]]))  # id 99 >= vocab 64
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 0)
        self.assertEqual(model.config._attn_implementation, "sdpa")
        self.assertEqual(hf._ROUTES, {})

    def test_unsupported_attention_refused(self):
        model = transformers.LlamaForCausalLM(text_config("llama", 64, "sdpa"))
        model.config._attn_implementation_internal = "paged|sdpa"
        with self.assertRaises(bridge.BridgeError) as ctx:
            with bridge.capture(model, os.path.join(self.tmp.name, "x.h5"), tokens=hf.text_tokens(model.config, [1])):
                pass
        self.assertIn("sdpa and eager", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
