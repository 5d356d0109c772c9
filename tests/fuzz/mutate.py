#!/usr/bin/env python3
"""Structural fuzzer of kvscope's command-line tools (docs/robustness.md, "Fuzzing").

Takes valid trace and results files, applies random structured edits with h5py (shapes, dtypes,
attributes, missing objects, huge declared sizes, strings, values) or byte-level damage
(truncation, byte flips in the HDF5 metadata), and runs the tools on each mutated file with a
time limit and an address-space limit. A case fails when a tool
  - is killed by a signal or exits with a code other than 0 or 2 (crash, abort, sanitizer),
  - runs past the time limit (hang),
  - hits the memory limit or reports an allocation failure (std::bad_alloc, max_size()),
  - fails (exit 2) with other than exactly one line on stderr naming the file (an HDF5 error
    stack, a message without the file name),
  - refuses a trace that kvcap validate accepted (kvsim info/run/sweep exit 2: "inconsistent"),
    except for the documented replay refusals (REPLAY_REFUSALS),
  - accepts (kvcap validate exit 0) an edit the trace format forbids ("accepted-invalid"),
  - changes, moves or deletes its input file ("changed-input").
Failing inputs are copied to the crash directory with a .txt beside them (command, exit, stderr,
mutation). Exit status: 0 when no case failed, 1 otherwise, 2 for bad arguments.

Usage: mutate.py --bin BUILD/bin --seed-file F.h5 [...] [--seconds N | --cases N] [options]
"""

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

CATEGORIES = ["shape", "dtype", "attribute", "missing", "huge", "string", "value", "truncate", "byteflip"]
MEMORY_MARKERS = ("bad_alloc", "max_size()", "cannot allocate memory", "out of memory", "Cannot allocate")


# ------------------------------------------------------------------------------------------------
# Mutations. Each takes an open h5py.File (r+) or a path, a random.Random, and returns a one-line
# description of what it did; it raises Skip when the file has nothing it can act on.


class Skip(Exception):
    pass


# Appended to a mutation's description when the edit makes the file invalid by the trace format
# (kvcap validate must then refuse it: "accepted-invalid" otherwise).
MUST_REJECT = " [must be rejected]"


# A valid trace that kvsim cannot replay, refused in one line (docs/robustness.md, "Edge traces
# and numerical range in kvsim"): no decode steps, or values outside the float32 range its metrics
# are computed in. kvcap validate checks the format; these are not inconsistencies.
REPLAY_REFUSALS = ("is outside the range kvsim computes metrics in", "S = 0 decode steps")

def objects(f):
    """Datasets, groups and (object path, attribute name) pairs of an open file."""
    datasets, groups, attrs = [], ["/"], [("/", a) for a in f.attrs]

    def visit(name, obj):
        path = "/" + name
        if isinstance(obj, h5py.Dataset):
            datasets.append(path)
        else:
            groups.append(path)
        attrs.extend((path, a) for a in obj.attrs)

    f.visititems(visit)
    return datasets, groups, attrs


def interesting(rng, paths, weight_words=("tokens", "profile", "points", "decode", "/000", "flags")):
    """Picks a path, favouring the small metadata datasets over the many layer tensors."""
    if not paths:
        raise Skip("nothing to pick")
    favoured = [p for p in paths if any(w in p for w in weight_words) and "/layers/00" not in p[:12]]
    if favoured and rng.random() < 0.7:
        return rng.choice(favoured)
    return rng.choice(paths)


def replace_dataset(f, path, data=None, shape=None, dtype=None, **kw):
    """Deletes a dataset and creates another at the same path, keeping its attributes."""
    old = f[path]
    attrs = {k: old.attrs[k] for k in old.attrs}
    del f[path]
    if data is not None:
        ds = f.create_dataset(path, data=data, **kw)
    else:
        ds = f.create_dataset(path, shape=shape, dtype=dtype, **kw)
    for k, v in attrs.items():
        try:
            ds.attrs[k] = v
        except Exception:  # noqa: BLE001 (an attribute h5py cannot round-trip is just dropped)
            pass
    return ds


def read_any(ds):
    if ds.shape is None:
        return None
    try:
        return ds[()]
    except Exception as e:  # noqa: BLE001
        raise Skip(f"cannot read {ds.name}: {e}")


