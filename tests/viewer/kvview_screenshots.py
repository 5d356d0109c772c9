#!/usr/bin/python3
"""kvview headless screenshots under Xvfb (Mesa llvmpipe).

Usage: kvview_screenshots.py KVVIEW KVSIM TRACE WORKDIR

Renders every view of TRACE plus a results file made here by `kvsim sweep`, decodes each PNG
(pure Python: zlib + PNG row filters, no PIL) and checks that it is not blank, that the views
differ from each other, that two policies give different token maps and budgets, that the same
command renders the same pixels twice, and that bad files and arguments exit 2 with one clear
stderr line. Re-runs itself under one `xvfb-run -a`; exits 77 (ctest SKIP_RETURN_CODE) when xvfb-run
is missing.
"""
import os
import shutil
import struct
import subprocess
import sys
import zlib

VIEWS = ["overview", "tokens", "budgets", "attention", "quality", "collapse", "timeline", "whatif"]
SIZE = (960, 600)


def decode_png(path):
    """Returns (width, height, rows) of an 8-bit RGB/RGBA PNG; rows are bytes without filter bytes."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), f"{path}: unexpected depth {depth} / colour type {color}"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            else:
                assert ftype == 0, f"{path}: bad filter {ftype}"
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def variance(rows):
    n = s = s2 = 0
    for r in rows:
        n += len(r)
        s += sum(r)
        s2 += sum(v * v for v in r)
    mean = s / n
    return s2 / n - mean * mean


FAILURES = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg)
    if not cond:
        FAILURES.append(msg)


def kvview(args, env):
    return subprocess.run([KVVIEW] + args, capture_output=True, text=True, env=env, timeout=300)


def shot(name, extra, env):
    png = os.path.join(WORK, name + ".png")
    size = f"{SIZE[0]}x{SIZE[1]}"
    r = kvview([TRACE, "--results", RESULTS, "--screenshot", png, "--size", size] + extra, env)
    check(r.returncode == 0, f"{name}: exit 0 (got {r.returncode}; stderr: {r.stderr.strip()})")
    check(r.stdout.startswith("screenshot: " + png), f"{name}: prints the screenshot line")
    w, h, rows = decode_png(png)
    check((w, h) == SIZE, f"{name}: {w}x{h} is the requested size")
    v = variance(rows)
    check(v > 100, f"{name}: not blank (pixel variance {v:.1f})")
    return rows


def rerun_under_xvfb():
    """Re-runs this script under one `xvfb-run -a` (one X server for the whole test, on a free display);
    exits 77 (ctest's skip) when xvfb-run is missing. Returns once running under it."""
    if os.environ.get("KVSCOPE_UNDER_XVFB"):
        return
    if not shutil.which("xvfb-run"):
        print("SKIP: xvfb-run not found (install xvfb to run the kvview screenshot tests)")
        sys.exit(77)
    os.environ["KVSCOPE_UNDER_XVFB"] = "1"
    os.execvp("xvfb-run", ["xvfb-run", "-a", "-s", "-screen 0 1600x1200x24", sys.executable] + sys.argv)


if __name__ == "__main__":
    KVVIEW, KVSIM, TRACE, WORK = sys.argv[1:5]
    rerun_under_xvfb()
    os.makedirs(WORK, exist_ok=True)
    env = dict(os.environ)
    RESULTS = os.path.join(WORK, "results.h5")
    subprocess.run([KVSIM, "sweep", "--trace", TRACE, "--policies", "h2o,random,unicache,int8",
                    "--budgets", "0.2,0.5", "-o", RESULTS, "-q", "--threads", "2"],
                   check=True, capture_output=True, env=env)

    images = {}
    for view in VIEWS:
        images[view] = shot(view, ["--view", view, "--point", "h2o@0.2"], env)
    distinct = {tuple(rows) for rows in images.values()}
    check(len(distinct) == len(VIEWS), f"the {len(VIEWS)} views render {len(distinct)} distinct images")

    again = shot("tokens-again", ["--view", "tokens", "--point", "h2o@0.2"], env)
    check(again == images["tokens"], "the same command renders the same pixels")
    for view in ["tokens", "budgets"]:
        other = shot(view + "-random", ["--view", view, "--point", "random@0.2"], env)
        check(other != images[view], f"{view}: random@0.2 differs from h2o@0.2")
    layer0 = shot("tokens-layer0", ["--view", "tokens", "--point", "h2o@0.2", "--layer", "0"], env)
    check(layer0 != images["tokens"], "tokens: layer 0 differs from the default layer")

    # A dataset sweep's file (results 1.4): the quality curves draw each point's bootstrap interval, so
    # the same points with and without the intervals render differently.
    shipped = os.path.join(os.path.dirname(os.path.abspath(TRACE)), "tiny-shapes-*.h5")
    DATASET = os.path.join(WORK, "dataset.h5")
    subprocess.run([KVSIM, "sweep", "--dataset", shipped, "--policies", "h2o,snapkv", "--budgets", "0.2,0.5",
                    "-o", DATASET, "-q", "--threads", "2"], check=True, capture_output=True, env=env)
    png = os.path.join(WORK, "dataset-quality.png")
    r = kvview(["--results", DATASET, "--view", "quality", "--screenshot", png, "--size", f"{SIZE[0]}x{SIZE[1]}"], env)
    check(r.returncode == 0, f"dataset results: exit 0 (got {r.returncode}; stderr: {r.stderr.strip()})")
    with_bars = decode_png(png)[2]
    check(variance(with_bars) > 100, "dataset results: the quality view is not blank")
    import h5py
    plain = os.path.join(WORK, "dataset-plain.h5")
    shutil.copy(DATASET, plain)
    with h5py.File(plain, "a") as f:
        del f["aggregate"]
    png2 = os.path.join(WORK, "dataset-plain.png")
    r = kvview(["--results", plain, "--view", "quality", "--screenshot", png2, "--size", f"{SIZE[0]}x{SIZE[1]}"], env)
    check(r.returncode == 0 and decode_png(png2)[2] != with_bars,
          "dataset results: the intervals change the quality view's pixels")

    # Bad inputs: a message naming the file on stderr, exit 2, and the error drawn in the window.
    bad = os.path.join(WORK, "not-a-trace.h5")
    with open(bad, "w") as f:
        f.write("garbage\n")
    png = os.path.join(WORK, "bad.png")
    r = kvview([bad, "--screenshot", png, "--size", f"{SIZE[0]}x{SIZE[1]}"], env)
    check(r.returncode == 2, f"bad trace: exit 2 (got {r.returncode})")
    check(bad in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"bad trace: one stderr line naming it: {r.stderr!r}")
    rows = decode_png(png)[2]
    check(variance(rows) > 1 and tuple(rows) not in distinct, "bad trace: the window shows the error")
    r = kvview([TRACE, "--results", TRACE, "--screenshot", png], env)
    check(r.returncode == 2 and "/@format" in r.stderr,
          f"trace given as results: exit 2 naming /@format: {r.stderr!r}")
    r = kvview([TRACE, "--results", RESULTS, "--point", "nope@0.1", "--screenshot", png], env)
    check(r.returncode == 2 and "nope@0.1" in r.stderr, f"unknown --point: exit 2: {r.stderr!r}")
    r = subprocess.run([KVVIEW, "--view", "nope"], capture_output=True, text=True)
    check(r.returncode == 2 and "overview" in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"unknown --view: one line listing the views, exit 2: {r.stderr!r}")
    r = subprocess.run([KVVIEW, "--size", "12"], capture_output=True, text=True)
    check(r.returncode == 2 and "--size" in r.stderr, f"bad --size: exit 2: {r.stderr!r}")
    r = subprocess.run([KVVIEW, "--help"], capture_output=True, text=True)
    check(r.returncode == 0 and all(v in r.stdout for v in VIEWS) and "--screenshot" in r.stdout,
          "--help lists the views and options")
    sys.exit(1 if FAILURES else 0)
