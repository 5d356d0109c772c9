#!/usr/bin/env bash
# Long-context tasks on the command line (docs/tasks.md): kvcap tasks writes deterministic JSON lines;
# kvcap tasks and kvcap eval --task refuse bad flags (unknown task, listing the valid ones; length out of
# range; samples < 1; a missing haystack; --task on the tiny VLM) with exit 2 and one line on stderr.
# With "real" as 5th argument instead: kvcap eval --task passkey on 2 samples of the real model
# (SmolLM2-135M-Instruct, imported by scripts/setup) writes the documented CSV/HDF5 with full as the
# reference and the answers CSV; exit 77 (skip) when the model is missing.
# Usage: tasks_cli.sh KVCAP PYTHON TINY_MODEL_DIR WORKDIR [real]
set -uo pipefail
kvcap=$1 python=$2 tiny=$3 dir=$4 mode=${5:-cli}
rm -rf "$dir" && mkdir -p "$dir"
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

if [[ $mode == cli ]]; then

"$kvcap" tasks --help >"$dir/help.out" 2>&1 && grep -q -- "--length" "$dir/help.out" &&
  grep -q "passkey, needle, multikey, vartrack, varupdate" "$dir/help.out" && ok "tasks help" || bad "tasks help"
"$kvcap" eval --help >"$dir/ehelp.out" 2>&1 && grep -q -- "--task" "$dir/ehelp.out" &&
  grep -q -- "--per-point-prefill" "$dir/ehelp.out" && ok "eval help" || bad "eval help"

"$kvcap" tasks --suite >"$dir/suite.out" 2>&1 && grep -qx "passkey 512" "$dir/suite.out" &&
  ! grep -vqE "^(passkey|needle|multikey|vartrack|varupdate) [0-9]+$" "$dir/suite.out" && ok "tasks suite" ||
  bad "tasks suite: $(cat "$dir/suite.out")"

"$kvcap" tasks --task multikey --length 1024 --samples 5 --seed 9 -o "$dir/a.jsonl" &&
  "$kvcap" tasks --task multikey --length 1024 --samples 5 --seed 9 >"$dir/b.jsonl" &&
  "$kvcap" tasks --task multikey --length 1024 --samples 5 --seed 10 >"$dir/c.jsonl" &&
  cmp -s "$dir/a.jsonl" "$dir/b.jsonl" && ! cmp -s "$dir/a.jsonl" "$dir/c.jsonl" &&
  [[ $(wc -l <"$dir/a.jsonl") == 5 ]] && ok "tasks deterministic" || bad "tasks deterministic"
# kvcap tasks defaults to kvcap eval's seed (0), so both build the same prompts without --seed.
"$kvcap" tasks --task passkey --length 512 --samples 2 >"$dir/d.jsonl" &&
  "$kvcap" tasks --task passkey --length 512 --samples 2 --seed 0 >"$dir/e.jsonl" &&
  cmp -s "$dir/d.jsonl" "$dir/e.jsonl" && grep -q '"seed":0' "$dir/d.jsonl" &&
  ok "tasks default seed 0" || bad "tasks default seed 0"
"$python" - "$dir/a.jsonl" <<'PY' && ok "tasks json lines" || bad "tasks json lines"
import json, sys
for line in open(sys.argv[1]):
    s = json.loads(line)
    assert s["task"] == "multikey" and s["length"] == 1024 and s["seed"] == 9, s
    a, u = s["answer"], s["user"]
    assert u[s["needle_char"]:s["needle_char"] + len(a)] == a
    assert 0 < s["depth"] < 1 and 0 < s["needle_token"] < s["tokens"] <= 1024
    assert s["answer_prefix"].startswith("The special number for the ")
PY

# refuse: CMD... EXPECTED-SUBSTRING (exit 2, one line on stderr, no output file)
refuse() {
  local want=${*: -1} out="$dir/refused.out"
  rm -f "$out"
  "${@:1:$#-1}" >"$dir/r.stdout" 2>"$dir/r.stderr"
  local rc=$?
  if [[ $rc == 2 && $(wc -l <"$dir/r.stderr") == 1 ]] && grep -q -- "$want" "$dir/r.stderr" && [[ ! -e $out ]]; then
    ok "refused: $want"
  else
    bad "refused '$want': rc $rc, stderr: $(cat "$dir/r.stderr")"
  fi
}
refuse "$kvcap" tasks --task nope -o "$dir/refused.out" "unknown task 'nope' (valid: passkey, needle, multikey, vartrack, varupdate)"
refuse "$kvcap" tasks -o "$dir/refused.out" "missing --task (valid: passkey, needle, multikey, vartrack, varupdate)"
refuse "$kvcap" tasks --task passkey --length 100 -o "$dir/refused.out" "out of range (512 .. 4096 tokens)"
refuse "$kvcap" tasks --task passkey --length 8192 -o "$dir/refused.out" "out of range (512 .. 4096 tokens)"
refuse "$kvcap" tasks --task passkey --samples 0 -o "$dir/refused.out" "samples must be >= 1"
refuse "$kvcap" tasks --task passkey --haystack /nonexistent/prose -o "$dir/refused.out" \
  "haystack /nonexistent/prose not found"