def mut_shape(f, rng):
    datasets, _, _ = objects(f)
    path = interesting(rng, datasets)
    data = read_any(f[path])
    if data is None or not isinstance(data, np.ndarray):
        raise Skip("scalar")
    shape = list(data.shape)
    how = rng.choice(["drop_dim", "add_dim", "dim_zero", "dim_one", "dim_plus", "dim_minus", "dim_double",
                      "scalar", "transpose"])
    if how == "drop_dim" and shape:
        shape.pop(rng.randrange(len(shape)))
    elif how == "add_dim":
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([1, 2, 3]))
    elif how == "scalar":
        shape = []
    elif how == "transpose" and len(shape) >= 2:
        shape = shape[::-1]
    elif shape:
        i = rng.randrange(len(shape))
        shape[i] = {"dim_zero": 0, "dim_one": 1, "dim_plus": shape[i] + 1, "dim_minus": max(shape[i] - 1, 0),
                    "dim_double": shape[i] * 2}.get(how, shape[i])
    new = np.resize(data, shape) if data.size and np.prod(shape) else np.zeros(shape, dtype=data.dtype)
    replace_dataset(f, path, data=new)
    return f"shape {how}: {path} {tuple(data.shape)} -> {tuple(shape)}"


def custom_float16(rng):
    """An IEEE half description with one field corrupted (what a damaged datatype message gives)."""
    tid = h5py.h5t.IEEE_F16LE.copy()
    how = rng.choice(["ebias", "ebias", "precision", "offset", "fields", "norm", "order", "size"])
    if how == "ebias":
        tid.set_ebias(rng.choice([0, 1, 14, 16, 31, 127, 133, 255, 1023]))
    elif how == "precision":
        tid.set_precision(rng.choice([8, 10, 12, 15]))
    elif how == "offset":
        tid.set_precision(12)
        tid.set_offset(rng.choice([1, 2, 4]))
    elif how == "fields":
        # spos, epos, esize, mpos, msize: the bfloat16-in-16 or swapped layouts
        tid.set_fields(*rng.choice([(15, 7, 8, 0, 7), (15, 11, 4, 0, 11), (0, 1, 5, 6, 10), (15, 10, 5, 0, 9)]))
    elif how == "norm":
        tid.set_norm(rng.choice([h5py.h5t.NORM_NONE, h5py.h5t.NORM_MSBSET]))
    elif how == "order":
        tid.set_order(h5py.h5t.ORDER_BE)
    elif how == "size":
        tid.set_size(4)
    return tid, how


