#!/usr/bin/env bash
# kvsim on edge traces written with h5py (write_edge_trace.py): T = 0, S = 0, single-modality
# traces, values outside the float32 range, and bad policy / budget arguments. Each failure is one
# line on stderr with exit 2; nothing is written (docs/robustness.md, "Edge traces and numerical
# range in kvsim").
set -uo pipefail
# run and sweep get --backend cpu: with auto they also name the backend chosen on stderr.
kvsim=$1 python=$2 writer=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
fail=0
w() { "$python" "$writer" "$@" || { echo "FAIL writing $*"; exit 1; }; }
w "$dir/t0.h5" - 3
w "$dir/s0.h5" 3011 0
w "$dir/ok.h5" 3011110 3 --dtype bfloat16
w "$dir/text4.h5" 0000 2
w "$dir/vision4.h5" 1111 2
w "$dir/audio3.h5" 222 2
w "$dir/huge.h5" 3011110 3 --dtype bfloat16 --scale 1e38
w "$dir/bfmax.h5" 3011110 3 --dtype bfloat16 --scale 1e39
w "$dir/onehuge.h5" 3011110 3 --dtype float32 --scale 1e30 --big-heads 1

source "$(dirname "$0")/cli_lib.sh"
works() {  # command...: exit 0, no 'nan' in stdout
  local out rc
  out=$(timeout 60 "$@" 2>/dev/null); rc=$?
  if [[ $rc -ne 0 ]] || grep -qi 'nan' <<<"$out"; then
    echo "FAIL '$*': exit $rc"; fail=1
  else
    echo "ok   $*"
  fi
}

# A trace needs T >= 1 (docs/trace-format.md): every command refuses T = 0 in one line.
t0_error="$dir/t0.h5: /tokens/modality: T = 0: a trace needs at least one context token"
check "$t0_error" "$kvsim" info "$dir/t0.h5"
check "$t0_error" "$kvsim" plan --trace "$dir/t0.h5" --gpu-mem 24GiB --params 7e9
check "$t0_error" "$kvsim" plan --trace "$dir/t0.h5" --gpu-mem 24GiB --params 7e9 --policy h2o@0.5
# S = 0 is a valid trace: kvsim info reports geometry and bytes, and plan without --policy takes the
# geometry and the request shape.
works "$kvsim" info "$dir/s0.h5"
works "$kvsim" plan --trace "$dir/s0.h5" --gpu-mem 24GiB --params 7e9
# Replaying needs S >= 1: one line naming the file and the command, before any work.
for cmd in run sweep; do
  p=(--policy h2o@0.5); [[ $cmd == sweep ]] && p=(--policies h2o,full --budgets 0.5)
  check "$t0_error" "$kvsim" $cmd --backend cpu --trace "$dir/t0.h5" "${p[@]}" -q -o "$dir/t0_$cmd.h5"
  check "$dir/s0.h5: the trace has S = 0 decode steps; kvsim $cmd needs at least one" \
    "$kvsim" $cmd --backend cpu --trace "$dir/s0.h5" "${p[@]}" -q -o "$dir/s0_$cmd.h5"
done
[[ ! -e $dir/t0_run.h5 && ! -e $dir/s0_sweep.h5 ]] || { echo "FAIL a results file was written"; fail=1; }
check "the trace has S = 0 decode steps; kvsim plan --policy needs at least one" \
  "$kvsim" plan --trace "$dir/s0.h5" --gpu-mem 24GiB --params 7e9 --policy h2o@0.5

# Tiny single-modality traces sweep with the default policies, the oracle-topk bound and the allocation search.
for t in text4 vision4 audio3 ok; do works "$kvsim" sweep --backend cpu --trace "$dir/$t.h5" -q; done

