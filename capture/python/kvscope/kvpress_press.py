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
to the compressor (layers in order) and returns the layer's compressed keys and values. The context's labels
are kvscope.hf.apply_policy's: `tokens=`, else hf.text_tokens of the ids the decoder is called with (bos /
eos / pad special: the multimodal policies keep special tokens), so the kept sets are apply_policy's. kvpress
caches hold one length per layer, and transformers builds one attention mask for every layer from the first
layer's length, so every layer is padded to the largest number of slots any kv head of any layer keeps
(earlier layers widened in the cache when the last one is compressed), and the padding slots are masked in
later forwards the way kvpress's AdaKVPress masks head-wise evictions (`module.masked_key_indices`,
kvpress's attention patch; sdpa attention). Merged slots (UniCache's merging
executor) keep their merged keys and values but not the log n logit bias kvscope adds under proportional
attention (kvpress's cache has no per-slot bias): with merging policies the attention after compression
differs from kvsim's / kvscope.hf's by that bias; eviction and quantization are exact. Prefill-mode
policies only (kvpress applies presses during the prefill).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .bridge import BridgeError, Hooks, TokenTable, forward_ids
from .hf import HfDecoder, text_tokens

try:
    from kvpress.presses.base_press import BasePress
except ImportError as e:  # pragma: no cover - reported when used
    raise ImportError(f"kvscope.kvpress_press needs kvpress (in kvscope's Python environment: scripts/setup): {e}")


@dataclass
class KvscopePress(BasePress):
    """policy: a kvscope policy name or kvscope.sim.policy(...); budget as kvsim takes it (fraction of tokens
    kept, "128tok", bytes), or compression_ratio (kvpress's: the fraction removed, budget = 1 - ratio).
    tokens: labels of the context tokens (kvscope.hf.tokens_for; default: hf.text_tokens of the prefill's
    input ids, as kvscope.hf.apply_policy; vision-language models need tokens=). dtype: element type the
    bytes are accounted in."""

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
        self._q, self._compressor, self._ids, self._slots = {}, None, None, {}
        self.selections = [None] * len(self._decoder.attentions)

        def pre(module, args, kwargs):  # the decoder's input ids: the context tokens' labels
            ids = forward_ids(args, kwargs)
            self._ids = None if ids is None else ids.reshape(-1).tolist()

        try:
            hooks.add(self._decoder.decoder.register_forward_pre_hook(pre, with_kwargs=True))
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
        if t is None:  # the labels kvscope.hf.apply_policy gives the same ids: bos / eos / pad special
            if self._ids is None or len(self._ids) != T:
                raise BridgeError("KvscopePress: the prefill was given no input_ids (inputs_embeds): pass tokens= "
                                  "(kvscope.hf.tokens_for)")
            if getattr(self._decoder.model.config, "model_type", "") in ("llava", "qwen2_vl", "qwen2_5_vl"):
                raise BridgeError("KvscopePress: a vision-language model needs tokens= (kvscope.hf.tokens_for) "
                                  "for its image labels")
            t = text_tokens(self._decoder.model.config, self._ids)
        if len(t) != T:
            raise BridgeError(f"KvscopePress: tokens= describes {len(t)} tokens, the context has {T}")
        return select.PrefillCompressor(
            self._spec, self.budget, num_layers=g["num_layers"], num_q_heads=g["num_q_heads"],
            num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"], modality=t.modality, position=t.position,
            segment=t.segment, grid_row=t.grid_row, grid_col=t.grid_col, dtype=self.dtype,
            policy_files=self.policy_files)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
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
        # Per kv head its slots in context order; one length per layer, and (transformers builds one mask
        # for all layers) one length for every layer: padded to the largest, the padding masked.
        self._slots[layer] = [np.argsort(sel.kept[h], kind="stable") for h in range(len(sel.kept))]
        n = max(len(k) for k in sel.kept)
        if layer == len(self._decoder.attentions) - 1:
            n = max(max(len(k) for k in s.kept) for s in self.selections if s is not None)
            cache = kwargs.get("past_key_values")
            for l in range(layer):  # the earlier layers (already in the cache) to the common length
                if self.selections[l] is None or cache is None:
                    continue
                cl = cache.layers[l]
                cl.keys, cl.values = self._padded(l, self._decoder.attentions[l], cl.keys, cl.values, n)
        return self._padded(layer, module, keys, values, n)

    def _padded(self, layer, module, keys, values, n):
        """The layer's kept slots (`keys`, `values`: the full context, or an earlier result to widen) as
        [1, Hkv, n, D], each head's padding masked (module.masked_key_indices, kvpress's attention patch)."""
        import torch

        sel = self.selections[layer]
        hkv, d = int(keys.shape[1]), int(keys.shape[3])
        k = keys.new_zeros(1, hkv, n, d)
        v = values.new_zeros(1, hkv, n, d)
        pad_h, pad_s = [], []
        for h in range(hkv):
            K = len(sel.kept[h])
            order = self._slots[layer][h]
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
