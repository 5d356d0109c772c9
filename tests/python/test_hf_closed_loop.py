"""kvscope policies inside a Hugging Face model (kvscope.hf.apply_policy) against the C++ closed loop that
`kvcap eval --task` runs, on the real SmolLM2-135M-Instruct and tasks of the default suite (docs/tasks.md:
passkey, needle, multikey; at 512 tokens): for h2o, snapkv and streamingllm at budgets 0.2 and 0.5, and the
decode-time policies h2o~decode at a 128-token cap and h2o~decode:4 (eviction every 4 steps) at 0.3, on the
same samples, the token ids every layer's kv heads hold at the end are the same (up to one swapped
near-tie token in at most 1 % of the (run, layer, kv head) sets), the generated tokens are the same, and the
bytes kvscope.hf reports equal the C++ closed loop's kvsim prediction (and what its cache holds). The C++
side is closed_loop_kept_tool (the functions kvcap eval runs); `kvcap eval --answers` on one task checks
that the tool's answers are kvcap eval's. A custom scorer in Python (H2O's score in numpy, registered with
kvscope.stages) keeps exactly built-in h2o's tokens through kvscope.hf.apply_policy.

Usage: scripts/py tests/python/test_hf_closed_loop.py TOOL  (KVSCOPE_KVCAP set by ctest; exit 77 = skipped
without the model, the environment or the native kvscope package)."""

import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from real_model import require_model

ROOT = Path(__file__).resolve().parents[2]
TOOL = sys.argv.pop(1) if len(sys.argv) > 1 else str(ROOT / "build" / "tests" / "python" / "closed_loop_kept_tool")
KVCAP = os.environ.get("KVSCOPE_KVCAP", str(ROOT / "build" / "bin" / "kvcap"))
# ctest runs one task (passkey) to stay inside CI's time; KVSCOPE_HF_LOOP_TASKS=passkey,needle,multikey
# runs the measurement docs/hf.md reports.
TASKS = tuple(os.environ.get("KVSCOPE_HF_LOOP_TASKS", "passkey").split(","))
LENGTH, SEED, MAX_NEW = 512, 0, 10
SAMPLES = int(os.environ.get("KVSCOPE_HF_LOOP_SAMPLES", "1"))
PREFILL_POINTS = [(p, b) for p in ("h2o", "snapkv", "streamingllm") for b in ("0.2", "0.5")]
# Decode-time policies: the cache is evicted to the cap after every step (every 4th with :4) from the
# statistics of the decode queries (docs/policies.md "Decode-time mode").
DECODE_POINTS = [("h2o~decode", "128tok"), ("h2o~decode:4", "0.3")]
POINTS = PREFILL_POINTS + DECODE_POINTS


MODEL = require_model()
try:
    import torch
    import transformers
    from kvscope import hf, hf_policy
    from kvscope import select  # noqa: F401 - the native package
    from kvscope import sim, stages
except ImportError as e:
    print(f"SKIPPED: {e} (run with scripts/py after scripts/setup, in a build with the kvscope Python package)")
    sys.exit(77)


def budget_arg(b: str):
    """A point's budget as apply_policy takes it: a fraction as a float, a token count as its text."""
    try:
        return float(b)
    except ValueError:
        return b


def h2o_scores(layer) -> "np.ndarray":
    """H2O's score in numpy (as tests/package/test_stages.py): the attention each token received from every
    prefill query, causal by position, summed over the query heads of its kv head."""
    from causal_softmax import causal_attention

    return causal_attention(layer).sum(axis=1).reshape(layer.num_kv_heads, layer.group_size, layer.T).sum(axis=1)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


