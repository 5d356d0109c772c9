"""One layer of a live KV cache through a kvscope policy, for closed loops (kvscope.hf builds on it).

The compressors are the C++ closed loop's (sim/closed_loop.hpp: PrefillCompressor, DecodeCompressor), i.e.
exactly the policy code `kvsim` replays and `kvcap eval` runs: per layer select_on_layer (head merge ->
scorer -> allocator -> selection) then execute_selection (keep / merge -> quantize -> bytes).

    from kvscope.select import PrefillCompressor
    c = PrefillCompressor("snapkv", 0.3, num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                          modality=["text"] * T)
    for layer in range(L):                       # in order: layer 0 fixes what adaptive policies read
        sel = c.compress_layer(layer, q, k, v)   # q [Hq, T, D] post-RoPE, k / v [Hkv, T, D], float32
        sel.kept[h]                              # context token indices kept in kv head h, ascending
        sel.keys[h], sel.values[h]               # [K, D] the slots as evaluated (merged / dequantized)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np

from kvscope._native import core
from kvscope.sim import BudgetLike, PolicyLike, _budget_text, _policy

PolicyError = core.PolicyError
_MODALITY_CODES = {core.modality_name(m): m for m in range(4)}

Labels = Union[np.ndarray, Sequence[int], Sequence[str]]


def _modality_codes(modality: Labels) -> np.ndarray:
    a = np.asarray(modality)
    if a.ndim != 1:
        raise ValueError(f"modality must be one label per context token, got shape {a.shape}")
    if a.dtype.kind in "US" or a.dtype == object:
        try:
            return np.array([_MODALITY_CODES[str(m)] for m in a], dtype=np.uint8)
        except KeyError as e:
            raise ValueError(f"unknown modality {e.args[0]!r} (text, vision, audio, special)") from None
    if a.size and (a.min() < 0 or a.max() > 3):
        raise ValueError("modality codes must be 0 text, 1 vision, 2 audio, 3 special")
    return np.ascontiguousarray(a, dtype=np.uint8)


def _labels(modality, position, segment, grid_row, grid_col):
    m = _modality_codes(modality)
    T = m.shape[0]

    def col(x, default):
        a = np.full(T, default, dtype=np.int32) if x is None else np.ascontiguousarray(x, dtype=np.int32)
        if a.shape != (T,):
            raise ValueError(f"labels must have one entry per context token ({T}), got shape {a.shape}")
        return a

    pos = np.arange(T, dtype=np.int32) if position is None else col(position, 0)
    return m, pos, col(segment, 0), col(grid_row, -1), col(grid_col, -1)


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


@dataclass
class HeadStats:
    """kvsim's measurement of one kv head's compressed cache."""

    kv_head: int
    bytes_full: int
    bytes_kept: int
    bytes_kept_modality: List[int]
    bytes_end: int
    bytes_peak: int
    kept: int
    merged: int
    evicted: int


@dataclass
class LayerSelection:
    """One layer's compressed cache. Per kv head h (lists of length num_kv_heads): kept[h] the context token
    index each slot started as (ascending, int32 [K]); keys[h], values[h] the slots as the policy evaluates
    them (merged / dequantized, float32 [K, D]); multiplicity[h] the tokens folded into each slot (int32 [K],
    1 unless a merging executor ran). Kv heads merged by a head-merge stage share one working head
    (cluster[h]) and so the same arrays. bytes_kept: kvsim's bytes of the layer's compressed cache."""

    layer: int
    kept: List[np.ndarray]
    keys: List[np.ndarray]
    values: List[np.ndarray]
    multiplicity: List[np.ndarray]
    cluster: np.ndarray
    heads: List[HeadStats]

    @property
    def bytes_kept(self) -> int:
        return int(sum(h.bytes_kept for h in self.heads))

    @property
    def bytes_full(self) -> int:
        return int(sum(h.bytes_full for h in self.heads))


class _Compressor:
    """What both compressors share: the policy, the labels of the T context tokens and the native object."""

    _native = None  # the kvscope._core class

    def __init__(
        self,
        policy: PolicyLike,
        budget: BudgetLike = None,
        *,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        modality: Labels,
        position: Optional[Sequence[int]] = None,
        segment: Optional[Sequence[int]] = None,
        grid_row: Optional[Sequence[int]] = None,
        grid_col: Optional[Sequence[int]] = None,
        dtype: str = "float32",
        policy_files: Sequence[str] = (),
    ):
        spec = _policy(policy, policy_files)
        labels = _labels(modality, position, segment, grid_row, grid_col)
        self.num_kv_heads = num_kv_heads
        self.T = int(labels[0].shape[0])
        self._c = self._native(
            spec, _budget_text(budget), num_layers, num_q_heads, num_kv_heads, head_dim, dtype, *labels
        )

    @property
    def warnings(self) -> list:
        """The replay's warnings (e.g. a budget raised to the forced set)."""
        return self._c.warnings

    @property
    def policy(self) -> str:
        """The policy's canonical name."""
        return self._c.policy


