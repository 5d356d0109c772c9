"""Our C++ runner on the real pretrained model (SmolLM2-135M-Instruct, imported by scripts/setup) against
Hugging Face transformers' LlamaForCausalLM in float32 on the same folder:

* logits of every position of a >= 1,000-token prompt of real prose (GPL-3 from Debian's base-files, ids
  from HF's tokenizer) within 1e-3 max-abs, and the greedy continuation identical;
* the llama.cpp q/k row layout is caught: a copy with q_proj/k_proj rows permuted the way llama.cpp's
  converter does (which kvscope.gguf_import.unpermute_rope_rows undoes) has a far higher perplexity on a
  fixed text and no longer answers "Paris" to the fixed chat prompt, while the imported model does.

Usage: scripts/py tests/runner/test_llama_vs_hf.py LLAMA_EVAL  (exit 77 = skipped when the model is missing)
"""
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from real_model import model_dir  # noqa: E402  (tests/python/real_model.py: where scripts/setup imports it)

PROSE = Path("/usr/share/common-licenses/GPL-3")
N_PROMPT = 1024     # tokens of prose for the logits comparison
N_GREEDY = 20       # greedy continuation compared token by token
N_PPL = 256         # tokens of prose for the perplexity of the permuted copy
CHAT_QUESTION = "What is the capital of France?"
TOL = 1e-3




def skip(why: str):
    print(f"SKIPPED: {why}")
    sys.exit(77)


LLAMA_EVAL = sys.argv.pop(1) if len(sys.argv) > 1 else None
MODEL = model_dir()


def llama_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (the layout its RoPE expects)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def run_ours(model: Path, prompts, max_new: int, tmp: Path):
    """[(logits [T, V], greedy ids)] of llama_eval on each prompt (one model load)."""
    import numpy as np
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "ids.txt").write_text("".join(" ".join(str(int(i)) for i in ids) + "\n" for ids in prompts))
    r = subprocess.run([LLAMA_EVAL, str(model), str(tmp / "ids.txt"), str(tmp), str(max_new)],
                       capture_output=True, text=True, timeout=500)
    if r.returncode != 0:
        raise AssertionError(f"llama_eval failed ({r.returncode}): {r.stderr.strip()}")
    print(r.stdout.strip(), flush=True)
    return [(np.load(tmp / f"logits_{i}.npy"), [int(x) for x in (tmp / f"greedy_{i}.txt").read_text().split()])
            for i in range(len(prompts))]


def perplexity(logits, ids) -> float:
    import numpy as np
    x = logits[:-1].astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))


class LlamaVsHf(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch
        import transformers
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvscope_llama_")
        cls.tmp_path = Path(cls.tmp.name)
        cls.tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
        cls.hf = transformers.LlamaForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
        cls.hf.eval()
        cls.prose_ids = cls.tok(PROSE.read_text(), add_special_tokens=False)["input_ids"]
        cls.chat_ids = cls.tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                                   add_generation_prompt=True, tokenize=True)
        if hasattr(cls.chat_ids, "keys"):
            cls.chat_ids = cls.chat_ids["input_ids"]
        cls.chat_ids = [int(i) for i in cls.chat_ids]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def hf_greedy(self, ids, max_new):
        import torch
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                   pad_token_id=self.tok.eos_token_id)
        return [int(x) for x in out[0, len(ids):]]

    def test_1_logits_and_greedy_match_hf(self):
        import numpy as np
        import torch
        self.assertGreaterEqual(len(self.prose_ids), N_PROMPT, "the prose is too short")
        ids = self.prose_ids[:N_PROMPT]
        (ours, greedy), (_, chat) = run_ours(MODEL, [ids, self.chat_ids], N_GREEDY, self.tmp_path / "good")
        type(self).good_prose_logits, type(self).good_chat = ours[:N_PPL], chat
        with torch.no_grad():
            ref = self.hf(torch.tensor([ids])).logits[0].numpy()
        self.assertEqual(ours.shape, ref.shape)
        diff = float(np.abs(ours - ref).max())
        print(f"logits over {len(ids)} positions x {ref.shape[1]} ids: max-abs difference {diff:.3g}")
        self.assertLessEqual(diff, TOL)
        ref_greedy = self.hf_greedy(ids, N_GREEDY)
        self.assertEqual(greedy, ref_greedy)
        self.assertEqual(len(greedy), N_GREEDY)
        self.assertEqual(chat, self.hf_greedy(self.chat_ids, N_GREEDY))

    def test_2_llama_cpp_qk_layout_is_caught(self):
        import numpy as np
        from safetensors.numpy import load_file, save_file
        from kvscope.gguf_import import unpermute_rope_rows
        cfg = self.hf.config
        weights = load_file(str(MODEL / "model.safetensors"))
        permuted = dict(weights)
        for name, w in weights.items():
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.k_proj.weight"):
                n_head = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                p = llama_permute(w, n_head)
                # The importer's un-permute is the exact inverse, and the permutation changes the rows.
                np.testing.assert_array_equal(unpermute_rope_rows(p, n_head), w)
                self.assertFalse(np.array_equal(p, w), name)
                permuted[name] = np.ascontiguousarray(p)
        bad = self.tmp_path / "permuted-model"
        bad.mkdir()
        for f in MODEL.iterdir():
            if f.name != "model.safetensors":
                (bad / f.name).symlink_to(f)
        save_file(permuted, str(bad / "model.safetensors"), metadata={"format": "pt"})
        del weights, permuted

        text = self.prose_ids[:N_PPL]
        if not hasattr(self, "good_prose_logits"):  # run alone: the imported model's side here
            (prose, _), (_, chat) = run_ours(MODEL, [text, self.chat_ids], N_GREEDY, self.tmp_path / "good")
            type(self).good_prose_logits, type(self).good_chat = prose[:N_PPL], chat
        (bad_logits, _), (_, bad_answer) = run_ours(bad, [text, self.chat_ids], 12, self.tmp_path / "bad")
        ppl_good, ppl_bad = perplexity(self.good_prose_logits, text), perplexity(bad_logits, text)
        del bad_logits
        print(f"perplexity on {N_PPL} tokens of GPL-3: imported {ppl_good:.2f}, llama.cpp q/k layout "
              f"{ppl_bad:.2f}")
        self.assertLess(ppl_good, 40.0)
        self.assertGreater(ppl_bad, 5 * ppl_good)
        good_text = self.tok.decode(self.good_chat, skip_special_tokens=True)
        bad_text = self.tok.decode(bad_answer, skip_special_tokens=True)
        print(f"chat answer: imported {good_text!r}, llama.cpp q/k layout {bad_text!r}")
        self.assertIn("Paris", good_text)
        self.assertNotIn("Paris", bad_text)


if __name__ == "__main__":
    if not LLAMA_EVAL or not os.access(LLAMA_EVAL, os.X_OK):
        print("usage: test_llama_vs_hf.py LLAMA_EVAL (the built tests/runner/llama_eval)", file=sys.stderr)
        sys.exit(2)
    if not (MODEL / "model.safetensors").is_file():
        skip(f"no imported model at {MODEL} (run scripts/setup to import SmolLM2-135M-Instruct)")
    if not PROSE.is_file():
        skip(f"{PROSE} is missing (Debian's base-files ships it)")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        skip(f"transformers/torch not importable ({e}); run scripts/setup")
    unittest.main(verbosity=2)
