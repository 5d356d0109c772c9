#!/usr/bin/env python3
"""Writes a small kvscope trace with h5py for the edge-case tests of kvsim (docs/robustness.md,
"Edge traces and numerical range in kvsim"), following docs/trace-format.md.

usage: write_edge_trace.py OUT.h5 MODALITIES DECODE [--dtype float16|bfloat16|float32]
                           [--scale X] [--big-heads N]
  MODALITIES  token modality codes, e.g. 0000 (four text tokens), 1111, 3011; '-' for T = 0
  DECODE      decode steps S (0 allowed)
  --scale X   every q/k/v element is a standard normal times X (rounded to the dtype); X may be
              up to the dtype's largest finite value, which bfloat16 then stores exactly
  --big-heads N  only the first N kv heads (and their query heads) get the scale; the others
              stay standard normal
"""
import argparse

import h5py
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("modalities")
ap.add_argument("decode", type=int)
ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
ap.add_argument("--scale", type=float, default=1.0)
ap.add_argument("--big-heads", type=int, default=-1)
a = ap.parse_args()

L, Hq, Hkv, D = 2, 4, 2, 16
modality = np.array([] if a.modalities == "-" else [int(c) for c in a.modalities], dtype=np.uint8)
T, S = len(modality), a.decode
vision = np.where(modality == 1)[0]
grid = -np.ones((T, 2), np.int32)
grid[vision] = np.stack([np.zeros(len(vision), np.int64), np.arange(len(vision))], axis=1) if len(vision) else grid[vision]
segment = np.zeros(T, np.int32)
rng = np.random.default_rng(7)


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def tensor(heads, n, kv):
    x = rng.standard_normal((heads, n, D))
    big = heads if a.big_heads < 0 else a.big_heads * (1 if kv else Hq // Hkv)
    x[:big] *= a.scale
    if a.dtype == "float32":
        return np.clip(x, -3.4028234e38, 3.4028234e38).astype(np.float32)
    if a.dtype == "float16":
        return np.clip(x, -65504, 65504).astype(np.float16)
    # bfloat16: clip to the largest finite bfloat16, 0x7f7f = 3.3895e38
    lim = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])
    return bf16_bits(np.clip(x, -lim, lim).astype(np.float32))


with h5py.File(a.out, "w") as f:
    f.attrs.update(format="kvscope-trace", version="1.0", synthetic=np.uint8(1),
                   num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, dtype=a.dtype,
                   rope_theta=10000.0, model_name="edge", creator="write_edge_trace.py", complete=np.uint8(1))
    f["tokens/modality"] = modality
    f["tokens/position"] = np.arange(T, dtype=np.int32)
    f["tokens/token_id"] = np.where(modality == 1, -1, 500).astype(np.int32)
    f["tokens/segment"] = segment
    f["tokens/grid"] = grid
    f["decode/tokens/token_id"] = np.arange(11, 11 + S, dtype=np.int32)
    f["decode/tokens/position"] = np.arange(T, T + S, dtype=np.int32)
    for l in range(L):
        for group, n in ((f"layers/{l:03d}", T), (f"decode/layers/{l:03d}", S)):
            for name, heads in (("q", Hq), ("k", Hkv), ("v", Hkv)):
                f.create_dataset(f"{group}/{name}", data=tensor(heads, n, name != "q"))
                if a.dtype == "bfloat16":
                    f[f"{group}/{name}"].attrs["dtype"] = "bfloat16"
