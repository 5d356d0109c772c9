#!/usr/bin/env bash
# `pip install .` from the repository into a fresh venv (python3 -m venv --system-site-packages: numpy and
# pandas from Debian), then a sweep of a shipped trace into a DataFrame from outside the repository, and the
# installed type stub (_core.pyi, py.typed) checked against the installed extension (test_stubs.py).
# Usage: test_pip_install.sh REPO [PYTHON]. Exits 77 (skipped) when PyPI cannot be reached: pip's isolated
# build needs scikit-build-core and pybind11 from it.
set -euo pipefail
repo=$1
python=${2:-/usr/bin/python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv --system-site-packages "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
if ! "${pip[@]}" download -q --no-deps -d "$tmp/probe" scikit-build-core >/dev/null 2>&1; then
  echo "SKIPPED: PyPI cannot be reached (pip install . needs scikit-build-core and pybind11 from it)"
  exit 77
fi
# The build folder stays in the clone (build/pip-*, ignored by git) so that a second install is incremental.
"${pip[@]}" install -q "$repo" 2>&1 | tail -20
cd "$tmp"
"$tmp/venv/bin/python" - "$repo/traces/tiny-shapes-fine.h5" <<'PY'
import sys
import kvscope, kvscope.sim as ks
assert "site-packages" in kvscope._core.__file__, kvscope._core.__file__
df = ks.sweep(sys.argv[1], ["h2o", "snapkv", "int8"], [0.2, 0.5]).df
policies = set(df["policy"])
assert {"h2o", "snapkv", "int8"} <= policies, policies
assert list(df.columns[:6]) == ["policy", "budget", "layer", "modality", "bytes_full", "bytes_kept"], df.columns
print(f"pip install . OK: kvscope._core from {kvscope._core.__file__}; sweep -> DataFrame {df.shape}")
PY
# The type stub and py.typed are installed next to the extension, and the stub matches it.
"$tmp/venv/bin/python" "$repo/tests/package/test_stubs.py"
