#!/usr/bin/env python3
"""Interop with h5py, following docs/trace-format.md only.

1. A trace written by `kvcap synth` opens in h5py with exactly the documented
   names, shapes and dtypes.
2. A trace written here with h5py from the spec alone (float16, bfloat16 and
   float32, with GQA) passes `kvcap validate` and `kvsim info`.
"""
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

kvcap, kvsim, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL", msg)


# --- 1. kvcap synth -> h5py --------------------------------------------------
synth = out / "synth.h5"
subprocess.run([kvcap, "synth", "--preset", "tiny", "--decode", "3", "-q", "-o", str(synth)], check=True)
with h5py.File(synth, "r") as f:
    a = f.attrs
    check(a["format"] == "kvscope-trace", "format attribute")
    check(a["version"] == "1.0", "version attribute")
    check(int(a["synthetic"]) == 1 and int(a["complete"]) == 1, "synthetic/complete flags")
    for name in ("creator", "created", "model_name", "device", "dtype"):
        check(isinstance(a[name], str), f"root attribute {name} is a string")
    L, Hq, Hkv, D = (int(a[k]) for k in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"))
    check((L, Hq, Hkv, D) == (4, 4, 2, 32), "tiny geometry")
    check(float(a["rope_theta"]) == 10000.0, "rope_theta")
    T = f["tokens/modality"].shape[0]
    check(f["tokens/modality"].dtype == np.uint8, "modality dtype uint8")
    for name in ("position", "token_id", "segment"):
        check(f["tokens/" + name].dtype == np.int32 and f["tokens/" + name].shape == (T,), f"tokens/{name}")
    check(f["tokens/grid"].shape == (T, 2) and f["tokens/grid"].dtype == np.int32, "tokens/grid [T,2] int32")
    m = f["tokens/modality"][:]
    g = f["tokens/grid"][:]
    check(((g[:, 0] >= 0) == (m == 1)).all(), "grid set exactly for vision tokens")
    S = f["decode/tokens/token_id"].shape[0]
    check(S == 3, "decode steps")
    for l in range(L):
        grp = f[f"layers/{l:03d}"]
        check(grp["q"].shape == (Hq, T, D) and grp["q"].dtype == np.float16, f"layer {l} q")
        check(grp["k"].shape == (Hkv, T, D) and grp["v"].shape == (Hkv, T, D), f"layer {l} k/v")
        check(grp["k"].chunks is not None and grp["k"].chunks[0] == 1, f"layer {l} k chunk covers one head")
        dg = f[f"decode/layers/{l:03d}"]
        check(dg["q"].shape == (Hq, S, D) and dg["k"].shape == (Hkv, S, D), f"decode layer {l}")
        check(np.isfinite(grp["k"][:]).all(), f"layer {l} finite")
    check(f["profile/ranges"].dtype.names[:3] == ("name", "start_ns", "end_ns"), "profile/ranges fields")
    check("grid" in f["profile/kernels"].dtype.names, "profile/kernels fields")

# --- 2. h5py (spec only) -> kvcap validate / kvsim info ----------------------
def write_trace(path, dtype):
    rng = np.random.default_rng(0)
    L, Hq, Hkv, D = 3, 8, 2, 16
    modality = np.array([3] + [0] * 5 + [1] * 12 + [3] + [0] * 6, dtype=np.uint8)
    T, S = len(modality), 4
    grid = -np.ones((T, 2), dtype=np.int32)
    vis = np.where(modality == 1)[0]
    grid[vis, 0] = np.arange(len(vis)) // 4
    grid[vis, 1] = np.arange(len(vis)) % 4
    segment = np.zeros(T, dtype=np.int32)
    segment[vis] = 1
    segment[vis[-1] + 1:] = 2

    def tensor(h, n):
        x = rng.standard_normal((h, n, D)).astype(np.float32)
        if dtype == "bfloat16":
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(dtype)

    with h5py.File(path, "w") as f:
        f.attrs["format"] = "kvscope-trace"
        f.attrs["version"] = "1.0"
        f.attrs["synthetic"] = np.uint8(0)
        f.attrs["creator"] = "interop_h5py.py"
        f.attrs["created"] = "2026-11-29T00:00:00Z"
        f.attrs["model_name"] = "handwritten"
        f.attrs["device"] = "cpu"
        f.attrs["num_layers"] = L
        f.attrs["num_q_heads"] = Hq
        f.attrs["num_kv_heads"] = Hkv
        f.attrs["head_dim"] = D
        f.attrs["rope_theta"] = 10000.0
        f["tokens/modality"] = modality
        f["tokens/position"] = np.arange(T, dtype=np.int32)
        f["tokens/token_id"] = np.where(modality == 1, -1, 100).astype(np.int32)
        f["tokens/segment"] = segment
        f["tokens/grid"] = grid
        f["decode/tokens/token_id"] = np.arange(S, dtype=np.int32)
        f["decode/tokens/position"] = np.arange(T, T + S, dtype=np.int32)
        for l in range(L):
            for prefix, n in ((f"layers/{l:03d}", T), (f"decode/layers/{l:03d}", S)):
                for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv)):
                    ds = f.create_dataset(f"{prefix}/{name}", data=tensor(h, n), chunks=(1, n, D))
                    if dtype == "bfloat16":
                        ds.attrs["dtype"] = "bfloat16"


for dtype in ("float16", "bfloat16", "float32"):
    path = out / f"handwritten_{dtype}.h5"
    write_trace(path, dtype)
    r = subprocess.run([kvcap, "validate", "-q", str(path)], capture_output=True, text=True)
    check(r.returncode == 0, f"kvcap validate {dtype}: {r.stderr.strip()}")
    r = subprocess.run([kvsim, "info", str(path)], capture_output=True, text=True)
    check(r.returncode == 0, f"kvsim info {dtype}: {r.stderr.strip()}")
    check(re.search(r"^\s*vision\s+12\s", r.stdout, re.M) is not None, f"kvsim info counts 12 vision tokens ({dtype})")
    check(dtype in r.stdout, f"kvsim info reports dtype {dtype}")

# bool attribute written the h5py way (numpy bool -> HDF5 enum) is accepted too.
path = out / "handwritten_boolattr.h5"
write_trace(path, "float16")
with h5py.File(path, "a") as f:
    f.attrs["synthetic"] = True
r = subprocess.run([kvsim, "info", str(path)], capture_output=True, text=True)
check(r.returncode == 0 and "SYNTHETIC" in r.stdout, f"bool attribute: {r.stderr.strip()}")

print("interop: %d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
