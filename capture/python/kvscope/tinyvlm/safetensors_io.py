"""Reader/writer of the safetensors format (no dependency on the `safetensors` package).

Layout: 8-byte little-endian u64 N; N bytes of JSON header {name: {"dtype", "shape", "data_offsets": [b, e]},
optional "__metadata__": {str: str}}; then the raw little-endian data, offsets relative to its start.
Supported dtypes: F32, F16, BF16, I32, I64, U8. BF16 tensors are returned as torch.bfloat16.
"""

import json
import os
import struct
from typing import Dict, Optional, Tuple

import numpy as np
import torch

_NP_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I32": np.dtype("<i4"),
              "I64": np.dtype("<i8"), "U8": np.dtype("u1"), "BF16": np.dtype("<u2")}
_TORCH_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
                torch.int64: "I64", torch.uint8: "U8"}


class SafetensorsError(ValueError):
    pass


def _to_bytes(name: str, t) -> Tuple[str, list, bytes]:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    if not isinstance(t, torch.Tensor):
        raise SafetensorsError(f"tensor '{name}': expected torch.Tensor or numpy array, got {type(t)}")
    if t.dtype not in _TORCH_TO_ST:
        raise SafetensorsError(f"tensor '{name}': unsupported dtype {t.dtype}")
    dtype = _TORCH_TO_ST[t.dtype]
    t = t.detach().cpu().contiguous()
    if dtype == "BF16":
        arr = t.view(torch.int16).numpy().view(np.uint16).astype("<u2")
    else:
        arr = t.numpy().astype(_NP_DTYPES[dtype], copy=False)
    return dtype, list(t.shape), arr.tobytes()


def save_file(tensors: Dict[str, object], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write `tensors` (name -> tensor/array) to `path` atomically (temp file + rename)."""
    header: Dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise SafetensorsError(f"metadata entry '{k}': keys and values must be strings")
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is not a valid tensor name")
        dtype, shape, data = _to_bytes(name, tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)  # align the data section to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def load_file(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read `path`; returns (name -> tensor, metadata)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise SafetensorsError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise SafetensorsError(f"{path}: header length {n} exceeds the file size {len(blob)}")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: bad JSON header: {e}") from e
    data = memoryview(blob)[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        dtype = info.get("dtype")
        if dtype not in _NP_DTYPES:
            raise SafetensorsError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        shape = [int(s) for s in info["shape"]]
        b, e = info["data_offsets"]
        count = int(np.prod(shape)) if shape else 1
        if e - b != count * _NP_DTYPES[dtype].itemsize or e > len(data) or b < 0:
            raise SafetensorsError(f"{path}: tensor '{name}' data_offsets [{b}, {e}] do not match "
                                   f"dtype {dtype} shape {shape}")
        arr = np.frombuffer(data[b:e], dtype=_NP_DTYPES[dtype]).reshape(shape)
        if dtype == "BF16":
            t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
        tensors[name] = t
    return tensors, metadata
