"""kvscope policies inside Hugging Face models: the closed loop of `kvcap eval`, on a transformers model.

    from kvscope import hf
    with hf.apply_policy(model, "snapkv", 0.2) as run:
        out = model.generate(ids, past_key_values=run.cache, max_new_tokens=8, do_sample=False)
    run.kept_tokens(layer)[h]   # token ids resident in kv head h at the end (context t < T, decode T + j)
    run.predicted_bytes         # kvsim's bytes of the cache at the end (equal to run.held_bytes)

The first forward of the model in the block is the prefill (T tokens): it runs uncompressed and its
post-RoPE queries, keys and values are handed, layer by layer, to the C++ compressors of the closed loop
(kvscope.select: sim::PrefillCompressor / sim::DecodeCompressor, the policy code kvsim replays and
`kvcap eval` runs), when the next forward reaches the layer (so the first generated token comes from the
full prefill, as in kvcap eval). The compressed context (per kv head its own kept slots, merged and
quantized values as the policy evaluates them, log n logit bias of merged slots under proportional
attention, query heads of a merged head sharing its slots) replaces the layer's cache. Later tokens are
appended exact (prefill-mode policies) or the resident set of a decode-time policy (NAME~decode[:N]) is
recomputed from its statistics after every forward. Attention over such a cache runs in kvscope's
attention function (registered with transformers.AttentionInterface; float32 softmax with the per-slot
bias, causal inside the forward), the prefill itself in the model's own sdpa / eager.

Batch 1; the model's decoder must be one kvscope.hf supports (LLaMA family, Qwen2, LLaVA, Qwen2-VL).
"""

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .bridge import BridgeError, Hooks, TokenTable, forward_ids
from .hf import HfDecoder, text_tokens

try:  # the cache classes (transformers >= 4.56 layer API)
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError as e:  # pragma: no cover - reported when used
    raise ImportError(f"kvscope.hf.apply_policy needs transformers with transformers.cache_utils "
                      f"DynamicLayer ({e})") from e


def _np(x) -> np.ndarray:
    return x.detach().to("cpu").float().numpy()


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


class PolicyLayer(DynamicLayer):
    """One layer of a PolicyCache: keys / values [1, Hkv, N, D] with a per-slot additive logit bias
    [Hkv, N] (-inf on padding slots of heads that keep fewer than N) and the token id of each slot; its
    sequence length is the number of tokens it has seen, not the slots it stores."""

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.bias = None  # torch [Hkv, N] once the policy rewrote the layer, None = plain cache
        self.slot_token: Optional[np.ndarray] = None  # [Hkv, N] int64 token ids, -1 on padding

    def update(self, key_states, value_states, cache_kwargs=None):
        import torch

        t = int(key_states.shape[-2])
        keys, values = super().update(key_states, value_states, cache_kwargs)
        ids = np.arange(self.seen, self.seen + t)
        self.seen += t
        if self.bias is not None:
            h = self.bias.shape[0]
            self.bias = torch.cat([self.bias, self.bias.new_zeros(h, t)], dim=1)
            self.slot_token = np.concatenate([self.slot_token, np.tile(ids, (h, 1))], axis=1)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, cache_position):
        return self.seen + int(cache_position.shape[0]), 0

    def crop(self, max_length: int) -> None:
        raise BridgeError("a kvscope policy cache cannot be cropped (assisted generation is not supported)")

    def rewrite(self, heads: Sequence[Dict[str, np.ndarray]], proportional: bool, like) -> None:
        """Replaces the stored slots: per kv head tokens [K] (ascending), keys / values [K, D],
        multiplicity [K] or None."""
        import torch

        n = max((len(h["tokens"]) for h in heads), default=0)
        hkv, d = len(heads), int(like.shape[-1])
        k = torch.zeros(1, hkv, n, d, dtype=like.dtype, device=like.device)
        v = torch.zeros_like(k)
        bias = torch.full((hkv, n), float("-inf"), dtype=torch.float32, device=like.device)
        slot = np.full((hkv, n), -1, dtype=np.int64)
        for h, head in enumerate(heads):
            K = len(head["tokens"])
            if K == 0:
                continue
            k[0, h, :K] = torch.from_numpy(np.ascontiguousarray(head["keys"], dtype=np.float32)).to(like)
            v[0, h, :K] = torch.from_numpy(np.ascontiguousarray(head["values"], dtype=np.float32)).to(like)
            mult = head.get("multiplicity")
            b = np.zeros(K, dtype=np.float32)
            if proportional and mult is not None:
                b = np.log(np.asarray(mult, dtype=np.float32))
            bias[h, :K] = torch.from_numpy(b).to(bias.device)
            slot[h, :K] = np.asarray(head["tokens"], dtype=np.int64)
        self.keys, self.values, self.bias, self.slot_token = k, v, bias, slot


