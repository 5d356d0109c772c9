"""kvpress interop on the real SmolLM2-135M-Instruct (the first 1,400 bytes of a passkey sample of `kvcap
tasks` as the context, its question after it, split as kvpress's pipeline splits them: the context
compressed, the question after):

1. KvscopePress runs kvscope policies inside kvpress's KVPressTextGenerationPipeline (snapkv, streamingllm
   and the multimodal policies unicache, hybridkv, look-m; KVSCOPE_KVPRESS_POLICIES=a,b picks others); the
   context tokens it keeps per layer and kv head equal kvscope.hf.apply_policy's on the same ids, and for
   the eviction policies the answer is the same.
2. kvscope's snapkv / tova / knorm / streamingllm against kvpress's presses of the same name on the
   same prefill: the kept token sets per layer and kv head, with kvscope's preset and with the INI
   equivalent docs/policies.md ("Mapping onto kvpress presses") gives, at kvpress's own kept count. knorm,
   streamingllm and the tova and snapkv equivalents keep identical sets; the measured agreement of each is
   printed (docs/policies.md, "kvscope against kvpress, measured"). For SnapKVPress also: the
   snapkv-kvpress preset at budget 1 - r (its keep_rounding = kvpress gives kvpress's count) keeps
   identical sets; kvpress's score written in numpy (snapkv_press_scores) keeps identical sets through
   kvscope's selection, and the same score pooled over every key (kvscope's snap_pool_span = all, which
   lets the last keys before the window see the window's scores) does not: that pooling is the whole
   difference between snapkv-kvpress with snap_pool_span = all and the press.
3. kvscope's h2o against kvpress's ObservedAttentionPress, which reads the attention weights and so needs
   eager attention: one extra prefill of the same ids in a copy of the model loaded with
   attn_implementation="eager", the press applied to it and kvscope's policies run on its q, k, v. The
   definitions differ (kvpress divides a token's summed attention by the number of queries that see it,
   T - t, and forces nothing; h2o sums and forces the newest half of k), so h2o and h2o with
   recent_fraction 0 are only measured; a Python scorer with kvpress's normalisation registered into
   kvscope (kvscope.stages) must keep kvpress's sets, which shows that the normalisation is the whole
   difference.

Usage: scripts/py tests/python/test_kvpress.py  (KVSCOPE_KVCAP set by ctest; exit 77 = skipped without the
model, kvpress or the native kvscope package)."""

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
RATIO = 0.7  # kvpress compression_ratio (fraction removed)
CONTEXT_BYTES = 1400


MODEL = require_model()
try:
    import numpy as np
    import torch
    import transformers
    import kvpress
    from kvscope import hf, select, sim
    from kvscope.kvpress_press import KvscopePress

    from causal_softmax import causal_attention
except ImportError as e:
    print(f"SKIPPED: {e} (kvpress and the native kvscope package come with scripts/setup and the build; run "
          "with scripts/py)")
    sys.exit(77)

# kvscope policy (preset, INI equivalent of docs/policies.md) for each kvpress press; the test requires the
# equivalent to keep the press's sets (assertSameSets).
COMPARE = {
    "knorm": (kvpress.KnormPress, "knorm", {}),
    "streamingllm": (kvpress.StreamingLLMPress, "streamingllm", {}),
    "snapkv": (kvpress.SnapKVPress, "snapkv", dict(snap_window=64, snap_kernel=5, snap_pool="avg",
                                                   snap_pool_span="split", recent=64)),
    "tova": (kvpress.TOVAPress, "tova", dict(shared_heads=True, recent=1)),
}


def kept_from_keys(full, compressed):
    """Per kv head, the context indices whose keys a press kept (rows matched exactly)."""
    out = []
    for h in range(full.shape[0]):
        index = {full[h, t].tobytes(): t for t in range(full.shape[1])}
        out.append(sorted(index[row.tobytes()] for row in compressed[h]))
    return out


