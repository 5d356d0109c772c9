#!/usr/bin/env python3
"""Declared sizes, datatypes and values that C++ cannot easily write, made with h5py.

Every bad case must make `kvcap validate` (and, for structural problems, `kvsim info`) exit with a
code in 1..127 and exactly one line on stderr naming the file and containing the expected text,
within 20 s and under 1 GiB of address space (prlimit --as; skipped in sanitizer builds, whose
shadow memory needs more). Every good case must validate. docs/robustness.md lists these cases.

usage: limits_h5py.py KVCAP KVSIM OUTDIR
"""
import math
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

kvcap, kvsim, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
failures = []
GiB = 1 << 30


def sanitized(binary):
    """True for a sanitizer build (its shadow memory needs far more address space than 1 GiB)."""
    r = subprocess.run(["ldd", binary], capture_output=True, text=True)
    if "asan" in r.stdout or "tsan" in r.stdout or "msan" in r.stdout:
        return True
    with open(binary, "rb") as fp:  # statically linked runtimes (clang's default)
        data = fp.read()
    return any(m in data for m in (b"__asan_init", b"__tsan_init", b"__msan_init"))


limit = [] if sanitized(kvcap) or not shutil.which("prlimit") else ["prlimit", f"--as={GiB}"]


def run(cmd):
    try:
        r = subprocess.run(limit + cmd, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None
    r.lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("kvcap validate [")]
    return r