class PolicyCache(DynamicCache):
    """A DynamicCache whose layers are PolicyLayers, driven by a PolicyRun (see the module docstring)."""

    def __init__(self, run: "PolicyRun", num_layers: int):
        super().__init__()
        self.layers = [PolicyLayer() for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self._run = run

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        self._run._before_update(layer_idx, key_states)
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)


def biased_attention(module, query, key, value, bias, scaling: float):
    """softmax(q k^T * scaling + bias, causal inside the forward) v in float32: query [1, Hq, t, D], key /
    value [1, Hkv, N, D] (the forward's t tokens last), bias [Hkv, N]. Returns (out [1, t, Hq, D], probs)."""
    import torch

    hq, hkv = int(query.shape[1]), int(key.shape[1])
    g = hq // hkv
    t, n = int(query.shape[2]), int(key.shape[2])
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling  # [1, Hq, t, N]
    scores = scores + bias.repeat_interleave(g, dim=0)[None, :, None, :]
    if t > 1:
        causal = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
        scores[..., n - t:] = scores[..., n - t:].masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs.to(query.dtype)


class Prefill:
    """One uncompressed prefill kept to continue several policy runs from (as `kvcap eval` continues every
    point from one prefill per sample): per layer the post-RoPE queries, keys and values, and the logits of
    the last position (the first generated token comes from them)."""

    def __init__(self, model, input_ids):
        import torch

        dec = HfDecoder(model)
        hooks, self.q = Hooks(), {}

        def record(layer, module, base, query, key, value, mask, kwargs):
            self.q[layer] = _np(query[0])
            return base(module, query, key, value, mask, **kwargs)

        ids = torch.as_tensor(input_ids).reshape(1, -1)
        cache = DynamicCache()
        try:
            dec.switch(hooks)
            dec.route(hooks, record)
            with torch.no_grad():
                out = model(ids, past_key_values=cache, use_cache=True)
        finally:
            hooks.remove()
        self.ids = ids[0].tolist()
        self.keys = [cache.layers[l].keys for l in range(len(dec.attentions))]
        self.values = [cache.layers[l].values for l in range(len(dec.attentions))]
        self.logits = out.logits[0, -1]