def mut_dtype(f, rng):
    datasets, _, _ = objects(f)
    path = interesting(rng, datasets, ("layers/000", "tokens", "decode", "points", "profile"))
    data = read_any(f[path])
    if data is None or not isinstance(data, np.ndarray) or data.dtype.names:
        raise Skip("no plain array")
    shape = data.shape
    tensor_f16 = data.dtype == np.float16 and data.ndim == 3
    choice = "custom_f16" if tensor_f16 and rng.random() < 0.5 else rng.choice(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint64", "float16", "float32",
                         "float64", ">f2", ">f4", ">i4", ">i8", "bool", "string", "compound", "custom_f16",
                         "custom_f16", "custom_f16", "bitfield", "opaque"])
    if choice == "custom_f16":
        tid, how = custom_float16(rng)
        attrs = {k: f[path].attrs[k] for k in f[path].attrs}
        del f[path]
        space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(f.id, path.encode(), tid, space)
        raw = np.frombuffer(np.asarray(data, dtype="<f2").tobytes() * (tid.get_size() // 2), dtype=np.uint8)
        dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(raw), mtype=tid)
        for k, v in attrs.items():
            f[path].attrs[k] = v
        # a big-endian half is a valid IEEE half; every other edit breaks the description
        return f"dtype custom float16 ({how}): {path}" + ("" if how == "order" else MUST_REJECT)
    if choice == "string":
        new = np.array([str(x) for x in np.ravel(data)[: max(1, data.size)]], dtype=h5py.string_dtype())
        new = new.reshape(shape) if new.size == data.size else new
    elif choice == "compound":
        new = np.zeros(shape, dtype=[("a", "<i4"), ("b", "<f4")])
    elif choice == "bitfield":
        new = np.asarray(data).astype("<u1") if data.size else np.zeros(shape, "<u1")
        replace_dataset(f, path, shape=shape, dtype=h5py.h5t.STD_B8LE.dtype)
        return f"dtype bitfield: {path}"
    elif choice == "opaque":
        new = np.zeros(shape, dtype="V4")
    else:
        with np.errstate(all="ignore"):
            new = np.asarray(data).astype(choice) if data.dtype.kind not in "OSU" else np.zeros(shape, choice)
    replace_dataset(f, path, data=new)
    return f"dtype {data.dtype} -> {choice}: {path}"


BAD_VALUES = [0, -1, 1, 2, 3, 4.5, -4.5, 2**31 - 1, 2**31, 2**32, 2**62, -(2**62), 1e6, 1e300, float("nan"),
              float("inf"), float("-inf"), "", "1.0", " 1.0", "1.0abc", "1.0.0", "2.0", "0.9", "1.99", "kvscope-trace",
              "kvscope-results", "float16", "bfloat16", "float32", "int8", "\xff\xfe", "a" * 70000,
              np.array([1, 2, 3]), np.array([], dtype="i8"), np.array([[1.5]]), h5py.Empty("i8"), np.int8(-1),
              np.uint64(2**64 - 1), np.float16(np.nan), b"\x00\x01\x02", np.bytes_(b"1.0")]


def mut_attribute(f, rng):
    datasets, groups, attrs = objects(f)
    how = rng.choice(["set", "set", "set", "add", "retype"])
    if how == "add":
        obj = rng.choice(groups + datasets)
        name = rng.choice(["complete", "version", "format", "num_layers", "dtype", "attn_window", "junk",
                           "num_points", "modalities"])
        value = rng.choice(BAD_VALUES)
        f[obj].attrs[name] = value
        return f"attribute add {obj}@{name} = {short(value)}"
    if not attrs:
        raise Skip("no attributes")
    obj, name = rng.choice([a for a in attrs if a[0] == "/"] if rng.random() < 0.6 else attrs)
    if how == "retype":
        old = f[obj].attrs[name]
        try:
            arr = np.asarray(old)
            value = arr.astype(rng.choice(["f8", "f4", "i1", "u8", ">i8", "f2"])) if arr.dtype.kind in "iuf" \
                else np.int64(len(str(old)))
        except Exception:  # noqa: BLE001
            raise Skip("cannot retype")
    else:
        value = rng.choice(BAD_VALUES)
    del f[obj].attrs[name]
    f[obj].attrs[name] = value
    return f"attribute {how} {obj}@{name} = {short(value)}" + (MUST_REJECT if forbidden(f, obj, name, value) else "")


def forbidden(f, obj, name, value):
    """True when docs/trace-format.md rules out this root attribute value of a trace."""
    if obj != "/" or f.attrs.get("format") not in ("kvscope-trace", b"kvscope-trace"):
        return False
    try:
        v = value.item() if isinstance(value, np.generic) else value
    except Exception:  # noqa: BLE001
        return False
    if name == "version":
        return isinstance(v, str) and v in (" 1.0", "1.0abc", "1.0.0", "", "2.0")
    if isinstance(v, (str, bytes)) or isinstance(value, (np.ndarray, h5py.Empty)):
        return False
    if name == "complete":
        return v not in (0, 1)
    if name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        return not (isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer())) or v <= 0
    if name == "rope_theta":
        return not np.isfinite(v) or v <= 0
    return False


def mut_missing(f, rng):
    datasets, groups, attrs = objects(f)
    what = rng.choice(["dataset", "dataset", "group", "attribute", "attribute"])
    if what == "dataset":
        path = interesting(rng, datasets)
        del f[path]
    elif what == "group":
        path = interesting(rng, [g for g in groups if g != "/"])
        del f[path]
    else:
        if not attrs:
            raise Skip("no attributes")
        obj, name = rng.choice(attrs)
        del f[obj].attrs[name]
        path = f"{obj}@{name}"
    return f"missing {what}: {path}"


def mut_huge(f, rng):
    datasets, groups, attrs = objects(f)
    how = rng.choice(["dataset", "dataset", "dataset", "attribute", "attribute", "all_tokens", "extendible"])
    huge = rng.choice([2**31, 2**31 - 1, 5 * 10**7, 10**6, 10**5, 2**40, 2**62])
    if how in ("dataset", "extendible"):
        path = interesting(rng, datasets)
        ds = f[path]
        if ds.shape is None or len(ds.shape) == 0:
            raise Skip("scalar")
        shape = list(ds.shape)
        i = rng.randrange(len(shape))
        shape[i] = huge
        if np.prod(np.array(shape, dtype=object)) * ds.dtype.itemsize > 2**63:
            shape[i] = 2**31
        maxshape = [None] * len(shape) if how == "extendible" else None
        replace_dataset(f, path, shape=tuple(shape), dtype=ds.dtype, chunks=True, maxshape=maxshape)
        return f"huge {how}: {path} dim {i} = {shape[i]} (chunked, nothing written)"
    if how == "all_tokens":
        if "tokens" not in f:
            raise Skip("no /tokens")
        n = rng.choice([2**31, 5 * 10**7, 10**6])
        for name in list(f["tokens"]):
            ds = f["tokens"][name]
            shape = (n,) + tuple(ds.shape[1:])
            replace_dataset(f, ds.name, shape=shape, dtype=ds.dtype, chunks=True)
        return f"huge all_tokens: every /tokens dataset has {n} rows"
    names = [a for a in attrs if a[1] in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "num_points",
                                          "num_tokens", "num_decode_steps", "attn_window")]
    obj, name = rng.choice(names or attrs)
    value = np.int64(rng.choice([10**5, 10**6, 2**31 - 1, 2**31, 2**62]))
    del f[obj].attrs[name]
    f[obj].attrs[name] = value
    return f"huge attribute {obj}@{name} = {value}"


