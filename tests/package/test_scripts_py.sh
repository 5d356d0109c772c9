#!/usr/bin/env bash
# scripts/py as a user runs it from a fresh shell (no PYTHONPATH; docs/python.md "Installing"):
#  1. with the build folder's extension: `import kvscope`, then a sweep of a shipped trace into a DataFrame
#     through kvscope.sim (imported on first use);
#  2. with a build folder that has no extension (a fresh clone before scripts/build): `import kvscope` still
#     works, and `kvscope.sim` raises ImportError whose one line names the folder and says to run
#     scripts/build.
# Usage: test_scripts_py.sh REPO BUILD_DIR. Exits 77 (skipped) when scripts/setup has not made the environment.
set -euo pipefail
repo=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"  # scripts/py works from anywhere
py() { env -u PYTHONPATH -u KVSCOPE_CORE_MISSING "$@"; }

set +e
py KVSCOPE_BUILD_DIR="$build" "$repo/scripts/py" -c '
import sys
import kvscope
df = kvscope.sim.sweep(sys.argv[1], ["h2o", "snapkv"], [0.2, 0.5], bound=False, alloc_search=None).df
assert set(df["policy"]) == {"h2o", "snapkv"}, set(df["policy"])
assert list(df.columns[:4]) == ["policy", "budget", "layer", "modality"], list(df.columns)
assert kvscope._core.__file__.startswith(sys.argv[2]), (kvscope._core.__file__, sys.argv[2])
print(f"scripts/py: import kvscope; kvscope.sim.sweep -> DataFrame {df.shape}, extension {kvscope._core.__file__}")
' "$repo/traces/tiny-synth.h5" "$build/python" >"$tmp/out" 2>&1
rc=$?
set -e
cat "$tmp/out"
if ((rc == 77)); then exit 77; fi
((rc == 0)) || { echo "FAILED: the sweep through scripts/py exited $rc"; exit 1; }

# A pip-installed kvscope in the environment would be imported instead of the missing build's extension.
if py "$repo/scripts/py" -c 'import importlib.metadata as m; m.version("kvscope")' >/dev/null 2>&1; then
  echo "SKIPPED: the environment has kvscope pip-installed, so the missing-extension message cannot be checked"
  exit 77
fi
mkdir -p "$tmp/empty-build"
py KVSCOPE_BUILD_DIR="$tmp/empty-build" "$repo/scripts/py" -c 'import kvscope; print("import kvscope OK")' ||
  { echo "FAILED: import kvscope needs the extension"; exit 1; }
set +e
py KVSCOPE_BUILD_DIR="$tmp/empty-build" "$repo/scripts/py" -c 'import kvscope; kvscope.sim' 2>"$tmp/err"
rc=$?
set -e
last=$(tail -n 1 "$tmp/err")
echo "without the extension: exit $rc, last line: $last"
expected="ImportError: kvscope's extension kvscope._core is not built in $tmp/empty-build/python: run scripts/build"
((rc == 1)) || { echo "FAILED: expected exit 1"; cat "$tmp/err"; exit 1; }
[[ $last == "$expected"* ]] || { echo "FAILED: expected the line to start with: $expected"; exit 1; }
echo "OK"
