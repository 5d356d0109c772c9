#!/usr/bin/python3
"""Untrusted input files through kvcap and kvsim (docs/robustness.md, the isolated pre-check).

Usage: untrusted_files.py KVCAP KVSIM TRACE WORKDIR

- A named pipe given as the trace is refused at once (exit 2, one line) by every command.
- Real byte-level corruptions of TRACE that crash libhdf5 (SIGSEGV reading /tokens/text) or make
  it loop forever (corrupt global heap header) give exit 2 and one line naming the file and the
  object, within 20 s, from kvcap validate, kvcap export-chrome, kvsim info, run, sweep and plan.
- With the trusted-file switch (--trusted-files or KVSCOPE_TRUSTED_FILES=1) the same crash file
  kills the tool with a signal: what the pre-check protects against is real.
"""
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corrupt_heap  # noqa: E402

FAILURES = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        FAILURES.append(msg)


def run(cmd, env=None, timeout=60):
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - t0
    return r.returncode, r.stderr, time.monotonic() - t0


def one_line_exit_2(name, cmd, path, expect, limit_s):
    rc, err, took = run(cmd)
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("kvcap validate [")]
    check(rc == 2, f"{name}: exit 2 (got {rc}, {took:.1f} s)")
    check(len(lines) == 1, f"{name}: one stderr line (got {len(lines)}: {err.strip()[:300]!r})")
    check(path in err and expect in err, f"{name}: names {path} and says {expect!r}: {err.strip()!r}")
    check(took < limit_s, f"{name}: took {took:.1f} s < {limit_s} s")


def commands(kvcap, kvsim, path, work):
    return {
        "kvcap validate": [kvcap, "validate", "-q", path],
        "kvcap export-chrome": [kvcap, "export-chrome", path, "-o", os.path.join(work, "out.json")],
        "kvsim info": [kvsim, "info", path],
        "kvsim run": [kvsim, "run", "--trace", path, "--policy", "full", "-q", "--threads", "1"],
        "kvsim sweep": [kvsim, "sweep", "--trace", path, "--policies", "h2o", "--budgets", "0.5", "-q",
                        "--threads", "1", "--alloc-search", "none"],
        "kvsim plan": [kvsim, "plan", "--trace", path, "--gpu-mem", "24GiB", "--params", "1e9"],
    }


if __name__ == "__main__":
    kvcap, kvsim, trace, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    fifo = os.path.join(work, "pipe.h5")
    os.mkfifo(fifo)
    for name, cmd in commands(kvcap, kvsim, fifo, work).items():
        one_line_exit_2(f"FIFO {name}", cmd, fifo, "named pipe", 5)

    files = corrupt_heap.write_corruptions(trace, work)
    crash, hang = files["heap-crash.h5"], files["heap-hang.h5"]
    msg = "/tokens/text: the HDF5 library crashed reading this object (signal 11): the file is corrupt"
    for name, cmd in commands(kvcap, kvsim, crash, work).items():
        one_line_exit_2(f"heap crash {name}", cmd, crash, msg, 20)
    hang_msg = "reading this object did not finish within 10 s: the file is corrupt"
    for name in ["kvcap validate", "kvsim info", "kvsim run"]:
        one_line_exit_2(f"heap hang {name}", commands(kvcap, kvsim, hang, work)[name], hang, hang_msg, 20)

    # The trusted-file switch skips the child: the same file then crashes the tool itself.
    env = dict(os.environ, KVSCOPE_TRUSTED_FILES="1")
    rc, err, _ = run([kvsim, "info", crash], env=env)
    check(rc is not None and rc < 0, f"KVSCOPE_TRUSTED_FILES=1 kvsim info: killed by a signal (rc {rc})")
    rc, err, _ = run([kvcap, "validate", "-q", "--trusted-files", crash])
    check(rc is not None and rc < 0, f"kvcap validate --trusted-files: killed by a signal (rc {rc})")
    rc, err, _ = run([kvsim, "info", "--trusted-files", fifo], timeout=10)
    check(rc == 2 and "named pipe" in err, f"--trusted-files still refuses a FIFO: {err.strip()!r}")

    # Good traces pass, trusted or not; --help documents the switch.
    for extra in ([], ["--trusted-files"]):
        rc, err, _ = run([kvsim, "info", trace] + extra)
        check(rc == 0, f"kvsim info {' '.join(extra)} on the shipped trace: exit 0 ({err.strip()!r})")
        rc, err, _ = run([kvcap, "validate", "-q", trace] + extra)
        check(rc == 0, f"kvcap validate {' '.join(extra)} on the shipped trace: exit 0 ({err.strip()!r})")
    for cmd in (["kvcap", "validate"], ["kvcap", "export-chrome"], ["kvsim", "info"], ["kvsim", "run"],
                ["kvsim", "sweep"], ["kvsim", "plan"]):
        tool = kvcap if cmd[0] == "kvcap" else kvsim
        r = subprocess.run([tool, cmd[1], "--help"], capture_output=True, text=True)
        check("--trusted-files" in r.stdout, f"{' '.join(cmd)} --help documents --trusted-files")
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if FAILURES else 0)