def expect_bad(name, path, expect, info=True):
    tools = [("validate", [kvcap, "validate", "-q", str(path)])]
    if info:
        tools.append(("info", [kvsim, "info", str(path)]))
    for tool, cmd in tools:
        r = run(cmd)
        if r is None:
            failures.append(f"{tool} {name}: timed out after 20 s")
        elif not 1 <= r.returncode <= 127:
            failures.append(f"{tool} {name}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
        elif len(r.lines) != 1:
            failures.append(f"{tool} {name}: {len(r.lines)} lines on stderr: {r.stderr.strip()[-300:]}")
        elif str(path) not in r.lines[0] or (tool == "validate" and expect not in r.lines[0]):
            failures.append(f"{tool} {name}: '{r.lines[0]}' lacks '{expect}'")
        else:
            print(f"ok   {tool} {name}: {r.lines[0]}")
            continue
        print("FAIL", failures[-1])


def expect_good(name, path, expect_stdout=""):
    r = run([kvcap, "validate", str(path)])
    if r is None or r.returncode != 0 or expect_stdout not in r.stdout:
        failures.append(f"{name}: rejected: {r and (r.stderr.strip() or r.stdout.strip())}")
        print("FAIL", failures[-1])
    else:
        print(f"ok   {name}: {r.stdout.strip()}")


good = out / "good.h5"
subprocess.run([kvcap, "synth", "--preset", "tiny", "--images", "1", "--image-tokens", "16", "--text", "8",
                "--decode", "3", "-q", "-o", str(good)], check=True)
with h5py.File(good, "r") as f:
    T = f["tokens/modality"].shape[0]
    Hq = int(f.attrs["num_q_heads"])
    MOD = f["tokens/modality"][:]
VIS = np.where(MOD == 1)[0]
TXT = np.where(MOD == 0)[0]


def case(name, edit, expect, info=True):
    path = out / f"{name}.h5"
    shutil.copy(good, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    expect_bad(name, path, expect, info)
    return path


def replace(f, path, **kw):
    del f[path]
    return f.create_dataset(path, **kw)


def set_attr(f, name, value):  # a new attribute of value's own type (attrs.modify keeps the old type)
    del f.attrs[name]
    f.attrs[name] = value


def set_token(field, index, value, dtype=np.int32):
    def edit(f):
        x = f[f"tokens/{field}"][:].astype(dtype)
        x[index] = value
        replace(f, f"tokens/{field}", data=x)
    return edit


# --- sizes declared by the file -------------------------------------------------------------------
# 2^31 tokens declared, nothing stored.
case("tokens_2e31", lambda f: replace(f, "tokens/modality", shape=(2**31,), dtype=np.uint8),
     "more than the limit of 16777216")
# T within the limit but the layers disagree / the data is not there.
case("tokens_unstored", lambda f: replace(f, "tokens/modality", shape=(1 << 24,), dtype=np.uint8),
     "tokens but /tokens/modality has T = 16777216")
kern = None
with h5py.File(good, "r") as f:
    kern = f["profile/kernels"].dtype
case("profile_5e7_rows", lambda f: replace(f, "profile/kernels", shape=(50_000_000,), dtype=kern),
     "50000000 rows, more than the limit of 4194304")
case("profile_unstored", lambda f: replace(f, "profile/kernels", shape=(3_000_000,), dtype=kern),
     "the data is not in the file", info=False)
case("attn_window_1e6", lambda f: f.create_dataset("layers/000/attn_window", shape=(Hq, 10**6, T), dtype=np.float32),
     "window W = 1000000 must be between 1 and T = 26")
case("heads_1e5", lambda f: set_attr(f, "num_q_heads", 100_000), "100000 is more than the limit of 1024")
case("layers_2000", lambda f: set_attr(f, "num_layers", 2000), "2000 is more than the limit of 1024")
case("head_dim_1e5", lambda f: set_attr(f, "head_dim", 100_000), "100000 is more than the limit of 4096")
case("decode_2e21", lambda f: replace(f, "decode/tokens/token_id", shape=(1 << 21,), dtype=np.int32),
     "more than the limit of 1048576")
def corrupt_string_length(path, index, new_length):
    with h5py.File(path, "r") as f:
        off = f["tokens/text"].id.get_offset()
    with open(path, "r+b") as fp:
        fp.seek(off + 16 * index)
        fp.write(int(new_length).to_bytes(4, "little"))


for name, length, expect in (("text_length_4e9", 0xF0000005, "corrupt string length"),
                             ("text_length_plus5", None, "corrupt string length")):
    path = out / f"{name}.h5"
    shutil.copy(good, path)
    with h5py.File(path, "r") as f:
        first = len(f["tokens/text"][0])
    corrupt_string_length(path, 0, length if length is not None else first + 5)
    expect_bad(name, path, expect)

# The same in the /profile/ranges table (compound rows; the name is the first member).
for name, delta, expect in (("range_name_length_4e9", None, "row 1: stored string length 4026531845 bytes"),
                            ("range_name_length_plus5", 5, "row 1: stored length")):
    path = out / f"{name}.h5"
    shutil.copy(good, path)
    with h5py.File(path, "r") as f:
        ds = f["profile/ranges"]
        off, row = ds.id.get_offset(), ds.id.get_storage_size() // ds.shape[0]
        first = len(ds[1]["name"])
    with open(path, "r+b") as fp:
        fp.seek(off + row * 1)
        fp.write(int(0xF0000005 if delta is None else first + delta).to_bytes(4, "little"))
    expect_bad(name, path, expect, info=False)

# --- datatypes ------------------------------------------------------------------------------------
def custom_f16(ebias=None, order=None):
    t = h5py.h5t.IEEE_F16LE.copy() if hasattr(h5py.h5t, "IEEE_F16LE") else h5py.h5t.py_create(np.dtype("<f2"))
    t = t.copy()
    if ebias is not None:
        t.set_ebias(ebias)
    if order is not None:
        t.set_order(order)
    return t


def replace_typed(f, path, tid, shape, data):
    del f[path]
    space = h5py.h5s.create_simple(shape)
    dsid = h5py.h5d.create(f.id, path.encode(), tid, space)
    dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data), mtype=tid)


def f16_bias_133(f):
    x = f["layers/000/k"][:]
    replace_typed(f, "layers/000/k", custom_f16(ebias=133), x.shape, x.view(np.uint16))


case("f16_ebias_133", f16_bias_133, "exponent bias 133, expected 15")
case("f16_big_endian", lambda f: replace(f, "layers/000/k", data=f["layers/000/k"][:].astype(">f2")),
     "big-endian float16 not allowed")

bf16 = out / "good_bf16.h5"
subprocess.run([kvcap, "synth", "--preset", "tiny", "--dtype", "bfloat16", "-q", "-o", str(bf16)], check=True)
path = out / "bf16_big_endian.h5"
shutil.copy(bf16, path)
with h5py.File(path, "r+") as f:
    x = f["layers/000/k"][:]
    replace(f, "layers/000/k", data=x.astype(">u2")).attrs["dtype"] = "bfloat16"
expect_bad("bf16_big_endian", path, "bfloat16 must be stored as 16-bit little-endian unsigned integers")

# --- values ---------------------------------------------------------------------------------------
for dt in ("int8", "int16", "int64"):
    case(f"modality_{dt}_neg", set_token("modality", 3, -1, dt), "bad modality code -1 at token 3")
