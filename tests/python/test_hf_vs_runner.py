"""The trace captured through Hugging Face transformers (kvscope.bridge + kvscope.hf, AttentionInterface) from
the real SmolLM2-135M-Instruct equals the trace our C++ runner captures on the same input: sample 0 of the
passkey task at 1,024 tokens (`kvcap run --task passkey --length 1024 --sample 0`: the context prefilled,
question + answer prefix fed after it in one forward as decode steps, then the generated answer). Token ids,
modalities, positions, texts and roles (context and decode) identical; per layer q, k and v within 1e-3
relative (max |HF - runner| <= 1e-3 * max |runner| per tensor, float32); the same generated answer.

Usage: scripts/py tests/python/test_hf_vs_runner.py  (KVSCOPE_KVCAP, KVSCOPE_CAPTURE_LIB set by ctest;
exit 77 = skipped when the model or the environment is missing)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from real_model import require_model

ROOT = Path(__file__).resolve().parents[2]
KVCAP = os.environ.get("KVSCOPE_KVCAP", str(ROOT / "build" / "bin" / "kvcap"))
REL_TOL = 1e-3
TASK, LENGTH, SAMPLE, SEED, MAX_NEW = "passkey", 1024, 0, 0, 6
TOKEN_SETS = ["tokens/modality", "tokens/position", "tokens/token_id", "tokens/segment", "tokens/grid",
              "tokens/text", "tokens/role", "decode/tokens/token_id", "decode/tokens/position",
              "decode/tokens/text", "decode/tokens/role"]


MODEL = require_model()
try:
    import h5py
    import numpy as np
    import torch
    import transformers
except ImportError as e:
    print(f"SKIPPED: {e} (run with scripts/py after scripts/setup)")
    sys.exit(77)

from kvscope import bridge, hf  # noqa: E402


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=550)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


class HfVsRunner(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvscope_hfcap_")
        tmp = Path(cls.tmp.name)
        cls.cpp, cls.ours = str(tmp / "runner.h5"), str(tmp / "hf.h5")
        common = ["--task", TASK, "--length", str(LENGTH), "--seed", str(SEED)]
        run([KVCAP, "tasks", "--model", str(MODEL), *common, "--samples", str(SAMPLE + 1), "-o",
             str(tmp / "tasks.jsonl")])
        cls.sample = [json.loads(l) for l in (tmp / "tasks.jsonl").read_text().splitlines()][SAMPLE]
        cls.cpp_out = run([KVCAP, "run", "--model", str(MODEL), *common, "--sample", str(SAMPLE), "--max-new",
                           str(MAX_NEW), "--dtype", "float32", "--threads", "2", "-o", cls.cpp])
        tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32,
                                                                  attn_implementation="sdpa").eval()
        ids, roles, split = hf.task_prompt(tok, cls.sample)
        cls.split, cls.prompt = split, ids
        text = hf.token_text(tok)
        tokens = hf.text_tokens(model.config, ids[:split], token_text=text, special_ids=hf.special_ids(tok))
        tokens.role = roles[:split]
        full = torch.tensor([ids])
        with bridge.capture(model, cls.ours, tokens=tokens, token_text=text, model_name="smollm2-135m-instruct",
                            max_decode_steps=len(ids) - split + MAX_NEW) as cap:
            cache = transformers.DynamicCache(config=model.config)
            with torch.no_grad():
                model(full[:, :split], past_key_values=cache, use_cache=True)
            out = model.generate(full, past_key_values=cache, attention_mask=torch.ones_like(full),
                                 max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.eos_token_id)
            if int(out[0, -1]) != tok.eos_token_id:  # kvcap run feeds every generated token but <eos>
                with torch.no_grad():
                    model(out[:, -1:], past_key_values=cache, use_cache=True)
            cap.set_decode_roles(roles[split:] + [hf.ROLE_ANSWER] * (cap.decode_steps - (len(ids) - split)))
        cls.generated, cls.eos = out[0, len(ids):].tolist(), tok.eos_token_id
        cls.answer = tok.decode(cls.generated, skip_special_tokens=False)
        print(f"prompt {len(ids)} tokens ({split} prefilled); HF answer {cls.answer!r}; runner: "
              f"{cls.cpp_out.strip().splitlines()[0]}", flush=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_at_least_1000_tokens(self):
        self.assertGreaterEqual(self.split, 1000)

    def test_tokens_identical(self):
        with h5py.File(self.cpp, "r") as a, h5py.File(self.ours, "r") as b:
            for name in TOKEN_SETS:
                self.assertIn(name, a, name)
                np.testing.assert_array_equal(a[name][:], b[name][:], err_msg=name)
            for attr in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "dtype", "complete", "version"):
                self.assertEqual(a.attrs[attr], b.attrs[attr], attr)
            self.assertAlmostEqual(float(a.attrs["rope_theta"]), float(b.attrs["rope_theta"]))
            self.assertEqual(a["decode/tokens/token_id"][:len(self.prompt) - self.split].tolist(),
                             self.prompt[self.split:])

    def test_qkv_within_tolerance(self):
        worst = (0.0, "")
        with h5py.File(self.cpp, "r") as a, h5py.File(self.ours, "r") as b:
            for layer in range(int(a.attrs["num_layers"])):
                for group in ("layers", "decode/layers"):
                    for t in "qkv":
                        name = f"{group}/{layer:03d}/{t}"
                        x, y = a[name][:], b[name][:]
                        self.assertEqual(x.shape, y.shape, name)
                        rel = float(np.abs(x - y).max() / np.abs(x).max())
                        worst = max(worst, (rel, name))
                        self.assertLessEqual(rel, REL_TOL, name)
        print(f"largest q/k/v difference: {worst[0]:.2e} of the tensor's largest value ({worst[1]})", flush=True)

    def test_same_answer(self):
        with h5py.File(self.cpp, "r") as a:
            S = a["decode/tokens/token_id"].shape[0]
        fed = len(self.generated) - (self.generated[-1] == self.eos)
        self.assertEqual(S, len(self.prompt) - self.split + fed)
        self.assertIn(f"answer: {self.answer.replace('<|im_end|>', '')}", self.cpp_out)


if __name__ == "__main__":
    unittest.main()
