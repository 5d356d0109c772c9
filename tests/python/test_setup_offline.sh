#!/usr/bin/env bash
# scripts/setup without PyPI (an index nobody listens on) and a fresh cache: it warns, says how to fetch
# the model, exits 0 (everything else still builds and tests), and scripts/py then reports itself
# skipped (77) with one line naming the missing environment.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
log=$cache/setup.log
KVSCOPE_CACHE=$cache PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_RETRIES=0 PIP_TIMEOUT=2 \
  "$root/scripts/setup" >"$log" 2>&1
rc=$?
fail() { echo "FAIL: $*"; cat "$log"; exit 1; }
[[ $rc -eq 0 ]] || fail "scripts/setup exited $rc without PyPI"
grep -q "warning: could not install requirements.lock from PyPI" "$log" || fail "no warning about PyPI"
[[ ! -e $cache/venv-*/.kvscope-complete ]] || fail "a half-installed environment is marked complete"
[[ ! -d $cache/models/smollm2-135m-instruct ]] || fail "a model folder appeared without PyPI"
out=$(KVSCOPE_CACHE=$cache "$root/scripts/py" -c 'print(1)' 2>&1)
rc=$?
[[ $rc -eq 77 ]] || fail "scripts/py exited $rc, expected 77"
[[ $out == *"Python environment"*"is missing or incomplete (run scripts/setup"* ]] || fail "scripts/py said: $out"
echo "ok: setup without PyPI warns and exits 0; scripts/py skips with: $out"