def string_targets(f):
    datasets, _, attrs = objects(f)
    ds = [p for p in datasets if f[p].dtype.kind == "O" or f[p].dtype.names]
    at = [(o, a) for o, a in attrs if isinstance(f[o].attrs[a], (str, bytes))]
    return ds, at


def bad_string(rng):
    return rng.choice(["", "\x00", "a\x00b", "\xff\xfe\xfd", "é" * 5000, "a" * 1_000_000, "%s%n%x", "\n\n\n",
                       "../../etc/passwd", "1.0\x00abc", "\u202e"])


def mut_string(f, rng):
    ds, at = string_targets(f)
    if (at and rng.random() < 0.5) or not ds:
        if not at:
            raise Skip("no strings")
        obj, name = rng.choice(at)
        old = f[obj].attrs[name]
        how = rng.choice(["value", "fixed", "fixed_utf8", "bytes", "array"])
        del f[obj].attrs[name]
        if how == "value":
            f[obj].attrs[name] = bad_string(rng)
        elif how == "fixed":
            f[obj].attrs.create(name, np.bytes_(str(old).encode()), dtype=h5py.string_dtype("ascii", len(str(old)) + 1))
        elif how == "fixed_utf8":
            s = str(old).encode()
            f[obj].attrs.create(name, s, dtype=h5py.string_dtype("utf-8", max(1, len(s) + rng.choice([-1, 0, 3]))))
        elif how == "bytes":
            f[obj].attrs[name] = np.void(b"\xff" * 8)
        else:
            f[obj].attrs[name] = np.array([str(old), str(old)], dtype=h5py.string_dtype())
        return f"string attribute {how}: {obj}@{name}"
    path = rng.choice(ds)
    d = f[path]
    if d.dtype.names:  # compound with vlen strings: /profile/*
        data = d[()]
        how = rng.choice(["value", "drop_field"])
        if how == "drop_field" and len(d.dtype.names) > 1:
            keep = [n for n in d.dtype.names if n != rng.choice(d.dtype.names)]
            new = np.zeros(data.shape, dtype=[(n, d.dtype[n]) for n in keep])
            for n in keep:
                new[n] = data[n]
            replace_dataset(f, path, data=new)
            return f"string compound drop_field: {path}"
        str_fields = [n for n in d.dtype.names if d.dtype[n].kind == "O"]
        if not str_fields or data.size == 0:
            raise Skip("no string fields")
        field = rng.choice(str_fields)
        data[field][rng.randrange(data.size)] = bad_string(rng)
        d[...] = data
        return f"string compound value: {path}.{field}"
    data = d[()]
    how = rng.choice(["value", "fixed_utf8", "fixed_ascii", "numeric"])
    if how == "value" and data.size:
        data.flat[rng.randrange(data.size)] = bad_string(rng)
        d[...] = data
    elif how in ("fixed_utf8", "fixed_ascii"):
        enc = "utf-8" if how == "fixed_utf8" else "ascii"
        strs = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in np.ravel(data)]
        n = max([len(s.encode()) for s in strs] + [1]) + rng.choice([-2, 0, 0, 5])
        arr = np.array([s.encode()[: max(n, 1)] for s in strs], dtype=f"S{max(n, 1)}").reshape(data.shape)
        replace_dataset(f, path, data=arr, dtype=h5py.string_dtype(enc, max(n, 1)))
    else:
        replace_dataset(f, path, data=np.arange(data.size, dtype="i4").reshape(data.shape))
    return f"string dataset {how}: {path}"


def mut_value(f, rng):
    datasets, _, _ = objects(f)
    numeric = [p for p in datasets if f[p].dtype.kind in "iuf" and f[p].size]
    path = interesting(rng, numeric, ("tokens", "points", "layers/", "heads/", "flags", "decode", "/000"))
    d = f[path]
    data = d[()]
    flat = data.reshape(-1)
    n = max(1, int(flat.size * rng.choice([0.0, 0.01, 0.5, 1.0])))
    idx = [rng.randrange(flat.size) for _ in range(n)]
    if d.dtype.kind == "f":
        v = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 65504.0, 6e-8, 3.4e38])
    else:
        info = np.iinfo(d.dtype)
        v = rng.choice([info.min, info.max, -1 if info.min < 0 else info.max, 0, 1, 2, 3, 4, 255, 256])
    with np.errstate(all="ignore"):
        flat[idx] = np.asarray(v).astype(d.dtype)
    d[...] = flat.reshape(data.shape)
    return f"value {path}: {len(idx)} element(s) = {v}"


