#!/usr/bin/env bash
# `kvcap eval` from the command line (closed-loop evaluation, issue 6) on the random tiny-VLM fixture:
# --help, an end-to-end run whose CSV (pandas) and HDF5 (h5py) hold the documented columns with `full`
# as the reference, and bad input (unknown policy, missing heldout.json, too many samples, a stage decode
# mode does not support, malformed budget) exiting 2 with one line on stderr and no output file; the shipped
# heldout.json equals a fresh export.
# Usage: eval_cli.sh KVCAP PYTHON MODEL_DIR WORKDIR SOURCE_DIR
set -uo pipefail
kvcap=$1 python=$2 model=$3 dir=$4 src=$5
rm -rf "$dir" && mkdir -p "$dir"
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

if "$kvcap" eval --help >"$dir/help.out" 2>&1 && grep -q -- "--samples" "$dir/help.out" &&
   grep -q -- "--budgets" "$dir/help.out" && grep -q "Example" "$dir/help.out"; then ok "help"
else bad "help: $(head -3 "$dir/help.out")"; fi

# --- end to end: 6 samples, two policies x two budgets, a quantizer (once) and full (always, first).
if "$kvcap" eval --model "$model" --policies h2o,int8,streamingllm,h2o~decode --budgets 0.25,0.5 \
     --samples 6 -q \
     -o "$dir/r.h5" --csv "$dir/r.csv" >"$dir/run.out" 2>"$dir/run.err"; then ok "run"
else bad "run: $(cat "$dir/run.err")"; fi
grep -q "^full " "$dir/run.out" && ok "table lists full" || bad "table: $(cat "$dir/run.out")"
"$python" - "$dir/r.csv" "$dir/r.h5" <<'PY' && ok "csv + hdf5 contents" || bad "csv + hdf5 contents"
import sys
import h5py
import numpy as np
import pandas as pd
df = pd.read_csv(sys.argv[1], keep_default_na=False)
pts = list(zip(df.policy, df.budget.astype(str)))
assert pts == [("full", "-"), ("h2o", "0.25"), ("h2o", "0.5"), ("int8", "-"), ("streamingllm", "0.25"),
               ("streamingllm", "0.5"), ("h2o~decode", "0.25"), ("h2o~decode", "0.5")], pts
full = df[df.policy == "full"].iloc[0]
assert full.kl == 0 and full.agreement == 1 and full.bytes_ratio == 1, full
assert (df.bytes_match == 1).all()
assert (df.samples == 6).all()
h2o = df[(df.policy == "h2o")]
assert (h2o.bytes_end_vision.values < full.bytes_end_vision).all()
assert h2o.bytes_end.values[0] < h2o.bytes_end.values[1]
with h5py.File(sys.argv[2], "r") as f:
    g = f["closed_loop"]
    assert [p.decode() if isinstance(p, bytes) else p for p in g["policy"][()]] == list(df.policy)
    assert np.allclose(g["accuracy"][()], df.accuracy.values)
    assert np.allclose(g["bytes_end"][()], df.bytes_end.values)
    assert g.attrs["samples"] == 6
PY

# --- one run at a time (--max-batch 1) gives the batched run's answers and bytes, the KL up to rounding.
if "$kvcap" eval --model "$model" --policies h2o,int8,streamingllm,h2o~decode --budgets 0.25,0.5 \
     --samples 6 -q --max-batch 1 --csv "$dir/one.csv" >/dev/null 2>"$dir/one.err"; then ok "run --max-batch 1"
else bad "run --max-batch 1: $(cat "$dir/one.err")"; fi
"$python" - "$dir/r.csv" "$dir/one.csv" <<'PY' && ok "--max-batch 1 equals the batched run" || bad "--max-batch 1 differs"
import sys
import numpy as np
import pandas as pd
a, b = (pd.read_csv(p, keep_default_na=False) for p in sys.argv[1:3])
for c in ["policy", "budget", "accuracy", "agreement", "bytes_end", "bytes_peak", "bytes_match"]:
    assert (a[c] == b[c]).all(), c
assert np.allclose(a.kl, b.kl, rtol=1e-3, atol=1e-4), (a.kl.values, b.kl.values)
PY

# --- the shipped heldout.json is what export_samples writes (reproducible, commit-ready).
mkdir -p "$dir/export" && cp "$model/vocab.json" "$dir/export/"
count=$("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['count'])" "$model/heldout.json")
if PYTHONPATH="$src/capture/python" "$python" -m kvscope.tinyvlm.export_samples --model "$dir/export" \
     --count "$count" >/dev/null 2>"$dir/export.err" &&
   cmp -s "$dir/export/heldout.json" "$model/heldout.json"
then ok "heldout.json reproducible ($count samples)"
else bad "heldout.json differs from a fresh export: $(cat "$dir/export.err")"; fi

# --- bad input: exit 2, one line, no output file.
expect_bad() {  # NAME NEEDLE ARGS...
  local name=$1 needle=$2; shift 2
  "$kvcap" eval "$@" -o "$dir/$name.h5" >"$dir/$name.out" 2>"$dir/$name.err"
  local rc=$?
  if [[ $rc -eq 2 && $(wc -l <"$dir/$name.err") -eq 1 ]] && grep -q -- "$needle" "$dir/$name.err" &&
     [[ ! -e "$dir/$name.h5" ]]; then ok "$name"
  else bad "$name: exit $rc, stderr: $(cat "$dir/$name.err")"; fi
}
mkdir -p "$dir/nomodel"
cp "$model"/config.json "$model"/vocab.json "$model"/model.safetensors "$dir/nomodel/"
expect_bad unknown_policy "nosuchpolicy" --model "$model" --policies h2o,nosuchpolicy --samples 2
expect_bad missing_heldout "heldout.json not found" --model "$dir/nomodel" --policies h2o --samples 2
expect_bad too_many "has only" --model "$model" --policies h2o --samples 1000000
expect_bad decode_stage "decode" --model "$model" --policies "unicache~decode" --samples 2
expect_bad bad_budget "budget" --model "$model" --policies h2o --budgets 0.5x --samples 2
expect_bad no_policies "missing --policies" --model "$model"
expect_bad zero_samples "--samples must be" --model "$model" --policies h2o --samples 0
expect_bad bad_batch "--max-batch must be" --model "$model" --policies h2o --samples 2 --max-batch -1
expect_bad batch_per_point "--max-batch needs" --model "$model" --policies h2o --samples 2 --max-batch 2 \
  --per-point-prefill
exit $fail