class PrefillCompressor(_Compressor):
    """Compresses a run's prefill cache layer by layer with a prefill-mode policy, as the C++ closed loop
    (``kvcap eval``) does.

    policy: a name (``"h2o"``, ``"snapkv+int8"``, a custom scorer) or ``kvscope.sim.policy(...)``; budget: a
    fraction of tokens (0.3), "512tok" or bytes ("64MiB"); None for budget-free policies. Geometry: the
    model's num_layers, num_q_heads, num_kv_heads, head_dim. Labels of the T context tokens: modality (codes
    0-3 or names "text"/"vision"/"audio"/"special"), position (default 0..T-1), segment (default 0), grid_row
    / grid_col (patch grid of vision tokens, default -1). dtype: the element type bytes are accounted in
    ("float32", or "float16" to match a float16 trace's kvsim bytes). Raises PolicyError for unknown
    policies, decode-time policies (use DecodeCompressor) and the oracle-topk bound."""

    _native = core.PrefillCompressor


    def compress_layer(self, layer: int, q, k, v) -> LayerSelection:
        """Compresses layer `layer` (layers in order 0, 1, ...): q [Hq, T, D] the layer's post-RoPE prefill
        queries (the scorers' observation queries), k [Hkv, T, D] post-RoPE keys and v [Hkv, T, D] values as
        cached (converted to float32). Raises ValueError for wrong shapes or a layer out of order."""
        r = self._c.compress_layer(layer, _f32(q), _f32(k), _f32(v))
        cluster = r["cluster"]
        heads = r["heads"]
        per_kv = [heads[int(w)] for w in cluster]
        return LayerSelection(
            layer=layer,
            kept=[h["tokens"] for h in per_kv],
            keys=[h["keys"] for h in per_kv],
            values=[h["values"] for h in per_kv],
            multiplicity=[h["multiplicity"] for h in per_kv],
            cluster=cluster,
            heads=[HeadStats(**h) for h in r["results"]],
        )

    @property
    def keep(self) -> float:
        """The mean keep fraction of the budget (known after layer 0 for adaptive policies)."""
        return self._c.keep



@dataclass
class ResidentLayer:
    """A decode-time policy's resident cache of one layer: per kv head, tokens[h] the resident token ids
    (ascending; context t < T, decode step j as T + j), keys[h] / values[h] [K, D] float32 (dequantized as a
    whole when the policy quantizes); heads: bytes_end / bytes_peak per kv head as kvsim's replay counts."""

    layer: int
    tokens: List[np.ndarray]
    keys: List[np.ndarray]
    values: List[np.ndarray]
    heads: List[HeadStats]


class DecodeCompressor(_Compressor):
    """A decode-time policy (``"h2o~decode:4"`` with a cap budget) on a live run, as the C++ closed loop runs
    it: `set_prefill` each layer's prefill tensors, `add_step` each decode step's q/k/v, `resident(layer)` the
    cache kvsim's decode-time replay keeps after the steps so far. Arguments as PrefillCompressor."""

    _native = core.DecodeCompressor


    def set_prefill(self, layer: int, q, k, v) -> None:
        """The layer's prefill tensors: q [Hq, T, D], k and v [Hkv, T, D] (post-RoPE q and k)."""
        self._c.set_prefill(layer, _f32(q), _f32(k), _f32(v))

    def add_step(self, layer: int, q, k, v) -> None:
        """Appends one decode step of a layer: q [Hq, D], k and v [Hkv, D] (or with a length-1 token axis)."""
        q, k, v = (_f32(x) for x in (q, k, v))
        q, k, v = (x.reshape(x.shape[0], 1, x.shape[-1]) for x in (q, k, v))
        self._c.add_step(layer, q, k, v)

    def steps(self, layer: int) -> int:
        """Decode steps added to `layer` so far."""
        return self._c.steps(layer)

    def resident(self, layer: int) -> ResidentLayer:
        """The resident cache of `layer` after the steps added so far (none: the starting cache)."""
        r = self._c.resident(layer)
        return ResidentLayer(
            layer=layer,
            tokens=[h["tokens"] for h in r["heads"]],
            keys=[h["keys"] for h in r["heads"]],
            values=[h["values"] for h in r["heads"]],
            heads=[HeadStats(**h) for h in r["results"]],
        )

    @property
    def prefill_keep(self) -> float:
        return self._c.prefill_keep

    @property
    def cap_keep(self) -> float:
        return self._c.cap_keep



__all__ = [
    "PrefillCompressor",
    "DecodeCompressor",
    "LayerSelection",
    "ResidentLayer",
    "HeadStats",
    "PolicyError",
]
