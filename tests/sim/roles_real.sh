#!/usr/bin/env bash
# Traces that separate context, question and answer, end to end on the real model (SmolLM2-135M-Instruct,
# imported by scripts/setup; exit 77 = skip without it), passkey at 512 tokens:
#  - kvcap run --task writes roles; the prefill is the context, the question (+ template, answer prefix) one
#    multi-token forward recorded as decode steps, then the generated answer;
#  - those steps' q/k/v equal feeding the same tokens one at a time (--question-chunk 1) and the prefill of
#    the whole prompt (--whole-prompt), within float tolerance;
#  - kvsim sweep gives both settings from the one capture (question after compression; --question-in-context)
#    with the answer/question query-set columns, zero error at full budget, and the two settings differ.
# Usage: roles_real.sh KVCAP KVSIM PYTHON WORKDIR
set -uo pipefail
kvcap=$1 kvsim=$2 python=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
source "$(dirname "$0")/../../scripts/lib/env.sh"  # KVSCOPE_MODELS, as scripts/setup resolves it
real=$KVSCOPE_MODELS/smollm2-135m-instruct
if [[ ! -f $real/model.safetensors || ! -f $real/tokenizer.json ]]; then
  echo "skip: $real not found (scripts/setup imports SmolLM2-135M-Instruct)"
  exit 77
fi
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }
run() {  # NAME ARGS...
  local name=$1
  shift
  if "$kvcap" run --model "$real" --task passkey --length 512 --sample 0 --max-new 8 --threads 2 "$@" \
       -o "$dir/$name.h5" >"$dir/$name.out" 2>"$dir/$name.err"; then ok "kvcap run --task $*"
  else bad "kvcap run --task $*: $(cat "$dir/$name.err")"; fi
}
run split
run each --question-chunk 1
run whole --whole-prompt
grep -q "fed after the prefill as decode steps" "$dir/split.out" && ok "roles summary" || bad "roles summary"
"$kvcap" validate -q "$dir/split.h5" | grep -q "valid kvscope trace v1.1" && ok "validate v1.1" || bad "validate v1.1"
"$kvsim" info "$dir/split.h5" >"$dir/info.out" 2>&1 &&
  grep -Eq "^roles .*decode steps: 0 context, [1-9][0-9]* question, [1-9][0-9]* answer" "$dir/info.out" &&
  ok "kvsim info role counts" || bad "kvsim info role counts: $(grep roles "$dir/info.out")"

"$python" - "$dir" <<'PY' && ok "multi-token forward = one at a time = prefill of the whole prompt" ||
import sys
import h5py
import numpy as np
d = sys.argv[1]
split, each, whole = (h5py.File(f"{d}/{n}.h5", "r") for n in ("split", "each", "whole"))
T = split["tokens/modality"].shape[0]
roles = split["decode/tokens/role"][:]
ctx_roles = split["tokens/role"][:]
n = whole["tokens/modality"].shape[0] - T  # the tokens fed after the prefill
assert set(ctx_roles) <= {0, 3} and roles[0] == 1, (ctx_roles, roles)
assert (roles[:n] != 0).all() and (roles[n:] == 2).all(), roles  # generated steps are answer
assert list(whole["tokens/role"][T:]) == list(roles[:n])
assert (split["decode/tokens/position"][:n] == np.arange(T, T + n)).all()
assert (split["decode/tokens/token_id"][:n] == whole["tokens/token_id"][T:]).all()
worst = 0.0
for l in range(split.attrs["num_layers"]):
    for t in "qkv":
        a = split[f"decode/layers/{l:03d}/{t}"][:]
        b = each[f"decode/layers/{l:03d}/{t}"][:]
        c = whole[f"layers/{l:03d}/{t}"][:, T:]
        g = whole[f"decode/layers/{l:03d}/{t}"][:]
        scale = float(np.abs(c).max())
        worst = max(worst, np.abs(a - b).max() / scale, np.abs(a[:, :n] - c).max() / scale,
                    np.abs(a[:, n:] - g).max() / scale)
assert worst < 1e-4, worst
print("worst relative difference", worst)
PY
  bad "multi-token forward equality"

policies=full,snapkv,streamingllm,tova
for mode in after inside; do
  extra=()
  [[ $mode == inside ]] && extra=(--question-in-context)
  if "$kvsim" sweep -t "$dir/split.h5" -q -p $policies -b 0.25 --alloc-search none --no-bound --threads 2 "${extra[@]}" \
       --csv "$dir/$mode.csv" >"$dir/$mode.out" 2>"$dir/$mode.err"; then ok "kvsim sweep ($mode)"
  else bad "kvsim sweep ($mode): $(cat "$dir/$mode.err")"; fi
done
grep -q "roles: question after compression" "$dir/after.out" && grep -q "err_a" "$dir/after.out" &&
  grep -q "roles: question in the compressed context" "$dir/inside.out" && ok "settings on stdout" ||
  bad "settings on stdout"
"$python" - "$dir" <<'PY' && ok "both settings: zero error at full budget, answer metrics differ" ||
import sys
import pandas as pd
d = sys.argv[1]
pts = {}
for mode in ("after", "inside"):
    df = pd.read_csv(f"{d}/{mode}.csv", dtype={"budget": str, "layer": str})
    pts[mode] = df[(df.layer == "all") & (df.modality == "all")].set_index("policy")
a, b = pts["after"], pts["inside"]
for p in (a, b):
    assert p.loc["full", "output_error"] < 1e-5 and p.loc["full", "output_error_answer"] < 1e-5, p
    assert (p.loc[["snapkv", "streamingllm", "tova"], "output_error_answer"] > 1e-3).all(), p
# question after compression: the answer's queries are a real subset; inside: the question set is empty
assert (a.loc[["snapkv", "tova"], "output_error_answer"] != a.loc[["snapkv", "tova"], "output_error"]).all()
assert a.output_error_question.notna().all() and b.output_error_question.isna().all()
assert (b.output_error_answer - b.output_error).abs().max() < 1e-12
assert (a.loc["snapkv", "output_error_answer"] != b.loc["snapkv", "output_error_answer"])
print(a[["output_error", "output_error_answer", "output_error_question"]])
print(b[["output_error", "output_error_answer"]])
PY
  bad "both settings"
exit $fail
