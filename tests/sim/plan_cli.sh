#!/usr/bin/env bash
# `kvsim plan` from the command line: the seed's KV numbers in the JSON output,
# CSV that pandas reads, a request shape taken from a trace (checked against
# h5py), --help, and every bad input exiting 2 with one line on stderr.
# Usage: plan_cli.sh KVSIM KVCAP PYTHON WORKDIR
set -uo pipefail
kvsim=$1 kvcap=$2 python=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

# json FILE EXPR EXPECTED: evaluate a Python expression on the parsed JSON `j`.
json() {
  local got
  got=$("$python" -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1" 2>&1)
  if [[ $got == "$3" ]]; then ok "$1: $2 == $3"; else bad "$1: $2 = '$got', want '$3'"; fi
}

run_ok() {  # NAME ARGS...: must exit 0
  local name=$1; shift
  if "$kvsim" plan "$@" >"$dir/$name.out" 2>"$dir/$name.err"; then ok "$name"
  else bad "$name: exit $? ($(cat "$dir/$name.err"))"; fi
}

# --- seed 003: a 7B GQA-8 model costs 128 KiB per token; one 576-token image 72 MiB; 8K tokens 1 GiB.
gqa8=(--layers 32 --kv-heads 8 --head-dim 128 --q-heads 32 --params 7e9 --gpu-mem 80GB --max-new 0)
run_ok image "${gqa8[@]}" --images 1 --image-tokens 576 --text 0 --json "$dir/image.json"
json "$dir/image.json" "j['kv_bytes_per_token']" 131072
json "$dir/image.json" "j['full']['request_bytes'] == 72 * 2**20" True
run_ok text8k "${gqa8[@]}" --text 8192 --json "$dir/text8k.json"
json "$dir/text8k.json" "j['full']['request_bytes'] == 2**30" True
grep -q "128.00 KiB" "$dir/image.out" && ok "table shows 128.00 KiB per token" \
  || bad "table lacks 128.00 KiB: $(cat "$dir/image.out")"

# --- llava-1.5-7b is MHA: 512 KiB per token; ratio 0.5 everywhere doubles the requests (within the floor).
run_ok llava --model llava-1.5-7b --gpu-mem 80GiB --kv-ratio 0.5 --output-ratio 0.5 \
  --json "$dir/llava.json" --csv "$dir/llava.csv"
json "$dir/llava.json" "j['kv_bytes_per_token']" 524288
r="j['request']"
json "$dir/llava.json" "($r['image_tokens'], $r['text_tokens'], $r['output_tokens'])" "(576, 64, 256)"
json "$dir/llava.json" "0 <= j['compressed']['max_requests'] - 2 * j['full']['max_requests'] <= 1" True
grep -q "with compression" "$dir/llava.out" && ok "table has the compressed column" \
  || bad "no compressed column"
got=$("$python" - "$dir/llava.csv" <<'EOF' 2>&1
import sys, pandas as pd
d = pd.read_csv(sys.argv[1]).set_index("setting")
assert list(d.index) == ["full", "compressed"], d.index
f, c = d.loc["full"], d.loc["compressed"]
assert f.kv_bytes_per_token == 524288
assert f.request_bytes == (576 + 64 + 256) * 524288, f.request_bytes
assert c.request_bytes * 2 == f.request_bytes
assert f.kv_budget_bytes == f.gpu_mem_bytes - f.weights_bytes - f.reserve_bytes
assert f.max_requests == f.kv_budget_bytes // f.request_bytes
print("csv ok")
EOF
)
[[ $got == "csv ok" ]] && ok "pandas reads the CSV and its numbers add up" || bad "csv: $got"

# --- int4 weights leave more room than fp16.
run_ok fp16 --model qwen2-vl-7b --gpu-mem 24GiB --json "$dir/fp16.json"
run_ok int4 --model qwen2-vl-7b --gpu-mem 24GiB --weights-dtype int4 --json "$dir/int4.json"
more=$("$python" -c "import json; a=json.load(open('$dir/fp16.json')); b=json.load(open('$dir/int4.json')); \
print(b['full']['max_requests'] > a['full']['max_requests'] and b['weights_bytes'] < a['weights_bytes'])")
[[ $more == True ]] && ok "int4 weights fit more requests" || bad "int4 vs fp16: $more"

# --- request shape from a trace (2 images of 64 tokens in the tiny preset), compared with h5py.
if "$kvcap" synth --preset tiny --images 2 --text 40 -o "$dir/t.h5" >/dev/null 2>&1; then
  run_ok trace --trace "$dir/t.h5" --params 2e6 --gpu-mem 1GiB --json "$dir/trace.json"
  want=$("$python" -c "import h5py,numpy as np; m=h5py.File('$dir/t.h5')['tokens/modality'][:]; \
print((int((m==0).sum()), 2, int((m==1).sum())//2, int((m==3).sum())))")
  json "$dir/trace.json" "($r['text_tokens'], $r['images'], $r['image_tokens'], $r['special_tokens'])" "$want"
  json "$dir/trace.json" "j['kv_bytes_per_token']" $((4 * 2 * 2 * 32 * 2))
  run_ok trace_override --trace "$dir/t.h5" --params 2e6 --gpu-mem 1GiB --images 5 --json "$dir/trace5.json"
  json "$dir/trace5.json" "j['request']['images']" 5
else
  bad "kvcap synth failed"
fi

# --- help lists every option.
if "$kvsim" plan --help >"$dir/help.txt"; then
  missing=""
  for o in model trace layers kv-heads head-dim q-heads params gpu-mem weights-dtype reserve kv-dtype images \
           image-tokens text audio max-new kv-ratio vision-ratio text-ratio output-ratio csv json; do
    grep -q -- "--$o" "$dir/help.txt" || missing+=" --$o"
  done
  [[ -z $missing ]] && ok "--help lists every option" || bad "--help lacks$missing"
else
  bad "--help exit $?"
fi

# --- bad input: exit 2, exactly one line on stderr, containing the expected words.
expect_error() {  # EXPECTED ARGS...
  local want=$1 err rc; shift
  err=$("$kvsim" plan "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 ]]; then bad "'$*': exit $rc, want 2 ($err)"; return; fi
  if [[ $(printf '%s\n' "$err" | grep -c .) -ne 1 ]]; then bad "'$*': not one line: $err"; return; fi
  if [[ $err != *"$want"* ]]; then bad "'$*': '$err' lacks '$want'"; return; fi
  ok "'$*': $err"
}
expect_error "size must be positive" --model llava-1.5-7b --gpu-mem=-24GiB
expect_error "unknown unit" --model llava-1.5-7b --gpu-mem 24XB
expect_error "not a byte size" --model llava-1.5-7b --gpu-mem lots
expect_error "valid: llava-1.5-7b, qwen2-vl-7b" --model gpt-9 --gpu-mem 24GiB
expect_error "weights alone need 13.16 GiB" --model llava-1.5-7b --gpu-mem 12GiB
expect_error "GPU has 12.00 GiB" --model llava-1.5-7b --gpu-mem 12GiB
expect_error "--kv-ratio must be in (0, 1]" --model llava-1.5-7b --gpu-mem 24GiB --kv-ratio 0
expect_error "--vision-ratio must be in (0, 1]" --model llava-1.5-7b --gpu-mem 24GiB --vision-ratio 1.5
expect_error "--reserve must be in [0, 1)" --model llava-1.5-7b --gpu-mem 24GiB --reserve 1
expect_error "leave no room for the KV cache" --model llava-1.5-7b --gpu-mem 14GiB --reserve 0.2
expect_error "give one of --model, --trace" --model llava-1.5-7b --layers 32 --gpu-mem 24GiB
expect_error "missing --kv-heads" --layers 32 --head-dim 128 --params 7e9 --gpu-mem 24GiB
expect_error "missing --gpu-mem" --model llava-1.5-7b
expect_error "missing the model" --gpu-mem 24GiB
expect_error "unknown weights dtype 'int3'" --model llava-1.5-7b --gpu-mem 24GiB --weights-dtype int3
expect_error "unknown KV dtype 'fp8'" --model llava-1.5-7b --gpu-mem 24GiB --kv-dtype fp8
expect_error "--images must be >= 0" --model llava-1.5-7b --gpu-mem 24GiB --images=-1
expect_error "multiple of kv-heads" --layers 32 --kv-heads 8 --head-dim 128 --q-heads 12 --params 7e9 \
  --gpu-mem 24GiB
expect_error "$dir/none.h5" --trace "$dir/none.h5" --gpu-mem 24GiB
[[ -e $dir/t.h5 ]] && expect_error "give --params" --trace "$dir/t.h5" --gpu-mem 1GiB
expect_error "cannot write --csv" --model llava-1.5-7b --gpu-mem 24GiB --csv "$dir/no/such/dir/x.csv"
expect_error "unrecognised option" --model llava-1.5-7b --gpu-mem 24GiB --bogus 1
expect_error "invalid" --model llava-1.5-7b --gpu-mem 24GiB --text many
exit $fail