refuse "$kvcap" tasks --task passkey --model /nonexistent/model -o "$dir/refused.out" "/nonexistent/model"
refuse "$kvcap" eval --model "$tiny" --policies h2o --task nope -o "$dir/refused.out" "unknown task 'nope'"
refuse "$kvcap" eval --model "$tiny" --policies h2o --task passkey --length 50000 -o "$dir/refused.out" \
  "out of range (512 .. 4096 tokens)"
refuse "$kvcap" eval --model "$tiny" --policies h2o --task passkey --samples 0 -o "$dir/refused.out" \
  "--samples must be >= 1"
refuse "$kvcap" eval --model "$tiny" --policies h2o --task passkey --haystack /nonexistent/prose \
  -o "$dir/refused.out" "haystack /nonexistent/prose not found"
refuse "$kvcap" eval --model "$tiny" --policies h2o --task passkey --samples 1 --length 512 -q \
  -o "$dir/refused.out" "needs a text model"

exit $fail
fi

# --- the real model (scripts/setup): 2 passkey samples at 512 tokens, full + an aggressive budget.
source "$(dirname "$0")/../../scripts/lib/env.sh"  # KVSCOPE_MODELS, as scripts/setup resolves it
real=$KVSCOPE_MODELS/smollm2-135m-instruct
if [[ -f $real/model.safetensors && -f $real/tokenizer.json ]]; then
  if "$kvcap" eval --model "$real" --task passkey --length 512 --samples 2 --seed 1 --policies streamingllm \
       --budgets 0.02 --threads 2 -q -o "$dir/p.h5" --csv "$dir/p.csv" --answers "$dir/p_answers.csv" \
       >"$dir/p.out" 2>"$dir/p.err"; then ok "real model: eval --task passkey"
  else bad "real model: eval --task passkey: $(cat "$dir/p.err")"; fi
  "$python" - "$dir/p.csv" "$dir/p.h5" "$dir/p_answers.csv" <<'PY' && ok "real model: results" || bad "real model: results"
import sys
import h5py
import pandas as pd
df = pd.read_csv(sys.argv[1], keep_default_na=False)
assert list(zip(df.policy, df.budget.astype(str))) == [("full", "-"), ("streamingllm", "0.02")], df
full = df.iloc[0]
assert full.kl == 0 and full.agreement == 1 and full.bytes_ratio == 1
assert (df.samples == 2).all() and (df.samples_text_only == 2).all() and (df.bytes_match == 1).all()
assert df.bytes_end.iloc[1] < 0.1 * full.bytes_end
with h5py.File(sys.argv[2]) as f:
    g = f["closed_loop"]
    assert g.attrs["task"] == "passkey" and g.attrs["length"] == 512, dict(g.attrs)
ans = pd.read_csv(sys.argv[3], keep_default_na=False, dtype=str)
assert len(ans) == 4 and set(ans.family) == {"text-only"}
for _, r in ans.iterrows():
    assert r.expected.isdigit() and len(r.expected) == 5
    assert r.correct == ("1" if r.generated.lstrip().startswith(r.expected) else "0"), r
PY
  # kvcap tasks --model counts with the model's tokenizer: the prompts kvcap eval ran.
  "$kvcap" tasks --model "$real" --task passkey --length 512 --samples 2 --seed 1 -o "$dir/p.jsonl" &&
    "$python" - "$dir/p.jsonl" "$dir/p_answers.csv" <<'PY' && ok "real model: kvcap tasks --model" || bad "real model: kvcap tasks --model"
import json, sys
import pandas as pd
rows = [json.loads(l) for l in open(sys.argv[1])]
assert all(497 <= r["tokens"] <= 512 for r in rows), [r["tokens"] for r in rows]
ans = pd.read_csv(sys.argv[2], keep_default_na=False, dtype=str)
assert list(ans[ans.policy == "full"].expected) == [r["answer"] for r in rows]
PY
else
  echo "skip: the real model $real is missing (run scripts/setup to import SmolLM2-135M-Instruct)"
  exit 77
fi
exit $fail