def snapkv_press_scores(layer, window=64, kernel=5, pool_all_keys=False):
    """kvpress 0.5.5 SnapKVPress.score on kvscope's q, k (float64 here, float32 in kvpress): the softmax of the
    last `window` queries over all keys they see (causal), the columns of the keys before the window kept,
    mean over the window's queries, F.avg_pool1d(kernel, padding kernel // 2, zeros counted) over those keys
    only, mean over the query heads of each kv head; the window's keys get max + 1. pool_all_keys: pool
    over every key (the window's columns too) and then cut, as kvscope's snap_pool_span = all does."""
    T, G, W = layer.T, layer.group_size, window
    p = causal_attention(layer, T - W)  # [Hq, W, T]
    s = p.mean(axis=1) if pool_all_keys else p[:, :, :T - W].mean(axis=1)
    r = kernel // 2
    padded = np.pad(s, ((0, 0), (r, r)))
    pooled = sum(padded[:, u:u + s.shape[1]] for u in range(kernel)) / kernel
    per_kv = pooled[:, :T - W].reshape(layer.num_kv_heads, G, T - W).mean(axis=1)
    return np.concatenate([per_kv, np.full((layer.num_kv_heads, W), per_kv.max() + 1)], axis=1)


def observed_attention_scores(layer):
    """kvpress 0.5.5 ObservedAttentionPress.score on kvscope's q, k: the causal attention each token receives,
    summed over the prefill queries, divided by the number of queries that see it (T - t), mean over the
    query heads of its kv head (float64 here, float32 in kvpress)."""
    per_q_head = causal_attention(layer).sum(axis=1) / np.arange(layer.T, 0, -1, dtype=np.float64)  # [Hq, T]
    return per_q_head.reshape(layer.num_kv_heads, layer.group_size, layer.T).mean(axis=1)


