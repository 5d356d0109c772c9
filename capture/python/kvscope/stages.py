"""The stage registry from Python, and custom stages written in Python (docs/python.md).

A scorer is a function of one layer (`Layer`: numpy arrays of its prefill q/k/v and token labels) returning a
score per kv head and context token, [num_kv_heads, T], higher = keep. Registered under a name, it is a stage of
the C++ registry like the built-ins: policy names, INI files (``scorer = NAME``), `kvscope.sim` and
`kvscope.select` use it, and selection, merging, quantization and the metrics stay C++. It is called once per
layer of a replay (its scores are shared by every point of a sweep), with the GIL held.

    import numpy as np, kvscope.stages, kvscope.sim

    @kvscope.stages.scorer("key-norm-py")
    def key_norm(layer):
        return -np.linalg.norm(layer.k, axis=-1)        # [Hkv, T]: keep the lowest-norm keys

    kvscope.sim.sweep("traces/tiny-shapes-fine.h5", ["key-norm-py", "knorm"], [0.3]).df
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np

from kvscope._native import core

PolicyError = core.PolicyError
KINDS = tuple(core.stage_kinds())  # INI keys: head_merge, scorer, allocator, executor, quant


@dataclass(frozen=True)
class Layer:
    """What a custom stage sees of one layer. q [Hq, T, D] (post-RoPE prefill queries), k and v [Hkv, T, D]:
    float32 copies of the layer (None for allocators); modality [T] (0 text, 1 vision, 2 audio, 3 special),
    position [T], role [T] (trace roles, None without them), tokens_per_modality [4]."""

    layer: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    T: int
    modality: np.ndarray
    position: np.ndarray
    role: Optional[np.ndarray]
    tokens_per_modality: tuple
    q: Optional[np.ndarray]
    k: Optional[np.ndarray]
    v: Optional[np.ndarray]

    @property
    def group_size(self) -> int:
        """Query heads per kv head: query head j belongs to kv head j // group_size."""
        return self.num_q_heads // self.num_kv_heads


def _layer(d: dict) -> Layer:
    d = dict(d)
    d["tokens_per_modality"] = tuple(d["tokens_per_modality"])
    return Layer(**d)


def register_scorer(name: str, fn: Callable[[Layer], np.ndarray], *, meaning: str = "", preset: bool = True) -> None:
    """Registers `fn(layer) -> scores [num_kv_heads, T]` as the scorer `name` (letters, digits, "_.-"; not a
    built-in's name; registering the same name again replaces it). With `preset`, `name` is also a policy
    (this scorer, uniform allocator, evict executor), e.g. ``kvscope.sim.run(trace, name, 0.3)``; for other
    pipelines use ``kvscope.sim.policy("h2o", scorer=name)`` or an INI ``scorer = name``. Exceptions raised by
    `fn` fail the replay with their message. Register before a replay, not while one runs."""
    if not callable(fn):
        raise TypeError("fn must be callable")

    def call(d: dict) -> np.ndarray:
        layer = _layer(d)
        scores = np.asarray(fn(layer))
        if scores.shape != (layer.num_kv_heads, layer.T):
            raise ValueError(
                f"returned shape {scores.shape}, expected (num_kv_heads, T) = ({layer.num_kv_heads}, {layer.T})"
            )
        return np.ascontiguousarray(scores, dtype=np.float32).reshape(-1)

    core.register_scorer(name, call, meaning, preset)


def register_allocator(
    name: str,
    fn: Callable[[Layer, float], Union[float, Sequence[float], Mapping[str, float]]],
    *,
    meaning: str = "",
) -> None:
    """Registers `fn(layer, keep) -> allocation` as the allocator `name`, used by policies with
    ``allocator = name`` (``kvscope.sim.policy("h2o", allocator=name)``). `keep` is the point's mean keep
    fraction; the allocation is this layer's keep fraction (a float in [0, 1]), or per-modality keep fractions:
    4 numbers (text, vision, audio, special) or a mapping {"vision": 0.2, ...} (missing modalities keep
    `keep`). The layer carries labels only (q/k/v None)."""
    if not callable(fn):
        raise TypeError("fn must be callable")
    names = tuple(core.modality_name(m) for m in range(4))

    def call(d: dict, keep: float):
        a = fn(_layer(d), keep)
        if isinstance(a, Mapping):
            unknown = set(a) - set(names)
            if unknown:
                raise ValueError(f"unknown modalities {sorted(unknown)} (use {', '.join(names)})")
            return True, keep, [float(a.get(m, keep)) for m in names]
        if np.ndim(a) == 0:
            return False, float(a), [0.0] * 4
        fr = [float(x) for x in a]
        if len(fr) != 4:
            raise ValueError(f"per-modality fractions need 4 numbers (text, vision, audio, special), got {len(fr)}")
        return True, keep, fr

    core.register_allocator(name, call, meaning)


def scorer(name: str, *, meaning: str = "", preset: bool = True):
    """Decorator form of `register_scorer`: ``@kvscope.stages.scorer("my-scorer")``."""

    def wrap(fn):
        register_scorer(name, fn, meaning=meaning or (fn.__doc__ or "").strip().split("\n")[0], preset=preset)
        return fn

    return wrap


def allocator(name: str, *, meaning: str = ""):
    """Decorator form of `register_allocator`."""

    def wrap(fn):
        register_allocator(name, fn, meaning=meaning or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return wrap


def stages(kind: Optional[str] = None) -> list:
    """Every registered stage (built-in and custom) as dicts: kind, name, meaning, source, decode (works in
    decode-time mode), custom, params (name, type, default, lo, hi, choices, meaning, source). `kind`: one of
    KINDS to filter."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown stage kind {kind!r} (one of {', '.join(KINDS)})")
    return [s for s in core.stage_infos() if kind is None or s["kind"] == kind]


def names(kind: str) -> list:
    """Registered names of one kind of stage, in registry order."""
    return [s["name"] for s in stages(kind)]


def pipeline_parameters() -> list:
    """The pipeline's own parameters (base, sinks, recent, mode, stage selectors, ...) as dicts."""
    return core.pipeline_parameters()


def listing() -> str:
    """`kvsim stages`' text: every stage with its parameters."""
    return core.stage_listing_text()


__all__ = [
    "Layer",
    "register_scorer",
    "register_allocator",
    "scorer",
    "allocator",
    "stages",
    "names",
    "pipeline_parameters",
    "listing",
    "KINDS",
]
