"""ctypes binding of the kvscope capture C API (capture/api/include/kvscope_capture.h).

One writer: every trace written from Python goes through `libkvscope_capture.so`, exactly as from C/C++.
The library is found at the path in the environment variable KVSCOPE_CAPTURE_LIB when it is set (and only
there); otherwise, in this order, at
  1. `build/lib/libkvscope_capture.so` of the source tree this package lives in (capture/python/kvscope
     -> <repo>/build/lib),
  2. the dynamic linker's search path (`ctypes.util.find_library("kvscope_capture")`),
and `CaptureLibraryNotFound` names every place that was tried.

`Capture` owns one handle: each method raises `CaptureError` (status code + the library's one-line message)
on failure; leaving a `with Capture(...)` block by an exception aborts (the trace stays incomplete).
Tensors are torch tensors or numpy arrays of shape [heads, tokens, head_dim]: host tensors are passed as
host pointers with their element strides (no copy on the Python side when the strides are positive),
CUDA tensors as device pointers (KVSCOPE_DEVICE; the library copies them on a side stream ordered after
`cuda_stream`).
"""

import contextlib
import ctypes
import ctypes.util
import enum
import os
from typing import Any, List, Optional, Sequence

import numpy as np

ABI_VERSION = 1
LIBRARY_ENV = "KVSCOPE_CAPTURE_LIB"
LIBRARY_FILE = "libkvscope_capture.so"


class Status(enum.IntEnum):
    OK = 0
    ERR_ARGUMENT = 1
    ERR_STATE = 2
    ERR_IO = 3
    ERR_CUDA = 4
    ERR_INTERNAL = 5


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2


class Memory(enum.IntEnum):
    HOST = 0
    DEVICE = 1


class Modality(enum.IntEnum):
    TEXT = 0
    VISION = 1
    AUDIO = 2
    SPECIAL = 3


DTYPE_NAMES = {"float32": DType.F32, "fp32": DType.F32, "float16": DType.F16, "fp16": DType.F16,
               "bfloat16": DType.BF16, "bf16": DType.BF16}


class CaptureError(RuntimeError):
    """A C API call failed: `status` is the kvscope_status code, the message is the library's."""

    def __init__(self, status: int, message: str):
        try:
            name = Status(status).name
        except ValueError:
            name = str(status)
        super().__init__(f"{message} [{name}]")
        self.status = status
        self.message = message


class CaptureLibraryNotFound(OSError):
    """libkvscope_capture.so was not found (or could not be loaded) at any of the places tried."""


# ---- C structs (field order and types exactly as in kvscope_capture.h) ------------------------------------
class CTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("memory", ctypes.c_int),
                ("shape", ctypes.c_int64 * 3), ("stride", ctypes.c_int64 * 3)]


class CConfig(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("num_layers", ctypes.c_int32),
                ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("rope_theta", ctypes.c_double),
                ("model_name", ctypes.c_char_p), ("device", ctypes.c_char_p), ("creator", ctypes.c_char_p),
                ("dtype", ctypes.c_int), ("max_decode_steps", ctypes.c_int32),
                ("queue_bytes", ctypes.c_uint64), ("chunk_tokens", ctypes.c_int32),
                ("deflate_level", ctypes.c_int32), ("profile", ctypes.c_int32),
                ("cuda_stream", ctypes.c_void_p)]


class CStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("queue_bytes_bound", ctypes.c_uint64),
                ("queue_bytes_peak", ctypes.c_uint64), ("queue_waits", ctypes.c_uint64),
                ("tensors_written", ctypes.c_uint64), ("layers_written", ctypes.c_uint64),
                ("pinned_bytes_peak", ctypes.c_uint64)]


# ---- loading the library -----------------------------------------------------------------------------------
_lib: Optional[ctypes.CDLL] = None