class HfClosedLoop(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvscope_hfloop_")
        tmp = Path(cls.tmp.name)
        cls.tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
        cls.model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
        cls.cpp, cls.ours, cls.samples = {}, {}, {}
        points = [f"{p}@{b}" for p, b in POINTS]
        for task in TASKS:
            for line in run([TOOL, str(MODEL), task, str(LENGTH), str(SEED), str(SAMPLES), str(MAX_NEW), *points]).splitlines():
                r = json.loads(line)
                cls.cpp[(task, r["sample"], r["policy"], r["budget"])] = r
            jsonl = tmp / f"{task}.jsonl"
            run([KVCAP, "tasks", "--model", str(MODEL), "--task", task, "--length", str(LENGTH), "--seed", str(SEED),
                 "--samples", str(SAMPLES), "-o", str(jsonl)])
            cls.samples[task] = [json.loads(l) for l in jsonl.read_text().splitlines()]
            eos = cls.model.config.eos_token_id
            eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
            for s in cls.samples[task]:
                ids, _, _ = hf.task_prompt(cls.tok, s)  # the whole prompt is the prefill (kvcap eval --question-in-context)
                tokens = hf.text_tokens(cls.model.config, ids, special_ids=hf.special_ids(cls.tok))
                pf = hf.prefill(cls.model, ids)  # one prefill per sample, every point continues from it
                if not hasattr(cls, "first"):
                    cls.first = (task, s["index"], tokens, pf, eos)  # for the custom scorer's test
                for policy, budget in POINTS:
                    with hf.apply_policy(cls.model, policy, budget_arg(budget), tokens=tokens, prefill=pf) as r:
                        generated = hf_policy.greedy(cls.model, r, pf.logits, MAX_NEW, eos)
                    cls.ours[(task, s["index"], policy, budget)] = dict(
                        generated=generated, kept=[r.kept_tokens(l) for l in range(r.L)],
                        predicted_bytes=r.predicted_bytes, held_bytes=r.held_bytes, T=len(ids),
                        decode_steps=r.decode_steps)
        print(f"{len(cls.ours)} runs each side ({len(TASKS)} tasks x {SAMPLES} samples x {len(POINTS)} points)",
              flush=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_same_kept_tokens_per_layer_and_head(self):
        differ = []
        for key, ours in self.ours.items():
            theirs = self.cpp[key]
            self.assertEqual(len(ours["kept"]), len(theirs["kept"]))
            for layer, (a, b) in enumerate(zip(ours["kept"], theirs["kept"])):
                for h, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        differ.append((key, layer, h, len(set(x) ^ set(y))))
        heads = len(self.ours) * len(next(iter(self.ours.values()))["kept"]) * 3
        print(f"kept token sets: {heads - len(differ)} of {heads} (run, layer, kv head) identical; differing: "
              f"{differ}", flush=True)
        # HF's q/k/v differ from the runner's by float rounding (python.hf_vs_runner: up to 3.2e-5 of a
        # tensor's largest value), which can swap two tokens whose scores tie to that precision at the
        # selection boundary: allowed as one swapped token (symmetric difference 2) in at most 1 % of sets.
        self.assertTrue(all(d[3] <= 2 for d in differ), differ)
        self.assertLessEqual(len(differ), 0.01 * heads, differ)

    def test_decode_time_policies_evict_during_generation(self):
        # The decode-time points are compared above like the others; here: they did evict during the
        # generation, to the cap (h2o~decode at 128 tokens: 128 resident after its last eviction, which
        # follows every step), and their bytes are the replay's (bytes_end of 2 x resident x D float32).
        for key, ours in self.ours.items():
            if (key[2], key[3]) not in DECODE_POINTS:
                continue
            self.assertGreater(ours["decode_steps"], 0, key)
            sizes = {len(h) for layer in ours["kept"] for h in layer}
            decode_held = sum(t >= ours["T"] for layer in ours["kept"] for h in layer for t in h)
            print(f"{key}: T {ours['T']}, {ours['decode_steps']} decode steps fed, {min(sizes)}..{max(sizes)} "
                  f"tokens per kv head at the end ({decode_held} decode tokens over all layers and heads), "
                  f"{ours['predicted_bytes']} B, generated {self.tok.decode(ours['generated'])!r}", flush=True)
            self.assertLess(max(sizes), ours["T"], key)
            self.assertTrue(any(t >= ours["T"] for layer in ours["kept"] for h in layer for t in h), key)
            if key[2] == "h2o~decode":
                self.assertEqual(sizes, {128}, key)
            d = hf.HfDecoder(self.model).geometry()["head_dim"]
            self.assertEqual(ours["predicted_bytes"], sum(2 * len(h) * d * 4 for layer in ours["kept"] for h in layer),
                             key)

    def test_custom_python_scorer_equals_builtin_h2o(self):
        # H2O's score written in numpy, registered into the stage registry, run inside the model through
        # apply_policy: the same kept tokens per layer and kv head as built-in h2o, the same answer and bytes.
        task, index, tokens, pf, eos = self.first
        stages.register_scorer("h2o-numpy", h2o_scores, meaning="H2O in numpy", preset=False)
        for budget in ("0.2", "0.5"):
            mine = sim.policy("h2o", scorer="h2o-numpy", rename="h2o-numpy")
            with hf.apply_policy(self.model, mine, float(budget), tokens=tokens, prefill=pf) as r:
                generated = hf_policy.greedy(self.model, r, pf.logits, MAX_NEW, eos)
            builtin = self.ours[(task, index, "h2o", budget)]
            kept = [r.kept_tokens(l) for l in range(r.L)]
            differ = [(l, h) for l in range(r.L) for h in range(r.Hkv) if kept[l][h] != builtin["kept"][l][h]]
            print(f"h2o-numpy@{budget} on {task} sample {index}: kept sets differ from h2o's in {len(differ)} of "
                  f"{r.L * r.Hkv} (layer, kv head) {differ}", flush=True)
            # float64 numpy against the C++ float32 scores: the tolerance of the runner comparison above (one
            # swapped near-tie token in at most 1 % of sets, so at most one of these 90)
            self.assertLessEqual(len(differ), max(1, int(0.01 * r.L * r.Hkv)), budget)
            self.assertTrue(all(len(set(kept[l][h]) ^ set(builtin["kept"][l][h])) <= 2 for l, h in differ), budget)
            self.assertEqual(generated, builtin["generated"], budget)
            self.assertEqual(r.predicted_bytes, builtin["predicted_bytes"], budget)

    def test_same_answers(self):
        for key, ours in self.ours.items():
            self.assertEqual(ours["generated"], self.cpp[key]["generated"], key)

    def test_bytes_equal_kvsim_prediction(self):
        for key, ours in self.ours.items():
            self.assertEqual(ours["predicted_bytes"], self.cpp[key]["predicted_bytes"], key)
            self.assertEqual(ours["held_bytes"], ours["predicted_bytes"], key)
            self.assertEqual(self.cpp[key]["held_bytes"], self.cpp[key]["predicted_bytes"], key)

    def test_tool_answers_are_kvcap_evals(self):
        task = TASKS[0]
        answers = Path(self.tmp.name) / "answers.csv"
        run([KVCAP, "eval", "--model", str(MODEL), "--task", task, "--length", str(LENGTH), "--seed", str(SEED),
             "--samples", str(SAMPLES), "--max-new", str(MAX_NEW),
             "--policies", ",".join(sorted({p for p, _ in PREFILL_POINTS})),
             "--budgets", ",".join(sorted({b for _, b in PREFILL_POINTS})), "--threads", "1", "-q", "--question-in-context", "--answers", str(answers)])
        with answers.open() as f:
            rows = [r for r in csv.DictReader(f) if r["policy"] != "full"]
        self.assertEqual(len(rows), SAMPLES * len(PREFILL_POINTS))
        for r in rows:
            cpp = self.cpp[(task, int(r["sample"]), r["policy"], r["budget"])]
            self.assertEqual(r["correct"] in ("1", "true", "True"), cpp["correct"], r)


if __name__ == "__main__":
    unittest.main()
