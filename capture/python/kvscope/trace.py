"""Reading kvscope traces (docs/trace-format.md): header, geometry, tokens and one layer at a time.

    >>> import kvscope.trace
    >>> t = kvscope.trace.open("traces/tiny-shapes-fine.h5")
    >>> t.geometry.num_layers, t.num_tokens
    >>> t.tokens()          # pandas DataFrame, one row per context token
    >>> q, k, v = t.layer(0)  # numpy arrays [heads, T, head_dim]; only layer 0 is read
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import numpy as np

from kvscope._native import core

TraceError = core.TraceError
MODALITIES = tuple(core.modality_name(m) for m in range(4))  # ("text", "vision", "audio", "special")
ROLES = tuple(core.role_name(r) for r in range(4))  # ("context", "question", "answer", "template")


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of the traced model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    model_name: str

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA group)."""
        return self.num_q_heads // self.num_kv_heads


class LayerTensors(NamedTuple):
    """One layer's tensors: q [Hq, N, D], k and v [Hkv, N, D] (N = T context tokens or S decode steps)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def _categorical(codes: np.ndarray, names: tuple):
    import pandas as pd

    return pd.Categorical.from_codes(codes.astype(np.int64), categories=list(names))


class Trace:
    """An open trace file. Opening checks the whole structure without reading tensors; `layer()` and
    `decode_layer()` read one layer each (a trace's memory is bounded by one layer)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self._path = os.fspath(path)
        self._reader = core.TraceReader(self._path)

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def geometry(self) -> Geometry:
        """Layers, heads, head dimension, RoPE theta and model name."""
        return Geometry(**self._reader.geometry)

    @property
    def header(self) -> dict:
        """Root attributes: dtype, synthetic, creator, created, device, version, complete."""
        return self._reader.header

    @property
    def dtype(self) -> str:
        """Element type of the q/k/v tensors: "float32", "float16" or "bfloat16"."""
        return self._reader.header["dtype"]

    @property
    def num_tokens(self) -> int:
        """T, the context (prefill) tokens."""
        return self._reader.num_tokens

    @property
    def num_decode_steps(self) -> int:
        """S, the decode steps (the evaluation queries of a replay)."""
        return self._reader.num_decode_steps

    @property
    def has_roles(self) -> bool:
        """Whether the trace records token roles (format 1.1)."""
        return self._reader.has_roles

    def tokens(self):
        """The context tokens as a pandas DataFrame, one row per token: token_id, position, modality
        (categorical: text, vision, audio, special), modality_code, segment, grid_row, grid_col, role
        (categorical: context, question, answer, template; all "context" without roles), role_code and text
        (when the trace stores it)."""
        import pandas as pd

        d = self._reader.tokens()
        frame = pd.DataFrame(
            {
                "token_id": d["token_id"],
                "position": d["position"],
                "modality": _categorical(d["modality"], MODALITIES),
                "modality_code": d["modality"],
                "segment": d["segment"],
                "grid_row": d["grid_row"],
                "grid_col": d["grid_col"],
                "role": _categorical(d["role"], ROLES),
                "role_code": d["role"],
            }
        )
        if d["text"]:
            frame["text"] = d["text"]
        return frame

    def decode_tokens(self):
        """The decode steps as a pandas DataFrame: token_id, position, role (categorical; "answer" for every
        step without roles), role_code and text (when stored)."""
        import pandas as pd

        d = self._reader.decode_tokens()
        frame = pd.DataFrame(
            {
                "token_id": d["token_id"],
                "position": d["position"],
                "role": _categorical(d["role"], ROLES),
                "role_code": d["role"],
            }
        )
        if d["text"]:
            frame["text"] = d["text"]
        return frame

    def layer(self, layer: int, dtype: Optional[str] = None) -> LayerTensors:
        """Prefill q [Hq, T, D], k and v [Hkv, T, D] of one layer (post-RoPE q and k, as cached), reading
        only that layer. `dtype` None: as stored (float32 / float16; bfloat16 traces as float32), "float32":
        converted."""
        return LayerTensors(*self._reader.read_layer(layer, _to_float32(dtype)))

    def decode_layer(self, layer: int, dtype: Optional[str] = None) -> LayerTensors:
        """Decode-step q [Hq, S, D] and the appended k, v [Hkv, S, D] of one layer (see `layer`)."""
        return LayerTensors(*self._reader.read_decode_layer(layer, _to_float32(dtype)))

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"<kvscope Trace {self._path}: {g.model_name}, {self.num_tokens} tokens, "
            f"{self.num_decode_steps} decode steps, {g.num_layers} layers, {self.dtype}>"
        )


def _to_float32(dtype: Optional[str]) -> bool:
    if dtype is None:
        return False
    if np.dtype(dtype) != np.float32:
        raise ValueError(f"dtype must be None (as stored) or 'float32', not {dtype!r}")
    return True


def open(path: Union[str, os.PathLike]) -> Trace:  # noqa: A001 - kvscope.trace.open, like io.open
    """Opens a trace file (kvscope-trace v1). Raises TraceError (a ValueError) naming the file and the
    problem for a missing, corrupt or incomplete file."""
    return Trace(path)


__all__ = ["open", "Trace", "Geometry", "LayerTensors", "TraceError", "MODALITIES", "ROLES"]
