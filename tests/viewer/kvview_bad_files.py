#!/usr/bin/python3
"""kvview --screenshot on files that cannot be read, under Xvfb (docs/viewer.md, docs/robustness.md).

Usage: kvview_bad_files.py KVVIEW KVSIM TRACE CORRUPT_HEAP_PY WORKDIR

Every case must exit non-zero with exactly one line on stderr (never HDF5's own error stack):
- the layer the view needs cannot be read: a NaN in its q, or its k stored in a missing external
  file (exit 2, the message names the file and the dataset);
- a named pipe as the trace or as the results file (exit 2 at once);
- byte corruptions that crash libhdf5 (SIGSEGV) reading the trace's /tokens/text or the results'
  /@format (exit 2, "the HDF5 library crashed"), or make it loop (exit 2 after the 10 s limit);
- --timeout: with --trusted-files the hanging file hangs the loader itself; the process still
  ends at the deadline (exit 1, one line).
Re-runs itself under `xvfb-run -a`; exits 77 (ctest SKIP_RETURN_CODE) when xvfb-run is missing.
"""
import os
import shutil
import subprocess
import sys
import time

FAILURES = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        FAILURES.append(msg)


def kvview(args, timeout=60):
    t0 = time.monotonic()
    try:
        r = subprocess.run([KVVIEW] + args, capture_output=True, text=True, timeout=timeout, cwd=WORK)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - t0
    return r.returncode, r.stderr, time.monotonic() - t0


def bad(name, args, want_rc, expect, limit_s):
    png = os.path.join(WORK, name + ".png")
    rc, err, took = kvview(args + ["--screenshot", png, "--size", "640x400"])
    lines = [l for l in err.splitlines() if l.strip()]
    check(rc == want_rc, f"{name}: exit {want_rc} (got {rc}, {took:.1f} s)")
    check(len(lines) == 1, f"{name}: one stderr line (got {len(lines)}: {err.strip()[:300]!r})")
    check(all(e in err for e in expect), f"{name}: says {expect}: {err.strip()[:300]!r}")
    check(took < limit_s, f"{name}: took {took:.1f} s < {limit_s} s")


if __name__ == "__main__":
    KVVIEW, KVSIM, TRACE, CORRUPT, WORK = sys.argv[1:6]
    if not os.environ.get("KVSCOPE_UNDER_XVFB"):
        if not shutil.which("xvfb-run"):
            print("SKIP: xvfb-run not found (install xvfb to run the kvview tests)")
            sys.exit(77)
        os.environ["KVSCOPE_UNDER_XVFB"] = "1"
        os.execvp("xvfb-run", ["xvfb-run", "-a", "-s", "-screen 0 1600x1200x24", sys.executable] + sys.argv)
    import h5py
    import numpy as np

    sys.path.insert(0, os.path.dirname(CORRUPT))
    import corrupt_heap

    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    os.chdir(WORK)  # HDF5 resolves external file names against the working directory
    with h5py.File(TRACE, "r") as f:
        mid = "%03d" % (int(f.attrs["num_layers"]) // 2)  # the layer the tokens view shows first

    nan = os.path.join(WORK, "nan.h5")
    shutil.copy(TRACE, nan)
    with h5py.File(nan, "r+") as f:
        d = f[f"layers/{mid}/q"]
        a = d[...]
        a[0, 0, 0] = np.nan
        d[...] = a
    bad("nan-layer", [nan, "--view", "tokens"], 2, [nan, f"/layers/{mid}/q", "NaN at [0, 0, 0]"], 60)

    ext = os.path.join(WORK, "external.h5")
    shutil.copy(TRACE, ext)
    with h5py.File(ext, "r+") as f:
        p = f"layers/{mid}/k"
        a = f[p][...]
        del f[p]
        f.create_dataset(p, data=a, external=[("external-k.bin", 0, a.nbytes)])
    os.remove(os.path.join(WORK, "external-k.bin"))
    bad("missing-external-file", [ext, "--view", "tokens"], 2, [ext, f"/layers/{mid}/k", "external"], 60)

    results = os.path.join(WORK, "results.h5")
    subprocess.run([KVSIM, "sweep", "--trace", TRACE, "--policies", "h2o", "--budgets", "0.5", "-q",
                    "--threads", "1", "--alloc-search", "none", "-o", results], check=True, capture_output=True)
    fifo = os.path.join(WORK, "pipe.h5")
    os.mkfifo(fifo)
    bad("fifo-trace", [fifo], 2, [fifo, "named pipe"], 10)
    bad("fifo-results", [TRACE, "--results", fifo], 2, [fifo, "named pipe"], 10)

    files = corrupt_heap.write_corruptions(TRACE, WORK)
    crash = files["heap-crash.h5"]
    bad("heap-crash-trace", [crash], 2,
        [crash, "/tokens/text: the HDF5 library crashed reading this object (signal 11)"], 20)
    rcrash = corrupt_heap.first_object_crash(results, os.path.join(WORK, "results-crash.h5"))
    bad("heap-crash-results", [TRACE, "--results", rcrash], 2,
        [rcrash, "/@format: the HDF5 library crashed reading this object (signal 11)"], 20)
    hang = files["heap-hang.h5"]
    bad("heap-hang-trace", [hang], 2, [hang, "did not finish within 10 s"], 20)
    # --timeout ends the process even when the loader itself hangs inside libhdf5.
    bad("timeout", [hang, "--trusted-files", "--timeout", "3"], 1, ["still loading", "after 3 s"], 10)
    # The good pair still renders.
    rc, err, _ = kvview([TRACE, "--results", results, "--view", "tokens", "--screenshot",
                         os.path.join(WORK, "good.png"), "--size", "640x400"])
    check(rc == 0 and not err.strip(), f"good files: exit 0, nothing on stderr (rc {rc}: {err.strip()!r})")
    r = subprocess.run([KVVIEW, "--help"], capture_output=True, text=True)
    check("--trusted-files" in r.stdout and "--timeout" in r.stdout, "--help documents --trusted-files")
    os.chdir("/")
    shutil.rmtree(WORK, ignore_errors=True)
    sys.exit(1 if FAILURES else 0)