def raw_ranges(path):
    """Byte ranges of contiguous raw data in the file (to aim byte flips at metadata)."""
    ranges = []
    with h5py.File(path, "r") as f:
        def visit(_name, obj):
            if isinstance(obj, h5py.Dataset):
                try:
                    off = obj.id.get_offset()
                    if off is not None:
                        ranges.append((off, off + obj.id.get_storage_size()))
                except Exception:  # noqa: BLE001
                    pass
        f.visititems(visit)
    return ranges


def mut_truncate(path, rng):
    size = os.path.getsize(path)
    cut = rng.choice([rng.randrange(size), size - rng.randrange(1, 4096), rng.randrange(min(size, 4096)), 0, 8, 512])
    cut = max(0, min(cut, size - 1))
    with open(path, "r+b") as fh:
        fh.truncate(cut)
    return f"truncate {size} -> {cut} bytes"


def mut_byteflip(path, rng):
    size = os.path.getsize(path)
    raw = raw_ranges(path)
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
    n = rng.choice([1, 1, 2, 4, 8, 32])
    where = []
    for _ in range(n):
        for _try in range(50):
            pos = rng.randrange(size) if rng.random() < 0.5 else rng.randrange(min(size, 8192))
            if not any(a <= pos < b for a, b in raw):
                break
        how = rng.choice(["xor", "zero", "ff", "random", "inc"])
        if how == "xor":
            data[pos] ^= 1 << rng.randrange(8)
        elif how == "zero":
            data[pos] = 0
        elif how == "ff":
            data[pos] = 0xFF
        elif how == "inc":
            data[pos] = (data[pos] + 1) & 0xFF
        else:
            data[pos] = rng.randrange(256)
        where.append(f"{pos}:{how}")
    with open(path, "wb") as fh:
        fh.write(data)
    return f"byteflip {n} metadata byte(s) at " + ",".join(where[:8]) + ("..." if n > 8 else "")


STRUCTURED = {"shape": mut_shape, "dtype": mut_dtype, "attribute": mut_attribute, "missing": mut_missing,
              "huge": mut_huge, "string": mut_string, "value": mut_value}
BYTES = {"truncate": mut_truncate, "byteflip": mut_byteflip}


def short(v):
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def mutate(src, dst, category, rng):
    shutil.copyfile(src, dst)
    if category in BYTES:
        return BYTES[category](dst, rng)
    with h5py.File(dst, "r+") as f:
        return STRUCTURED[category](f, rng)


# ------------------------------------------------------------------------------------------------
# Running the tools.


def file_kind(path):
    with h5py.File(path, "r") as f:
        fmt = f.attrs.get("format", b"")
    fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
    return "results" if fmt == "kvscope-results" else "trace"


