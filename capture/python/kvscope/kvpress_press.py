"""A kvpress press that runs a kvscope policy: kvpress's pipeline (and anything that takes a press) can run
kvscope's policies (UniCache, HybridKV, LOOK-M, h2o, snapkv, compositions, custom scorers) through the C++
policy code kvsim replays and `kvcap eval` runs (kvscope.select.PrefillCompressor).

    from kvpress import KVPressTextGenerationPipeline
    from kvscope.kvpress_press import KvscopePress
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    press = KvscopePress("unicache", budget=0.3)
    answer = pipe(context, question=question, press=press)["answer"]
    press.kept_tokens(layer)       # per kv head the context tokens kept

How it fits kvpress's protocol (kvpress.presses.base_press.BasePress): `press(model)` is the context
manager kvpress opens around the prefill; inside it the decoder's attention runs through kvscope's
attention function (transformers.AttentionInterface, see kvscope.hf), which records each layer's post-RoPE
queries, and kvpress's forward hook calls `compress(...)` after each attention layer, which hands q, k, v
to the compressor (layers in order) and returns the layer's compressed keys and values. kvpress caches hold
one length per layer, so a layer whose kv heads keep different numbers of slots is padded to the largest,
and the padding slots are masked in later forwards the way kvpress's AdaKVPress masks head-wise evictions
(`module.masked_key_indices`, kvpress's attention patch; sdpa attention). Merged slots (UniCache's merging
executor) keep their merged keys and values but not the log n logit bias kvscope adds under proportional
attention (kvpress's cache has no per-slot bias): with merging policies the attention after compression
differs from kvsim's / kvscope.hf's by that bias; eviction and quantization are exact. Prefill-mode
policies only (kvpress applies presses during the prefill).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .bridge import BridgeError, Hooks, TokenTable
from .hf import HfDecoder

try:
    from kvpress.presses.base_press import BasePress
except ImportError as e:  # pragma: no cover - reported when used
    raise ImportError(f"kvscope.kvpress_press needs kvpress (in kvscope's Python environment: scripts/setup): {e}")


@dataclass
class KvscopePress(BasePress):
    """policy: a kvscope policy name or kvscope.sim.policy(...); budget as kvsim takes it (fraction of tokens
    kept, "128tok", bytes), or compression_ratio (kvpress's: the fraction removed, budget = 1 - ratio).
    tokens: labels of the context tokens (kvscope.hf.tokens_for; default: every token text, positions
    0..T-1). dtype: element type the bytes are accounted in."""

    policy: Any = "snapkv"
    budget: Any = None
    compression_ratio: Optional[float] = None
    tokens: Optional[TokenTable] = None
    dtype: str = "float32"
    policy_files: Sequence[str] = ()
    selections: List[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        from . import sim
        self._spec = sim._policy(self.policy, self.policy_files)
        if str(getattr(self._spec, "mode", "prefill")).lower().endswith("decode"):
            raise ValueError(f"{self._spec.name}: decode-time policies do not run as a kvpress press (use "
                             "kvscope.hf.apply_policy)")
        if self.budget is None and self.compression_ratio is not None:
            if not 0 <= self.compression_ratio < 1:
                raise ValueError(f"compression_ratio {self.compression_ratio} is not in [0, 1)")
            self.budget = 1.0 - float(self.compression_ratio)
        self._q: Dict[int, np.ndarray] = {}
        self._compressor = None
        self._decoder: Optional[HfDecoder] = None

    @contextlib.contextmanager
    def __call__(self, model):
        hooks = Hooks()
        self._decoder = HfDecoder(model)
        self._q, self._compressor = {}, None
        self.selections = [None] * len(self._decoder.attentions)
        try:
            self._decoder.switch(hooks)
            self._decoder.route(hooks, self._record)
            with super().__call__(model):
                yield
        finally:
            hooks.remove()

    def _record(self, layer, module, base, query, key, value, attention_mask, kwargs):
        if int(query.shape[2]) == int(key.shape[2]):  # the prefill: the scorers' observation queries
            self._q[layer] = query[0].detach().float().cpu().numpy()
        return base(module, query, key, value, attention_mask, **kwargs)

    def _make_compressor(self, T: int):
        from . import select
        g = self._decoder.geometry()
        t = self.tokens
        if t is None:  # kvpress hands over no token ids: every context token text
            t = TokenTable([0] * T, list(range(T)), [-1] * T, [0] * T, [-1] * T, [-1] * T)
        if len(t) != T:
            raise BridgeError(f"KvscopePress: tokens= describes {len(t)} tokens, the context has {T}")
        return select.PrefillCompressor(
            self._spec, self.budget, num_layers=g["num_layers"], num_q_heads=g["num_q_heads"],
            num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"], modality=t.modality, position=t.position,
            segment=t.segment, grid_row=t.grid_row, grid_col=t.grid_col, dtype=self.dtype,
            policy_files=self.policy_files)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        import torch

        layer = self._decoder.layer_of[id(module)]
        T = int(keys.shape[2])
        if keys.shape[0] != 1:
            raise BridgeError(f"KvscopePress runs batch 1, got {keys.shape[0]}")
        if layer == 0 or self._compressor is None:
            self._compressor = self._make_compressor(T)
        q = self._q.pop(layer, None)
        if q is None:
            raise BridgeError(f"KvscopePress: no queries recorded for layer {layer}")
        sel = self._compressor.compress_layer(layer, q, keys[0].float().cpu().numpy(),
                                              values[0].float().cpu().numpy())
        self.selections[layer] = sel
        hkv, d = int(keys.shape[1]), int(keys.shape[3])
        n = max(len(k) for k in sel.kept)
        k = keys.new_zeros(1, hkv, n, d)
        v = values.new_zeros(1, hkv, n, d)
        pad_h, pad_s = [], []
        for h in range(hkv):
            K = len(sel.kept[h])
            order = np.argsort(sel.kept[h], kind="stable")
            k[0, h, :K] = torch.from_numpy(np.asarray(sel.keys[h])[order]).to(keys)
            v[0, h, :K] = torch.from_numpy(np.asarray(sel.values[h])[order]).to(values)
            pad_h += [h] * (n - K)
            pad_s += list(range(K, n))
        if pad_h:
            module.masked_key_indices = (torch.zeros(len(pad_h), dtype=torch.long), torch.tensor(pad_h),
                                         torch.tensor(pad_s))
        else:
            module.masked_key_indices = None
        return k, v

    # ---- results ---------------------------------------------------------------------------------------------
    def kept_tokens(self, layer: int) -> List[List[int]]:
        """Per kv head the context tokens the last prefill kept in `layer` (ascending)."""
        sel = self.selections[layer]
        return [sorted(int(x) for x in k) for k in sel.kept]

    @property
    def bytes_kept(self) -> int:
        """kvsim's bytes of the compressed context (sum over layers and kv heads)."""
        return int(sum(s.bytes_kept for s in self.selections))