class KvpressInterop(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        cls.tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
        cls.model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32,
                                                                      attn_implementation="sdpa").eval()
        with tempfile.TemporaryDirectory() as tmp:
            jsonl = Path(tmp) / "t.jsonl"
            subprocess.run([KVCAP, "tasks", "--model", str(MODEL), "--task", "passkey", "--length", "512",
                            "--seed", "0", "--samples", "1", "-o", str(jsonl)], check=True, timeout=300)
            s = json.loads(jsonl.read_text().splitlines()[0])
        cls.sample = s
        user = s["user"].encode()  # the offsets are bytes; the context cut to about 300 tokens (CPU time)
        cls.context = user[:min(s["question_char"], CONTEXT_BYTES)].decode(errors="ignore")
        cls.question = user[s["question_char"]:].decode()
        cls.pipe = kvpress.KVPressTextGenerationPipeline(model=cls.model, tokenizer=cls.tok)
        inputs = cls.pipe.preprocess(cls.context, [cls.question], s["answer_prefix"], 100000)
        cls.ctx_ids, cls.q_ids = inputs["context_ids"], inputs["questions_ids"][0]
        cls.T = cls.ctx_ids.shape[1]

    def answer(self, press):
        return self.pipe(self.context, question=self.question, answer_prefix=self.sample["answer_prefix"],
                         press=press, max_new_tokens=10)["answer"]

    def apply_policy(self, policy, budget):
        """kvscope.hf.apply_policy on the pipeline's ids as the pipeline runs them: the context prefilled
        (one Prefill shared by every policy) and compressed, the question in one forward, then greedy."""
        from kvscope import hf_policy
        if not hasattr(self, "pf"):
            type(self).pf = hf.prefill(self.model, self.ctx_ids[0])
        eos = self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        with hf.apply_policy(self.model, policy, budget, prefill=self.pf) as run, torch.no_grad():
            logits = self.model(self.q_ids, past_key_values=run.cache, use_cache=True).logits[0, -1]
            generated = hf_policy.greedy(self.model, run, logits, 10, eos)
        kept = [[[t for t in h if t < self.T] for h in run.kept_tokens(l)] for l in range(run.L)]
        return self.tok.decode(generated, skip_special_tokens=True), kept

    def test_kvscope_press_in_the_pipeline(self):
        # The press labels the context as apply_policy does (hf.text_tokens of the ids: bos / eos / pad
        # special); the kept sets are equal in every layer and kv head for every policy. Where the policy
        # only evicts (snapkv, streamingllm, hybridkv) the cache is the same and so is the answer; merging
        # policies (unicache, look-m) attend without the log n bias of merged slots in kvpress's cache, so
        # their answers may differ (they are printed).
        names = os.environ.get("KVSCOPE_KVPRESS_POLICIES", "snapkv,streamingllm,unicache,hybridkv,look-m")
        for policy in names.split(","):
            with self.subTest(policy=policy):
                stages = sim.policy(policy).stages
                exact = stages["executor"] == "evict" and stages["quant"] == "none"
                press = KvscopePress(policy, budget=0.3)
                answer = self.answer(press)
                self.assertIsInstance(answer, str)
                ours, kept = self.apply_policy(policy, 0.3)
                for layer in range(len(kept)):
                    self.assertEqual(press.kept_tokens(layer), kept[layer], (policy, layer))
                if exact:
                    self.assertEqual(answer, ours, policy)
                slots = sorted({max(len(k) for k in s.kept) for s in press.selections})
                print(f"{policy}: kept sets equal in {len(kept)} layers x {len(kept[0])} kv heads; slots per "
                      f"layer {slots[0]}..{slots[-1]}; pipeline answer {answer!r}, kvscope.hf {ours!r}"
                      f"{'' if exact else ' (merging: answers not compared)'}", flush=True)

    def press_and_prefill(self, model, press, pf=None):
        """The press applied to the context's prefill in `model`, and kvscope's recording of the same
        prefill (`pf`, or a new one): (pf, kvpress's kept sets [layer][kv head])."""
        if pf is None:
            pf = hf.prefill(model, self.ctx_ids[0])
        L = len(pf.keys)
        cache = transformers.DynamicCache(config=model.config)
        with press(model), torch.no_grad():
            model.model(input_ids=self.ctx_ids, past_key_values=cache)
        theirs = [kept_from_keys(pf.keys[l][0].numpy(), cache.layers[l].keys[0].numpy()) for l in range(L)]
        return pf, theirs

    def agreement(self, spec, pf, theirs, n_kept, budget=None):
        """kvscope's policy `spec` on the prefill's q, k, v at n_kept tokens per kv head (or at `budget`)
        against kvpress's kept sets: (identical (layer, kv head) sets, mean Jaccard)."""
        g = hf.HfDecoder(self.model).geometry()
        c = select.PrefillCompressor(spec, budget if budget is not None else f"{n_kept}tok", num_layers=g["num_layers"], num_q_heads=g["num_q_heads"],
                                     num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"], modality=[0] * self.T)
        same, jac = 0, []
        for l in range(g["num_layers"]):
            sel = c.compress_layer(l, pf.q[l], pf.keys[l][0].numpy(), pf.values[l][0].numpy())
            for h, mine in enumerate(sel.kept):
                a, b = set(int(x) for x in mine), set(theirs[l][h])
                same += a == b
                jac.append(len(a & b) / len(a | b))
        return same, float(np.mean(jac))

    def assertSameSets(self, result, heads, label):
        """kvpress's float32 torch scores and kvscope's may order two tokens that tie to float precision at the
        selection boundary differently on another CPU or BLAS: one (layer, kv head) set may differ, by a
        swapped token or so (mean Jaccard >= 0.999); every other set must be identical."""
        identical, jaccard = result
        self.assertGreaterEqual(identical, heads - 1, label)
        self.assertGreaterEqual(jaccard, 0.999, label)

    def test_same_named_presses(self):
        ratio = RATIO
        n_kept = max(1, int(self.T * (1 - ratio)))
        g = hf.HfDecoder(self.model).geometry()
        heads = g["num_layers"] * g["num_kv_heads"]
        if not hasattr(self, "pf"):
            type(self).pf = hf.prefill(self.model, self.ctx_ids[0])
        rows = []
        snap = {}
        for name, (press_cls, preset, equivalent) in COMPARE.items():
            pf, theirs = self.press_and_prefill(self.model, press_cls(compression_ratio=ratio), self.pf)
            result = {}
            for label, spec in (("preset", sim.policy(preset)),
                                ("equivalent", sim.policy(preset, rename=f"{preset}-kvpress-ini", **equivalent))):
                result[label] = self.agreement(spec, pf, theirs, n_kept)
            if name == "snapkv":
                snap = self.snapkv_press_isolated(pf, theirs, n_kept, 1 - ratio)
            rows.append((name, press_cls.__name__, heads, result))
            print(f"{name}: {press_cls.__name__} at compression_ratio {ratio} (T {self.T}, {n_kept} kept): "
                  f"preset identical {result['preset'][0]}/{heads} (mean Jaccard {result['preset'][1]:.3f}), "
                  f"equivalent identical {result['equivalent'][0]}/{heads} (mean Jaccard "
                  f"{result['equivalent'][1]:.3f})", flush=True)
        for name, _, heads, result in rows:
            self.assertSameSets(result["equivalent"], heads, name)
        heads = rows[0][2]
        # The preset at kvpress's ratio, and kvpress's score in numpy, keep SnapKVPress's sets ...
        self.assertSameSets(snap["snapkv-kvpress"], heads, "snapkv-kvpress")
        self.assertSameSets(snap["kvpress's score as a Python scorer"], heads, "SnapKVPress's score in numpy")
        # ... and pooling over every key (the window's scores reaching the last keys before it) does not.
        self.assertLess(snap["the same score pooled over all keys"][0], heads)
        self.assertLess(snap["snapkv-kvpress, snap_pool_span = all"][0], heads)

    def snapkv_press_isolated(self, pf, theirs, n_kept, budget):
        """SnapKVPress's kept sets against the snapkv-kvpress preset at `budget` (1 - compression_ratio, so its
        keep_rounding = kvpress gives kvpress's count), the preset with snap_pool_span = all, and kvpress's
        score as a numpy scorer, pooled as kvpress pools and over all keys (the window forced: recent 64)."""
        from kvscope import stages
        stages.register_scorer("snapkv-press-py", snapkv_press_scores,
                               meaning="kvpress SnapKVPress's score in numpy", preset=False)
        stages.register_scorer("snapkv-press-all-keys-py", lambda l: snapkv_press_scores(l, pool_all_keys=True),
                               meaning="kvpress SnapKVPress's score pooled over all keys", preset=False)
        g = hf.HfDecoder(self.model).geometry()
        heads = g["num_layers"] * g["num_kv_heads"]
        result = {
            "snapkv-kvpress": self.agreement(sim.policy("snapkv-kvpress"), pf, theirs, n_kept, budget),
            "snapkv-kvpress, snap_pool_span = all": self.agreement(
                sim.policy("snapkv-kvpress", snap_pool_span="all", rename="snapkv-kvpress-all"), pf, theirs,
                n_kept, budget),
            "kvpress's score as a Python scorer": self.agreement(
                sim.policy("snapkv", scorer="snapkv-press-py", recent=64, rename="snapkv-press-py"), pf, theirs,
                n_kept),
            "the same score pooled over all keys": self.agreement(
                sim.policy("snapkv", scorer="snapkv-press-all-keys-py", recent=64, rename="snapkv-press-all-py"),
                pf, theirs, n_kept),
        }
        print(f"snapkv: SnapKVPress at compression_ratio {RATIO} (T {self.T}, {n_kept} kept): "
              + "; ".join(f"{k} identical {v[0]}/{heads} (mean Jaccard {v[1]:.4f})" for k, v in result.items()),
              flush=True)
        return result

    def test_observed_attention_press_against_h2o(self):
        # ObservedAttentionPress reads the attention weights, which only eager attention returns: the same
        # ids prefilled once more in an eager copy of the model, kvscope's policies on that prefill's q, k, v.
        from kvscope import stages
        eager = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        n_kept = max(1, int(self.T * (1 - RATIO)))
        pf, theirs = self.press_and_prefill(eager, kvpress.ObservedAttentionPress(compression_ratio=RATIO))
        stages.register_scorer("observed-attention-py", observed_attention_scores,
                               meaning="kvpress ObservedAttentionPress's score in numpy", preset=False)
        g = hf.HfDecoder(eager).geometry()
        heads = g["num_layers"] * g["num_kv_heads"]
        result = {
            "h2o": self.agreement(sim.policy("h2o"), pf, theirs, n_kept),
            "h2o, recent_fraction 0": self.agreement(
                sim.policy("h2o", recent_fraction=0, rename="h2o-no-recent"), pf, theirs, n_kept),
            "kvpress's score as a Python scorer": self.agreement(
                sim.policy("h2o", scorer="observed-attention-py", recent_fraction=0, rename="observed-attention-py"),
                pf, theirs, n_kept),
        }
        print(f"h2o: ObservedAttentionPress at compression_ratio {RATIO} (eager prefill, T {self.T}, {n_kept} kept): "
              + "; ".join(f"{k} identical {v[0]}/{heads} (mean Jaccard {v[1]:.3f})" for k, v in result.items()),
              flush=True)
        # The normalisation by T - t (and nothing forced) is the whole difference: kvpress's score computed
        # in Python and run through kvscope's selection keeps kvpress's sets.
        self.assertSameSets(result["kvpress's score as a Python scorer"], heads, "ObservedAttentionPress's score")
        # and it is a difference: h2o's plain sum keeps other sets
        self.assertLess(result["h2o, recent_fraction 0"][0], heads)


if __name__ == "__main__":
    unittest.main()
