#!/usr/bin/env python3
"""Runs the h5py worked example of docs/trace-format.md verbatim and checks that
kvcap validate and kvsim info accept the file it writes (the docs follow the code)."""
import os
import re
import subprocess
import sys

doc, kvcap, kvsim, workdir = (os.path.abspath(a) for a in sys.argv[1:5])
os.makedirs(workdir, exist_ok=True)
os.chdir(workdir)
blocks = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
assert blocks, "no python example in " + doc
exec(compile(blocks[0], doc, "exec"), {})
r = subprocess.run([kvcap, "validate", "-q", "example.h5"], capture_output=True, text=True)
print(r.stdout, r.stderr)
if r.returncode != 0:
    sys.exit("kvcap validate rejected the documented example")
r = subprocess.run([kvsim, "info", "example.h5"], capture_output=True, text=True)
if r.returncode != 0 or not re.search(r"^\s*vision\s+12\s", r.stdout, re.M):
    sys.exit("kvsim info failed on the documented example: " + r.stderr)
print("documented example ok")