case("modality_uint16_300", set_token("modality", 3, 300, np.uint16), "bad modality code 300 at token 3")
case("modality_uint64_huge", set_token("modality", 3, 2**64 - 1, np.uint64), "out of range")
for name, v in (("complete_neg", np.int64(-1)), ("complete_1e6", np.int64(10**6)), ("complete_nan", math.nan), ("complete_inf", math.inf)):
    case(name, lambda f, v=v: set_attr(f, "complete", v), "@complete: must be 0 or 1")
case("synthetic_2", lambda f: set_attr(f, "synthetic", 2), "@synthetic: must be 0 or 1")
case("num_q_heads_4_5", lambda f: set_attr(f, "num_q_heads", 4.5), "@num_q_heads: must be an integer, got 4.5")
for name, v in (("rope_inf", math.inf), ("rope_nan", math.nan), ("rope_zero", 0.0), ("rope_neg", -1.0)):
    case(name, lambda f, v=v: set_attr(f, "rope_theta", v), "@rope_theta: must be a finite number > 0")
for name, v in (("version_space", " 1.0"), ("version_suffix", "1.0abc"), ("version_three", "1.0.0"),
                ("version_sign", "+1.0"), ("version_empty_minor", "1.")):
    case(name, lambda f, v=v: set_attr(f, "version", v), "is not MAJOR.MINOR")
case("grid_on_text", set_token("grid", (TXT[0], 0), 0), f"token {TXT[0]} is not a vision token but has grid cell")
case("grid_missing_on_vision", set_token("grid", VIS[2], -1), f"vision token {VIS[2]} has grid cell (-1, -1)")
case("grid_duplicate", set_token("grid", VIS[1], [0, 0]), "duplicate grid cell (0, 0)")


def split_image(f):
    seg = f["tokens/segment"][:]
    seg[VIS[8]:VIS[-1] + 1] = 77
    replace(f, "tokens/segment", data=seg)


case("image_split_segments", split_image, "has no cell (0, 0): one image split over two segments")


def image_two_runs(f):  # one segment's vision tokens interrupted by a text token
    m = f["tokens/modality"][:]
    g = f["tokens/grid"][:]
    m[VIS[5]] = 0
    g[VIS[5]] = -1
    replace(f, "tokens/modality", data=m)
    replace(f, "tokens/grid", data=g)


case("image_two_runs", image_two_runs, "are not one contiguous run")
case("position_int64_2e40", set_token("position", 4, 2**40, np.int64), "value 1099511627776 at index 4 does not fit in int32")
case("token_id_uint32_big", set_token("token_id", 4, 2**32 - 1, np.uint32), "does not fit in int32")
case("zero_tokens", lambda f: [replace(f, f"tokens/{n}", shape=(0,) if n != "grid" else (0, 2),
                                       dtype=np.uint8 if n == "modality" else np.int32)
                               for n in ("modality", "position", "token_id", "segment", "grid")],
     "T = 0: a trace needs at least one context token")
colsum = lambda v, dt=np.float32: (lambda f: f.create_dataset("layers/001/attn_colsum", data=np.full((Hq, T), v, dt)))
case("colsum_float64", colsum(0.5, np.float64), "/layers/001/attn_colsum: must be float32", info=False)
case("colsum_nan", colsum(math.nan), "/layers/001/attn_colsum: value nan", info=False)
case("colsum_negative", colsum(-1.0), "/layers/001/attn_colsum: value -1", info=False)
case("colsum_shape", lambda f: f.create_dataset("layers/001/attn_colsum", data=np.zeros((Hq, T + 1), np.float32)),
     "expected [num_q_heads, T]")
case("window_above_one", lambda f: f.create_dataset("layers/000/attn_window", data=np.full((Hq, 2, T), 2.0, np.float32)),
     "/layers/000/attn_window: value 2", info=False)


def profile_not_group(f):
    del f["profile"]
    f["profile"] = np.zeros(3)


case("profile_not_a_group", profile_not_group, "/profile", info=False)

# A string attribute over 1 MiB (dense attribute storage needs the newest file format).
path = out / "attr_string_2mib.h5"
shutil.copy(good, path)
with h5py.File(path, "r+", libver="latest") as f:
    set_attr(f, "creator", "x" * (2 << 20))
expect_bad("attr_string_2mib", path, "/@creator: string of 2097152 bytes, more than the limit of 1048576")