def library_candidates() -> List[str]:
    """The places `load_library` tries, in order (see the module docstring)."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return [env]  # an explicit choice: never silently replaced by another build
    out = []
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out.append(os.path.join(repo, "build", "lib", LIBRARY_FILE))
    found = ctypes.util.find_library("kvscope_capture")
    if found:
        out.append(found)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, vp, cp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
    tp, i32p = ctypes.POINTER(CTensor), ctypes.POINTER(ctypes.c_int32)
    sig = {
        "kvscope_capture_abi_version": (ctypes.c_int, []),
        "kvscope_capture_last_error": (cp, []),
        "kvscope_capture_open": (ctypes.c_int, [cp, ctypes.POINTER(CConfig), i64, ctypes.POINTER(vp)]),
        "kvscope_capture_set_tokens": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_uint8), i32p, i32p, i32p,
                                                      i32p, i32p, ctypes.POINTER(cp)]),
        "kvscope_capture_prefill_layer": (ctypes.c_int, [vp, i32, tp, tp, tp]),
        "kvscope_capture_layer_aggregates": (ctypes.c_int, [vp, i32, ctypes.POINTER(ctypes.c_float),
                                                            ctypes.POINTER(ctypes.c_float), i32]),
        "kvscope_capture_decode_layer": (ctypes.c_int, [vp, i32, i32, tp, tp, tp]),
        "kvscope_capture_decode_token": (ctypes.c_int, [vp, i32, i32, i32, cp]),
        "kvscope_capture_set_token_roles": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_uint8)]),
        "kvscope_capture_set_decode_roles": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_uint8), i64]),
        "kvscope_capture_range_push": (ctypes.c_int, [vp, cp]),
        "kvscope_capture_range_pop": (ctypes.c_int, [vp]),
        "kvscope_capture_close": (ctypes.c_int, [vp]),
        "kvscope_capture_abort": (None, [vp]),
        "kvscope_capture_get_stats": (ctypes.c_int, [vp, ctypes.POINTER(CStats)]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads (once) and returns the capture library; `path` overrides the search."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    tried = []
    for candidate in [path] if path else library_candidates():
        if os.path.sep in candidate and not os.path.exists(candidate):
            tried.append(f"{candidate} (no such file)")
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            tried.append(f"{candidate} ({e})")
            continue
        _declare(lib)
        version = lib.kvscope_capture_abi_version()
        if version != ABI_VERSION:
            raise CaptureLibraryNotFound(f"{candidate}: capture ABI version {version}, this binding "
                                         f"needs {ABI_VERSION}")
        if path is None:
            _lib = lib
        return lib
    if not os.environ.get(LIBRARY_ENV):
        tried.insert(0, f"${LIBRARY_ENV} (not set)")
    raise CaptureLibraryNotFound(
        f"{LIBRARY_FILE} not found; tried: " + "; ".join(tried) +
        f". Build the target kvscope_capture (cmake --build build --target kvscope_capture) or set "
        f"{LIBRARY_ENV} to the library's path.")


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != Status.OK:
        raise CaptureError(status, lib.kvscope_capture_last_error().decode("utf-8", "replace"))


def dtype_code(dtype: Any) -> DType:
    """'float32' / 'float16' / 'bfloat16' (or fp32/fp16/bf16, a DType, a torch dtype) -> DType."""
    if isinstance(dtype, DType):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
    return DTYPE_NAMES[name]


def _text_bytes(text) -> bytes:
    """A token's text for the C API: bytes as they are (a byte-level token can be part of a UTF-8
    character), str encoded as UTF-8."""
    return bytes(text) if isinstance(text, (bytes, bytearray)) else str(text).encode()


# ---- tensors -----------------------------------------------------------------------------------------------
def _torch_view(x, keep: list) -> CTensor:
    import torch  # only reached with a torch tensor

    codes = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}
    device = x.device.type == "cuda"
    if x.dtype not in codes:
        x = x.float()  # e.g. float64: converted once, kept alive for the call
    # A 0 stride (broadcast) means "dense" to the C API, so such views are made contiguous; so are device
    # views whose rows are not contiguous (the library copies device rows with cudaMemcpy2D).
    if any(s <= 0 and n > 1 for s, n in zip(x.stride(), x.shape)) or (
            device and x.stride(2) != 1 and x.shape[2] > 1):
        x = x.contiguous()
    keep.append(x)
    t = CTensor()
    t.data = x.data_ptr()
    t.dtype = codes[x.dtype]
    t.memory = Memory.DEVICE if device else Memory.HOST
    for i in range(3):
        t.shape[i] = x.shape[i]
        t.stride[i] = max(x.stride(i), 0)
    return t


def _numpy_view(x: np.ndarray, keep: list) -> CTensor:
    codes = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16}
    if x.dtype not in codes:
        x = x.astype(np.float32)
    if any(s <= 0 and n > 1 for s, n in zip(x.strides, x.shape)) or any(s % x.itemsize for s in x.strides):
        x = np.ascontiguousarray(x)
    keep.append(x)
    t = CTensor()
    t.data = x.ctypes.data
    t.dtype = codes[x.dtype]
    t.memory = Memory.HOST
    for i in range(3):
        t.shape[i] = x.shape[i]
        t.stride[i] = max(x.strides[i] // x.itemsize, 0)
    return t


def tensor_view(x, keep: list) -> CTensor:
    """A kvscope_tensor over `x` ([heads, tokens, head_dim] torch tensor or numpy array). Objects that must
    stay alive for the call (x, or a converted copy) are appended to `keep`."""
    if isinstance(x, np.ndarray):
        if x.ndim != 3:
            raise ValueError(f"expected a 3-D [heads, tokens, head_dim] array, got shape {list(x.shape)}")
        return _numpy_view(x, keep)
    if hasattr(x, "data_ptr") and hasattr(x, "stride"):
        if x.dim() != 3:
            raise ValueError(f"expected a 3-D [heads, tokens, head_dim] tensor, got shape {list(x.shape)}")
        return _torch_view(x, keep)
    raise TypeError(f"expected a torch tensor or numpy array, got {type(x).__name__}")


def _int32_array(name: str, values: Sequence[int], n: int) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(values, dtype=np.int64))
    if a.shape != (n,):
        raise ValueError(f"tokens.{name} has shape {list(a.shape)}, expected [{n}] (context_tokens)")
    if a.size and (a.min() < -2 ** 31 or a.max() >= 2 ** 31):
        raise ValueError(f"tokens.{name} has values outside int32")
    return a.astype(np.int32)


# ---- a capture handle --------------------------------------------------------------------------------------
class Capture:
    """One open trace (kvscope_capture_open). Methods mirror the C API; see kvscope_capture.h."""

    def __init__(self, path: str, *, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 context_tokens: int, rope_theta: float = 10000.0, model_name: Optional[str] = None,
                 device: Optional[str] = None, creator: Optional[str] = None, dtype: Any = "float32",
                 max_decode_steps: int = 0, queue_bytes: int = 0, chunk_tokens: int = 0,
                 deflate_level: int = 0, profile: bool = False, cuda_stream: Optional[int] = None,
                 library: Optional[ctypes.CDLL] = None):
        self._lib = library or load_library()
        self.path = os.fspath(path)
        self.context_tokens = int(context_tokens)
        cfg = CConfig()
        cfg.struct_size = ctypes.sizeof(CConfig)
        cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim = (
            int(num_layers), int(num_q_heads), int(num_kv_heads), int(head_dim))
        cfg.rope_theta = float(rope_theta)
        self._strings = [s.encode() if s is not None else None for s in (model_name, device, creator)]
        cfg.model_name, cfg.device, cfg.creator = self._strings
        cfg.dtype = dtype_code(dtype)
        cfg.max_decode_steps = int(max_decode_steps)
        cfg.queue_bytes = int(queue_bytes)
        cfg.chunk_tokens = int(chunk_tokens)
        cfg.deflate_level = int(deflate_level)
        cfg.profile = 1 if profile else 0
        cfg.cuda_stream = cuda_stream or None
        handle = ctypes.c_void_p()
        _check(self._lib, self._lib.kvscope_capture_open(self.path.encode(), ctypes.byref(cfg),
                                                         self.context_tokens, ctypes.byref(handle)))
        self._handle: Optional[ctypes.c_void_p] = handle

    # -- state
    @property
    def is_open(self) -> bool:
        return self._handle is not None

    def _h(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise CaptureError(Status.ERR_STATE, f"{self.path}: the capture is already closed or aborted")
        return self._handle

    def _call(self, fn, *args) -> None:
        _check(self._lib, fn(self._h(), *args))

    # -- recording
    def set_tokens(self, modality: Sequence[int], position: Sequence[int], token_id: Sequence[int],
                   segment: Sequence[int], grid_row: Sequence[int], grid_col: Sequence[int],
                   text: Optional[Sequence[str]] = None) -> None:
        n = self.context_tokens
        mod = np.ascontiguousarray(np.asarray(modality, dtype=np.int64))
        if mod.shape != (n,):
            raise ValueError(f"tokens.modality has shape {list(mod.shape)}, expected [{n}] (context_tokens)")
        if mod.size and (mod.min() < 0 or mod.max() > 255):
            raise ValueError("tokens.modality has values outside 0..255")
        mod = mod.astype(np.uint8)
        arrays = [_int32_array(name, values, n) for name, values in
                  (("position", position), ("token_id", token_id), ("segment", segment),
                   ("grid_row", grid_row), ("grid_col", grid_col))]
        c_text = None
        if text is not None:
            if len(text) != n:
                raise ValueError(f"tokens.text has {len(text)} entries, expected {n} (context_tokens)")
            c_text = (ctypes.c_char_p * n)(*[_text_bytes(s) for s in text])
        i32p = ctypes.POINTER(ctypes.c_int32)
        self._call(self._lib.kvscope_capture_set_tokens, mod.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                   *[a.ctypes.data_as(i32p) for a in arrays], c_text)

    def prefill_layer(self, layer: int, q, k, v) -> None:
        keep: list = []
        tq, tk, tv = tensor_view(q, keep), tensor_view(k, keep), tensor_view(v, keep)
        self._call(self._lib.kvscope_capture_prefill_layer, int(layer), ctypes.byref(tq), ctypes.byref(tk),
                   ctypes.byref(tv))

    def layer_aggregates(self, layer: int, attn_colsum=None, attn_window=None) -> None:
        """attn_colsum [Hq, T], attn_window [Hq, W, T] (float32, host; either may be None)."""
        fp = ctypes.POINTER(ctypes.c_float)
        colsum = None if attn_colsum is None else np.ascontiguousarray(_to_numpy(attn_colsum), np.float32)
        window = None if attn_window is None else np.ascontiguousarray(_to_numpy(attn_window), np.float32)
        if window is not None and window.ndim != 3:
            raise ValueError(f"attn_window must be [Hq, W, T], got shape {list(window.shape)}")
        self._call(self._lib.kvscope_capture_layer_aggregates, int(layer),
                   None if colsum is None else colsum.ctypes.data_as(fp),
                   None if window is None else window.ctypes.data_as(fp),
                   0 if window is None else window.shape[1])

    def decode_layer(self, layer: int, step: int, q, k, v) -> None:
        keep: list = []
        tq, tk, tv = tensor_view(q, keep), tensor_view(k, keep), tensor_view(v, keep)
        self._call(self._lib.kvscope_capture_decode_layer, int(layer), int(step), ctypes.byref(tq),
                   ctypes.byref(tk), ctypes.byref(tv))

    def decode_token(self, step: int, token_id: int, position: int, text: Optional[str] = None) -> None:
        self._call(self._lib.kvscope_capture_decode_token, int(step), int(token_id), int(position),
                   None if text is None else _text_bytes(text))

    @staticmethod
    def _roles(roles: Sequence[int], what: str) -> np.ndarray:
        r = np.ascontiguousarray(np.asarray(roles, dtype=np.int64))
        if r.ndim != 1 or (r.size and (r.min() < 0 or r.max() > 255)):
            raise ValueError(f"{what} must be a list of role codes (0 context, 1 question, 2 answer, 3 template)")
        return r.astype(np.uint8)

    def set_token_roles(self, roles: Sequence[int]) -> None:
        """Roles of the context tokens (trace /tokens/role): 0 context, 1 question, 2 answer, 3 template."""
        r = self._roles(roles, "token roles")
        if r.shape != (self.context_tokens,):
            raise ValueError(f"token roles has {r.size} entries, expected {self.context_tokens} (context_tokens)")
        self._call(self._lib.kvscope_capture_set_token_roles, r.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))

    def set_decode_roles(self, roles: Sequence[int]) -> None:
        """Roles of the decode steps 0..len(roles)-1 (trace /decode/tokens/role); at close their number must
        equal the decode steps recorded."""
        r = self._roles(roles, "decode roles")
        self._call(self._lib.kvscope_capture_set_decode_roles, r.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                   int(r.size))

    def range_push(self, name: str) -> None:
        self._call(self._lib.kvscope_capture_range_push, name.encode())

    def range_pop(self) -> None:
        self._call(self._lib.kvscope_capture_range_pop)

    @contextlib.contextmanager
    def range(self, name: str):
        """A named range (NVTX + /profile/ranges) for the duration of the block."""
        self.range_push(name)
        try:
            yield
        finally:
            if self.is_open:
                self.range_pop()

    def stats(self) -> dict:
        s = CStats()
        s.struct_size = ctypes.sizeof(CStats)
        self._call(self._lib.kvscope_capture_get_stats, ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in CStats._fields_ if name != "struct_size"}

    # -- ending
    def close(self) -> None:
        """Waits for the writer, writes /decode and /profile, marks the trace complete. The handle is freed
        in every case; a failure (e.g. a layer never recorded) leaves the trace incomplete and raises."""
        handle = self._h()
        self._handle = None
        _check(self._lib, self._lib.kvscope_capture_close(handle))

    def abort(self) -> None:
        """Frees the handle without marking the trace complete (no-op when already closed)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.kvscope_capture_abort(handle)

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        elif self.is_open:
            self.close()
        return False

    def __del__(self):
        # A handle that was neither closed nor aborted (e.g. an exception before `with`): free it, leaving
        # the trace incomplete, so the writer thread does not outlive the object.
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing sensible to do
            pass


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)