class Xvfb:
    """One X server for every kvview run of a fuzzing session (xvfb-run per case costs ~0.5 s). It
    takes a random free display number in 200..899, away from the :0 and :99 upward that other
    X servers and xvfb-run -a use (a server starting on our number would remove our socket)."""

    def __init__(self):
        self.proc = None
        self.display = None
        if shutil.which("Xvfb") is None:
            return
        rng = random.Random(os.getpid())
        for _ in range(20):
            n = rng.randrange(200, 900)
            if os.path.exists(f"/tmp/.X{n}-lock") or os.path.exists(f"/tmp/.X11-unix/X{n}"):
                continue
            self.proc = subprocess.Popen(["Xvfb", f":{n}", "-screen", "0", "1280x1024x24", "-nolisten", "tcp"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _wait in range(100):
                if os.path.exists(f"/tmp/.X11-unix/X{n}"):
                    self.display = f":{n}"
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
            self.close()

    def close(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


def limits(mem_bytes):
    def apply():
        os.setsid()
        if mem_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_tool(cmd, timeout, mem_bytes, env):
    """Runs one command; returns (rc, stderr, seconds, max_rss_kib, timed_out)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             preexec_fn=limits(mem_bytes), env=env)
        timed_out = False
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(p.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.01)
        p.returncode = 0  # reaped by wait4
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    return rc, stderr, time.monotonic() - t0, usage.ru_maxrss, timed_out


def error_lines(stderr):
    """stderr lines that are part of the error report (progress bars and warnings are not)."""
    lines = []
    for line in stderr.splitlines():
        line = line.rstrip("\r")
        if not line.strip():
            continue
        if "\r" in line or line.startswith("kvcap validate [") or ": warning: " in line:
            continue
        if " backend cpu" in line and line.startswith("kvsim"):
            continue
        lines.append(line)
    return lines


def judge(rc, stderr, timed_out, path):
    """None when the outcome is acceptable, else a failure kind."""
    if timed_out:
        return "timeout"
    if rc < 0:
        return f"signal{-rc}"
    lines = error_lines(stderr)
    if any(m in stderr for m in MEMORY_MARKERS):
        return "memory"
    if rc not in (0, 2):
        return f"exit{rc}"
    if rc == 2:
        if len(lines) != 1:
            return "stderr-lines"
        if os.path.basename(path) not in lines[0]:
            return "unnamed-file"
    return None


def read_unchanged(path, content):
    try:
        with open(path, "rb") as fh:
            return fh.read() == content
    except OSError:
        return False


def tool_commands(kinds, path, want_view, view):
    """(tool name, argv) to run on one mutated file."""
    b = BIN
    cmds = []
    if kinds == "trace":
        cmds += [("validate", [f"{b}/kvcap", "validate", "-q", path]),
                 ("info", [f"{b}/kvsim", "info", path]),
                 ("run", [f"{b}/kvsim", "run", "--backend", "cpu", "--threads", "1", "-q", "--trace", path,
                          "--policy", "snapkv@0.5"]),
                 ("sweep", [f"{b}/kvsim", "sweep", "--backend", "cpu", "--threads", "1", "-q", "--trace", path,
                            "--policies", "snapkv,h2o+int8,unicache", "--budgets", "0.3,0.6", "--alloc-search", "tova"])]
        if want_view:
            cmds.append(("view-trace", [f"{b}/kvview", path, "--screenshot", path + ".png", "--size", "320x200",
                                        "--timeout", "15"]))
    else:
        if want_view:
            cmds.append(("view-results", [f"{b}/kvview", "--results", path, "--view", view, "--screenshot",
                                          path + ".png", "--size", "320x200", "--timeout", "15"]))
    return cmds


RESULTS_VIEWS = ["overview", "quality", "collapse", "budgets", "whatif"]
BIN = None


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="categories: " + ", ".join(CATEGORIES))
    ap.add_argument("--bin", required=True, help="folder with kvcap, kvsim and (optionally) kvview")
    ap.add_argument("--seed-file", action="append", required=True, help="valid trace or results file (repeat)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="stop starting cases after this long (default 60, or no limit with --cases)")
    ap.add_argument("--cases", type=int, default=0, help="stop after this many cases (default: no limit)")
    ap.add_argument("--seed", type=int, default=1, help="random seed; case i uses seed*1e6+i (default 1)")
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated subset of categories")
    ap.add_argument("--timeout", type=float, default=20, help="seconds per tool run (default 20)")
    ap.add_argument("--memory-mib", type=int, default=1024,
                    help="address-space limit per tool run in MiB (default 1024; 0 = none, needed under ASan)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run in parallel (default 2)")
    ap.add_argument("--view", choices=["auto", "on", "off"], default="auto",
                    help="also run kvview --screenshot (auto: when kvview and Xvfb exist)")
    ap.add_argument("--crash-dir", default="fuzz-crashes", help="where failing inputs are saved")
    ap.add_argument("--work-dir", default=None, help="scratch folder (default: a temporary one, removed)")
    ap.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    ap.add_argument("--replay", action="append", default=[],
                    help="run the tools on this file as is (no mutation; repeat); for regression checks")
    ap.add_argument("--expect-reject", action="store_true",
                    help="with --replay: the file is invalid by the format, kvcap validate must refuse it")
    ap.add_argument("--trusted", action="store_true",
                    help="with --harness: also run it with KVSCOPE_TRUSTED_FILES=1 (the readers without the guard)")
    ap.add_argument("--harness", default=None,
                    help="with --replay: also run this fuzz_replay binary (the libFuzzer target's steps in one "
                         "process, three tools' work: 3x the time limit) on the file; it must exit 0")
    args = ap.parse_args()
    BIN = os.path.abspath(args.bin)
    seconds = args.seconds if args.seconds is not None else (float("inf") if args.cases else 60.0)
    cats = [c for c in args.categories.split(",") if c]
    bad = [c for c in cats if c not in CATEGORIES]
    if bad or not cats:
        print(f"mutate.py: unknown categories {bad} (valid: {', '.join(CATEGORIES)})", file=sys.stderr)
        return 2
    for tool in ("kvcap", "kvsim"):
        if not os.access(os.path.join(BIN, tool), os.X_OK):
            print(f"mutate.py: {BIN}/{tool} not found", file=sys.stderr)
            return 2
    seeds = []
    for s in args.seed_file:
        try:
            seeds.append((os.path.abspath(s), file_kind(s)))
        except Exception as e:  # noqa: BLE001
            print(f"mutate.py: {s}: not a readable seed: {e}", file=sys.stderr)
            return 2
    have_view = os.access(os.path.join(BIN, "kvview"), os.X_OK)
    xvfb = None
    if args.view != "off" and have_view:
        if os.environ.get("DISPLAY") and args.view == "on":
            pass
        else:
            xvfb = Xvfb()
    env = dict(os.environ)
    if xvfb and xvfb.display:
        env["DISPLAY"] = xvfb.display
    view_ok = have_view and args.view != "off" and bool(env.get("DISPLAY"))
    if args.view == "on" and not view_ok:
        print("mutate.py: --view on needs kvview and Xvfb (or DISPLAY)", file=sys.stderr)
        return 2
    mem = args.memory_mib * 1024 * 1024
    os.makedirs(args.crash_dir, exist_ok=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="kvscope_fuzz_")
    os.makedirs(work, exist_ok=True)
    env["KVSCOPE_FUZZ_SCRATCH"] = work  # fuzz_replay's copy of its input: removed with the work folder

    lock = threading.Lock()
    stats = {c: {"cases": 0, "skipped": 0, "runs": 0, "failures": 0} for c in cats + ["replay"]}
    tools_runs = {}
    failures = []
    signatures = {}
    max_rss = {}
    start = time.monotonic()

    def record(case_id, category, desc, content, tool, cmd, rc, stderr, secs, rss, kind):
        with lock:
            stats[category]["runs"] += 1
            tools_runs[tool] = tools_runs.get(tool, 0) + 1
            max_rss[tool] = max(max_rss.get(tool, 0), rss)
            if kind is None:
                return
            stats[category]["failures"] += 1
            first = (error_lines(stderr) or [""])[0]
            sig = (tool, kind, category)
            signatures[sig] = signatures.get(sig, 0) + 1
            failures.append({"case": case_id, "category": category, "mutation": desc, "tool": tool, "kind": kind,
                             "rc": rc, "seconds": round(secs, 2), "stderr_first": first[:300]})
            if signatures[sig] > 3:  # keep a few inputs per (tool, kind, category)
                return
            digest = hashlib.sha1(content).hexdigest()[:10]
            prefix = "results" if tool == "view-results" else "trace"
            base = os.path.join(args.crash_dir, f"{prefix}-{category}-{tool}-{kind}-{digest}")
            with open(base + ".h5", "wb") as fh:
                fh.write(content)
            with open(base + ".txt", "w") as fh:
                fh.write(f"case {case_id} (seed {args.seed}), category {category}\nmutation: {desc}\n"
                         f"command: {' '.join(cmd)}\nexit: {rc}, {secs:.2f} s, max RSS {rss} KiB, failure: {kind}\n"
                         f"stderr:\n{stderr[-4000:]}")

    def run_case(case_id, category, kind, desc, path, want_view, view="overview", must_reject=False):
        with open(path, "rb") as fh:
            content = fh.read()
        validated = None
        for tool, cmd in tool_commands(kind, path, want_view, view):
            rc, stderr, secs, rss, to = run_tool(cmd, args.timeout, mem, env)
            # kvview's exit 1 "no window": the X server refused a connection now and then under
            # load; retried, and reported as a failure of the harness ("no-display") if it stays
            for _retry in range(3):
                if not (tool.startswith("view") and rc == 1 and "cannot initialise GLFW" in stderr):
                    break
                time.sleep(0.5)
                rc, stderr, secs, rss, to = run_tool(cmd, args.timeout, mem, env)
            verdict = judge(rc, stderr, to, path)
            if verdict and tool.startswith("view") and rc == 1 and "cannot initialise GLFW" in stderr:
                verdict = "no-display"
            if verdict is None and not read_unchanged(path, content):
                verdict = "changed-input"  # a reader must never write to, move or delete its input
                with open(path, "wb") as fh:
                    fh.write(content)
            if tool == "validate":
                validated = rc == 0
                if verdict is None and validated and must_reject:
                    verdict = "accepted-invalid"  # the mutation made the file invalid by the spec
            elif (verdict is None and validated and rc == 2 and tool in ("info", "run", "sweep")
                  and not any(r in stderr for r in REPLAY_REFUSALS)):
                verdict = "inconsistent"  # kvcap validate said valid, this tool refuses the file
            record(case_id, category, desc, content, tool, cmd, rc, stderr, secs, rss, verdict)
        for ext in (".png",):
            if os.path.exists(path + ext):
                os.remove(path + ext)

    def one_case(i):
        rng = random.Random(args.seed * 1_000_000 + i)
        category = cats[i % len(cats)]
        src, kind = seeds[rng.randrange(len(seeds))]
        path = os.path.join(work, f"case{i:06d}-{os.path.basename(src)}")
        try:
            desc = mutate(src, path, category, rng)
        except Skip:
            with lock:
                stats[category]["skipped"] += 1
            return
        except Exception as e:  # noqa: BLE001 (h5py refused the edit: not a case)
            with lock:
                stats[category]["skipped"] += 1
            if os.environ.get("KVSCOPE_FUZZ_DEBUG"):
                print(f"case {i} {category}: mutation failed: {type(e).__name__}: {e}", file=sys.stderr)
            if os.path.exists(path):
                os.remove(path)
            return
        with lock:
            stats[category]["cases"] += 1
        want_view = view_ok and (kind == "results" or rng.random() < 0.25)
        try:
            run_case(i, category, kind, desc, path, want_view, rng.choice(RESULTS_VIEWS), desc.endswith(MUST_REJECT))
        finally:
            if os.path.exists(path):
                os.remove(path)

    try:
        for r in args.replay:
            path = os.path.abspath(r)
            # by name (results-*.h5): h5py itself may crash on a damaged file
            kind = "results" if os.path.basename(path).startswith("results") else "trace"
            stats["replay"]["cases"] += 1
            for view in (RESULTS_VIEWS if kind == "results" else ["overview"]):
                run_case(-1, "replay", kind, "replay " + r, path, view_ok, view, args.expect_reject)
            if args.harness:
                # the guards and readers as the tools run them; with --trusted also the in-process
                # readers alone (KVSCOPE_TRUSTED_FILES=1 skips the isolated pre-check)
                for tool, extra in [("harness", {})] + ([("harness-trusted", {"KVSCOPE_TRUSTED_FILES": "1"})]
                                                        if args.trusted else []):
                    cmd = [os.path.abspath(args.harness), path]
                    # three tools' work in one process (kvcap validate, kvsim's and kvview's checks)
                    rc, stderr, secs, rss, to = run_tool(cmd, 3 * args.timeout, mem, {**env, **extra})
                    kind_h = judge(rc, stderr, to, path)
                    if kind_h is None and rc != 0:
                        kind_h = f"exit{rc}"
                    with open(path, "rb") as fh:
                        record(-1, "replay", "replay " + r, fh.read(), tool, cmd, rc, stderr, secs, rss, kind_h)
        if not args.replay:
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                i = 0
                pending = set()
                while True:
                    if (args.cases and i >= args.cases) or time.monotonic() - start >= seconds:
                        break
                    while len(pending) >= max(1, args.jobs) * 2:
                        done = [p for p in pending if p.done()]
                        for p in done:
                            p.result()
                            pending.discard(p)
                        if not done:
                            time.sleep(0.01)
                    pending.add(pool.submit(one_case, i))
                    i += 1
                for p in pending:
                    p.result()
    finally:
        if xvfb:
            xvfb.close()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    elapsed = time.monotonic() - start
    total_cases = sum(s["cases"] for s in stats.values())
    total_fail = len(failures)
    print(f"structural fuzzer: {total_cases} cases in {elapsed:.0f} s (seed {args.seed}, limits "
          f"{args.timeout:g} s, {args.memory_mib} MiB address space{', kvview on' if view_ok else ''})")
    print(f"  {'category':10} {'cases':>6} {'skipped':>8} {'tool runs':>10} {'failures':>9}")
    for c, s in stats.items():
        if s["cases"] or s["skipped"]:
            print(f"  {c:10} {s['cases']:6d} {s['skipped']:8d} {s['runs']:10d} {s['failures']:9d}")
    print("  tool runs: " + ", ".join(f"{t} {n} (max RSS {max_rss[t] // 1024} MiB)" for t, n in
                                      sorted(tools_runs.items())))
    if failures:
        print(f"  {total_fail} failing tool runs; inputs in {args.crash_dir}/:")
        seen = set()
        for fl in failures:
            key = (fl["tool"], fl["kind"], fl["category"])
            if key in seen:
                continue
            seen.add(key)
            print(f"    {fl['category']}/{fl['tool']}: {fl['kind']} (exit {fl['rc']}, x{signatures[key]}): "
                  f"{fl['mutation']} -> {fl['stderr_first'][:160]}")
    if args.summary_json:
        with open(args.summary_json, "w") as fh:
            json.dump({"seconds": elapsed, "seed": args.seed, "categories": stats, "tool_runs": tools_runs,
                       "max_rss_kib": max_rss, "failures": failures}, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