class PolicyRun:
    """What apply_policy yields: `cache` to pass as past_key_values, and after the run what the policy kept
    and the bytes (see apply_policy)."""

    def __init__(self, model, policy, budget, tokens: Optional[TokenTable], dtype: str,
                 policy_files: Sequence[str], prefill: Optional[Prefill] = None):
        from . import select
        from . import sim

        self._select = select
        self.model = model
        self.hf = HfDecoder(model)
        g = self.hf.geometry()
        self.L, self.Hq, self.Hkv, self.D = g["num_layers"], g["num_q_heads"], g["num_kv_heads"], g["head_dim"]
        self.policy = sim._policy(policy, policy_files)
        self.budget = budget
        self.dtype = dtype
        self.policy_files = tuple(policy_files)
        self.decode_mode = str(getattr(self.policy, "mode", "prefill")).lower().endswith("decode")
        self.proportional = _truthy(dict(self.policy.params).get("proportional_attention", "true"))
        self.tokens = tokens
        self.cache = PolicyCache(self, self.L)
        self.T = None  # context tokens (the prefill's)
        self._prefill_q: List[Optional[np.ndarray]] = [None] * self.L
        self._prefill_ids = None
        self._compressor = None
        self._done = [False] * self.L  # layer rewritten after the prefill
        self._pending: List[List[tuple]] = [[] for _ in range(self.L)]  # decode-time: steps not yet added
        self._results: List[Any] = [None] * self.L  # per layer: LayerSelection or ResidentLayer
        self._cluster: List[np.ndarray] = [np.arange(self.Hkv)] * self.L
        self.forwards = 0
        self.error: Optional[BaseException] = None
        if prefill is not None:
            self._seed(prefill)

    def _seed(self, pf: "Prefill") -> None:
        """Starts from a Prefill: the cache holds its keys and values, its queries are the prefill's."""
        for layer in range(self.L):
            pl = self.cache.layers[layer]
            pl.lazy_initialization(pf.keys[layer], pf.values[layer])
            pl.keys, pl.values = pf.keys[layer].clone(), pf.values[layer].clone()
            pl.seen = int(pf.keys[layer].shape[-2])
            self._prefill_q[layer] = pf.q[layer]
        self._prefill_ids = list(pf.ids)
        self.forwards = 1

    # ---- hooks ----------------------------------------------------------------------------------------
    def _on_forward(self, args, kwargs) -> None:
        cache = kwargs.get("past_key_values")
        if cache is not self.cache:
            raise BridgeError("a forward inside kvscope.hf.apply_policy without past_key_values=run.cache (pass "
                              "the run's cache to generate() / the model)")
        ids = forward_ids(args, kwargs)
        if self.forwards == 0:
            self._prefill_ids = None if ids is None else ids.reshape(-1).tolist()
        if ids is not None and ids.dim() == 2 and ids.shape[0] != 1:
            raise BridgeError(f"kvscope.hf.apply_policy runs batch 1, got {ids.shape[0]}")
        self.forwards += 1

    def _labels(self) -> TokenTable:
        if self.tokens is not None:
            if len(self.tokens) != self.T:
                raise BridgeError(f"tokens= describes {len(self.tokens)} tokens but the prefill has {self.T}")
            return self.tokens
        if self._prefill_ids is None:
            raise BridgeError("the prefill was given no input_ids: pass tokens= (kvscope.hf.tokens_for)")
        if getattr(self.model.config, "model_type", "") in ("llava", "qwen2_vl", "qwen2_5_vl"):
            raise BridgeError("a vision-language model needs tokens= (kvscope.hf.tokens_for) for its image labels")
        return text_tokens(self.model.config, self._prefill_ids)

    def _make_compressor(self):
        t = self._labels()
        args = dict(num_layers=self.L, num_q_heads=self.Hq, num_kv_heads=self.Hkv, head_dim=self.D,
                    modality=t.modality, position=t.position, segment=t.segment, grid_row=t.grid_row,
                    grid_col=t.grid_col, dtype=self.dtype, policy_files=self.policy_files)
        cls = self._select.DecodeCompressor if self.decode_mode else self._select.PrefillCompressor
        return cls(self.policy, self.budget, **args)

    def _before_update(self, layer: int, key_states) -> None:
        """Called by the cache before it appends a forward's tokens to `layer`: applies the policy."""
        pl = self.cache.layers[layer]
        if pl.seen == 0:  # the prefill forward itself
            return
        if self.T is None:
            self.T = pl.seen
        if self._compressor is None:
            self._compressor = self._make_compressor()
        if not self._done[layer]:
            self._compress(layer, pl)
            self._done[layer] = True
        elif self.decode_mode and self._pending[layer]:
            self._advance(layer, pl)

    def _compress(self, layer: int, pl: PolicyLayer) -> None:
        q = self._prefill_q[layer]
        if q is None:
            raise BridgeError(f"layer {layer}: no prefill queries recorded")
        k, v = _np(pl.keys[0]), _np(pl.values[0])
        if self.decode_mode:
            self._compressor.set_prefill(layer, q, k, v)
            self._write_resident(layer, pl)
        else:
            sel = self._compressor.compress_layer(layer, q, k, v)
            self._results[layer] = sel
            self._cluster[layer] = np.asarray(sel.cluster)
            heads = [dict(tokens=sel.kept[h], keys=sel.keys[h], values=sel.values[h],
                          multiplicity=sel.multiplicity[h]) for h in range(self.Hkv)]
            pl.rewrite(heads, self.proportional, pl.keys)
        self._prefill_q[layer] = None

    def _write_resident(self, layer: int, pl: PolicyLayer) -> None:
        r = self._compressor.resident(layer)
        self._results[layer] = r
        order = [np.argsort(np.asarray(r.tokens[h]), kind="stable") for h in range(self.Hkv)]
        heads = [dict(tokens=np.asarray(r.tokens[h])[o], keys=np.asarray(r.keys[h])[o],
                      values=np.asarray(r.values[h])[o], multiplicity=None) for h, o in enumerate(order)]
        pl.rewrite(heads, False, pl.keys)

    def _advance(self, layer: int, pl: PolicyLayer) -> None:
        for q, k, v in self._pending[layer]:
            self._compressor.add_step(layer, q, k, v)
        self._pending[layer] = []
        self._write_resident(layer, pl)

    def _attention(self, layer: int, module, base, query, key, value, attention_mask, kwargs):
        pl = self.cache.layers[layer]
        t = int(query.shape[2])
        if pl.bias is None:  # the prefill (or a layer the policy has not rewritten)
            if self.forwards == 1:
                self._prefill_q[layer] = _np(query[0])
            return base(module, query, key, value, attention_mask, **kwargs)
        if self.decode_mode:
            n = int(key.shape[2])
            qn, kn, vn = _np(query[0]), _np(key[0, :, n - t:]), _np(value[0, :, n - t:])
            self._pending[layer].extend((qn[:, j], kn[:, j], vn[:, j]) for j in range(t))
        scaling = kwargs.get("scaling") or 1.0 / math.sqrt(int(query.shape[-1]))
        return biased_attention(module, query, key, value, pl.bias, float(scaling))

    def finish(self) -> None:
        """Applies what is pending (decode-time: the last forward's steps), so that kept_tokens and the bytes
        describe the cache after the run."""
        for layer in range(self.L):
            pl = self.cache.layers[layer]
            if self.T is not None and not self._done[layer] and pl.seen > 0 and self._prefill_q[layer] is not None:
                if self._compressor is None:
                    self._compressor = self._make_compressor()
                self._compress(layer, pl)
                self._done[layer] = True
            elif self.decode_mode and self._pending[layer]:
                self._advance(layer, pl)

    # ---- results ------------------------------------------------------------------------------------------
    def kept_tokens(self, layer: int) -> List[List[int]]:
        """Per kv head the token ids the layer's cache holds (ascending; context t < T, decode step j as
        T + j; a merged slot counts as the token it started as)."""
        pl = self.cache.layers[layer]
        if pl.slot_token is None:
            return [list(range(pl.seen)) for _ in range(self.Hkv)]
        return [sorted(int(x) for x in row if x >= 0) for row in pl.slot_token]

    @property
    def decode_steps(self) -> int:
        return 0 if self.T is None else self.cache.layers[0].seen - self.T

    @property
    def keep(self) -> float:
        if self._compressor is None:
            return 1.0
        return float(self._compressor.cap_keep if self.decode_mode else self._compressor.keep)

    @property
    def warnings(self) -> list:
        return [] if self._compressor is None else list(self._compressor.warnings)

    def _elem(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def predicted_bytes(self) -> int:
        """kvsim's bytes of the cache now: prefill mode the compressed context (sum over layers and heads of
        bytes_kept) plus the decode tokens appended exact; decode-time the replay's bytes_end per head."""
        total = 0
        for r in self._results:
            if r is None:
                raise BridgeError("the policy has not run yet (a forward after the prefill compresses)")
            total += sum(h.bytes_end if self.decode_mode else h.bytes_kept for h in r.heads)
        if not self.decode_mode:
            total += self.decode_steps * self.L * self.Hkv * 2 * self.D * self._elem()
        return int(total)

    @property
    def held_bytes(self) -> Optional[int]:
        """The bytes the cache holds, counted from its slots as the C++ closed loop counts its own
        (ClosedLoopHook::held_bytes): per layer and working kv head the context slots at the element size,
        int32 multiplicities when a merging executor compressed the head, the query-head map when heads were
        merged, every decode slot at full precision. None for quantizing policies (the cache holds their
        dequantized values; kvsim's quantized bytes are predicted_bytes)."""
        stages = dict(getattr(self.policy, "stages", {}) or {})
        if stages.get("quant", "none") != "none":
            return None
        elem, total = self._elem(), 0
        executor = stages.get("executor", "evict")
        for layer in range(self.L):
            pl = self.cache.layers[layer]
            kept = self.kept_tokens(layer)
            if self.decode_mode:
                total += sum(2 * len(h) * self.D * elem for h in kept)
                continue
            cluster = self._cluster[layer]
            counted = set()
            for h, toks in enumerate(kept):
                context = sum(1 for x in toks if x < self.T)
                total += (len(toks) - context) * 2 * self.D * elem
                w = int(cluster[h])
                if w in counted:
                    continue
                counted.add(w)
                total += 2 * context * self.D * elem
                if getattr(self.policy, "compress_tokens", False) and executor != "evict" and context < self.T:
                    total += 4 * context
            if len(counted) < self.Hkv:
                total += 4 * self.Hq
            del pl
        return int(total)


class _Applied:
    def __init__(self, run: PolicyRun):
        self.run = run
        self.hooks = Hooks()

    def __enter__(self) -> PolicyRun:
        run = self.run
        try:
            def pre(module, args, kwargs):
                run._on_forward(args, kwargs)

            self.hooks.add(run.model.register_forward_pre_hook(pre, with_kwargs=True))
            run.hf.switch(self.hooks)
            run.hf.route(self.hooks, run._attention)
        except BaseException:
            self.hooks.remove()
            raise
        return run

    def __exit__(self, exc_type, exc, tb):
        self.hooks.remove()
        if exc_type is None:
            self.run.finish()
        return False


def apply_policy(model, policy, budget=None, *, tokens: Optional[TokenTable] = None, dtype: str = "float32",
                 policy_files: Sequence[str] = (), prefill: Optional[Prefill] = None) -> _Applied:
    """A context manager yielding a PolicyRun: pass `run.cache` as past_key_values to the model /
    generate() inside the block (batch 1).

    policy: a kvscope policy name ("h2o", "snapkv+int8", "h2o~decode:4", a custom scorer) or
    kvscope.sim.policy(...); budget as kvsim takes it (0.2, "128tok", "1MiB"; None for budget-free
    policies). tokens: labels of the prefill's tokens (kvscope.hf.tokens_for; default for text models:
    hf.text_tokens of the prefill's ids). dtype: the element type bytes are accounted in (kvcap eval:
    float32). prefill: a Prefill (kvscope.hf.prefill) to start from instead of running the prefill in the
    block (the cache then holds its T tokens; feed the next token, greedy: prefill.logits.argmax()).
    Unknown policies, the oracle bound and decode mode with a merging executor raise
    kvscope.select.PolicyError (as kvcap eval refuses them)."""
    return _Applied(PolicyRun(model, policy, budget, tokens, dtype, policy_files, prefill))


def greedy(model, run: "PolicyRun", first_logits, max_new: int, eos_ids: Sequence[int] = ()) -> List[int]:
    """Greedy decoding from `first_logits` (the prefill's last logits) with run.cache, as the C++ closed loop
    decodes: each token is chosen, then fed, until an id of eos_ids or max_new tokens (the last not fed)."""
    import torch

    out, logits = [], first_logits
    with torch.no_grad():
        while len(out) < max_new:
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if nxt in eos_ids or len(out) == max_new:
                break
            logits = model(torch.tensor([[nxt]]), past_key_values=run.cache, use_cache=True).logits[0, -1]
    return out