# --- valid files the spec allows ------------------------------------------------------------------
fixed = out / "fixed_utf8.h5"
shutil.copy(good, fixed)
with h5py.File(fixed, "r+") as f:
    for name in ("format", "version", "model_name", "creator"):
        v = f.attrs[name]
        f.attrs.create(name, v.encode(), dtype=h5py.string_dtype("utf-8", len(v.encode())))
    text = [s.decode() if isinstance(s, bytes) else s for s in f["tokens/text"][:]]
    width = max(1, max(len(s.encode()) for s in text))
    del f["tokens/text"]
    ds = f.create_dataset("tokens/text", shape=(len(text),), dtype=h5py.string_dtype("utf-8", width))
    # Written with the file's own type: h5py has no conversion from numpy bytes to fixed UTF-8.
    ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array([s.encode() for s in text], dtype=f"S{width}"),
                mtype=ds.id.get_type())
    f["layers/000/k"].attrs.create("note", "é".encode(), dtype=h5py.string_dtype("utf-8", 2))
expect_good("fixed_utf8_strings", fixed)
r = run([kvsim, "info", str(fixed)])
if r is None or r.returncode != 0:
    failures.append(f"kvsim info fixed_utf8: {r and r.stderr.strip()}")
    print("FAIL", failures[-1])
# Fixed-length ASCII attributes (numpy bytes) and a float attribute that holds an integer.
ascii_ = out / "fixed_ascii.h5"
shutil.copy(good, ascii_)
with h5py.File(ascii_, "r+") as f:
    f.attrs["format"] = np.bytes_(b"kvscope-trace")
    f.attrs["num_layers"] = 4.0
    f.create_dataset("layers/002/attn_colsum", data=np.full((Hq, T), 0.5, np.float32))
    f.create_dataset("layers/002/attn_window", data=np.full((Hq, 3, T), 0.25, np.float32))
expect_good("fixed_ascii_and_integral_float", ascii_)
# An image whose last row is partial (17 patches as 4 x 5 with 3 cells missing) is valid.
partial = out / "partial_row.h5"
subprocess.run([kvcap, "synth", "--preset", "tiny", "--image-tokens", "17", "-q", "-o", str(partial)], check=True)
expect_good("image_with_partial_last_row", partial)
# Zero decode steps: valid, but not replayable; kvsim says so up front in one line.
nodec = out / "no_decode.h5"
shutil.copy(good, nodec)
with h5py.File(nodec, "r+") as f:
    for n in ("token_id", "position", "text"):
        if f"decode/tokens/{n}" in f:
            replace(f, f"decode/tokens/{n}", data=np.zeros(0, np.int32) if n != "text" else np.array([], dtype=h5py.string_dtype()))
    for l in range(int(f.attrs["num_layers"])):
        for t in ("q", "k", "v"):
            x = f[f"decode/layers/{l:03d}/{t}"]
            replace(f, f"decode/layers/{l:03d}/{t}", shape=(x.shape[0], 0, x.shape[2]), dtype=x.dtype)
expect_good("zero_decode_steps", nodec, "not replayable")
for sub in (["run", "--policy", "full"], ["sweep", "--policies", "full"]):
    r = run([kvsim, sub[0], "-t", str(nodec)] + sub[1:] + ["-q"])
    lines = r.lines if r else []
    if r is None or not 1 <= r.returncode <= 127 or len(lines) != 1 or "no decode steps" not in lines[0]:
        failures.append(f"kvsim {sub[0]} on S = 0: exit {r and r.returncode}: {r and r.stderr.strip()[-300:]}")
        print("FAIL", failures[-1])
    else:
        print(f"ok   kvsim {sub[0]} no_decode: {lines[0]}")

# kvsim run refuses what the validator refuses, with the same one line (the cross-tool cases).
for name in ("zero_tokens", "heads_1e5", "attn_window_1e6"):
    path = out / f"{name}.h5"
    r = run([kvsim, "run", "-t", str(path), "--policy", "full", "-q"])
    if r is None or not 1 <= r.returncode <= 127 or len(r.lines) != 1 or str(path) not in r.lines[0]:
        failures.append(f"kvsim run {name}: exit {r and r.returncode}: {r and r.stderr.strip()[-300:]}")
        print("FAIL", failures[-1])
    else:
        print(f"ok   kvsim run {name}: {r.lines[0]}")

print("limits_h5py: %d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