# Values outside the float32 kernels' range: one line naming the tensor, exit 2, no results file.
check "huge.h5: /" "$kvsim" run --backend cpu --trace "$dir/huge.h5" --policy full -q -o "$dir/huge_r.h5"
check "outside the range kvsim computes metrics in" "$kvsim" sweep --backend cpu --trace "$dir/bfmax.h5" -q --csv "$dir/bfmax.csv"
check "outside the range kvsim computes metrics in" "$kvsim" run --backend cpu --trace "$dir/onehuge.h5" --policy h2o@0.5 -q
[[ ! -e $dir/huge_r.h5 && ! -e $dir/bfmax.csv ]] || { echo "FAIL results written for out-of-range values"; fail=1; }

# Policy and budget arguments.
t=$dir/ok.h5
check "unknown policy 'nosuch'" "$kvsim" run --backend cpu --trace "$t" --policy nosuch@0.5 -q
check "unknown policy 'nosuch'" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o,nosuch -q
check "empty item in --policies 'h2o,,snapkv'" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o,,snapkv -q
check "empty item in --policies 'h2o,'" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o, -q
check "--policies is empty" "$kvsim" sweep --backend cpu --trace "$t" --policies "" -q
check "empty policy name" "$kvsim" run --backend cpu --trace "$t" --policy @0.5 -q
check "budget '0' must be positive" "$kvsim" run --backend cpu --trace "$t" --policy h2o@0 -q
check "budget '-0.2' must be positive" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets 0.5,-0.2 -q
check "must be in (0, 1]" "$kvsim" run --backend cpu --trace "$t" --policy h2o@1.01 -q
check "budget 'nan' is not a finite number" "$kvsim" run --backend cpu --trace "$t" --policy h2o@nan -q
check "budget 'inf' is not a finite number" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets inf -q
check "budget 'NaNtok' is not a finite number" "$kvsim" run --backend cpu --trace "$t" --policy h2o@NaNtok -q
check "malformed budget range '0.1:nan:0.1'" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets 0.1:nan:0.1 -q
check "malformed budget range '0:1:0.5'" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets 0:1:0.5 -q
check "empty budget list" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets "" -q
check "empty item in budget list" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --budgets 0.5,,0.6 -q
check "--alloc-search needs a prefill-mode token-scoring policy" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --alloc-search int8 -q
check "--alloc-search needs a prefill-mode token-scoring policy" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --alloc-search oracle-topk -q
check "not both" "$kvsim" sweep --backend cpu --trace "$t" --policies h2o --alloc-search h2o --oracle tova -q
# Policy files: garbage, bad values, and files that are not regular files (a FIFO must not hang).
printf '\x00\xff\x13garbage\n[\x01]\n' > "$dir/random.ini"
check "random.ini:" "$kvsim" run --backend cpu --trace "$t" --policy-file "$dir/random.ini" --policy h2o@0.5 -q
printf '[policy x]\nbase = h2o\nsinks = nan\n' > "$dir/nan.ini"
check "nan.ini:3: sinks: 'nan' is not a number" "$kvsim" run --backend cpu --trace "$t" --policy-file "$dir/nan.ini" --policy x@0.5 -q
printf '[policy x]\nbase = h2o\nmerge_threshold = inf\n' > "$dir/inf.ini"
check "inf.ini:3: merge_threshold: 'inf' is not a number" "$kvsim" sweep --backend cpu --trace "$t" --policy-file "$dir/inf.ini" --policies x -q
printf '[policy x\n' > "$dir/header.ini"
check "header.ini:1: section header must end with ']'" "$kvsim" run --backend cpu --trace "$t" --policy-file "$dir/header.ini" --policy h2o@0.5 -q
mkdir -p "$dir/dir.ini"
check "dir.ini: policy file is not a regular file" "$kvsim" run --backend cpu --trace "$t" --policy-file "$dir/dir.ini" --policy h2o@0.5 -q
mkfifo "$dir/fifo.ini"
check "fifo.ini: policy file is not a regular file" "$kvsim" run --backend cpu --trace "$t" --policy-file "$dir/fifo.ini" --policy h2o@0.5 -q

rm -rf "$dir"
exit $fail
