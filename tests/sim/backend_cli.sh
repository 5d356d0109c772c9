#!/usr/bin/env bash
# kvsim --backend: auto runs on the CPU, also on a GPU machine (and says so in the summary on stdout;
# stderr stays empty); cuda without a CUDA build or GPU is one line on stderr and exit 2; on a GPU
# machine cuda must run.
set -uo pipefail
kvsim=$1 kvcap=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
"$kvcap" synth --preset tiny --image-tokens 36 --text 12 --decode 3 -q -o "$dir/t.h5" >/dev/null || exit 1
fail=0
out=$("$kvsim" run --trace "$dir/t.h5" --policy h2o~decode@0.5 -q 2>"$dir/auto.err"); rc=$?
err=$(<"$dir/auto.err")
[[ $rc -eq 0 && $out == *$'\nbackend cpu'* && -z $err ]] || { echo "FAIL auto: exit $rc: stdout $out stderr $err"; fail=1; }
echo "auto: $(grep '^backend' <<<"$out")"
out=$("$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 0.5 --alloc-search none -q --backend cuda 2>"$dir/cuda.err"); rc=$?
err=$(<"$dir/cuda.err")
if [[ $rc -eq 0 && $out == *$'\nbackend cuda'* ]]; then
  echo "ok   GPU present: --backend cuda ran ($(grep '^backend' <<<"$out"))"
elif [[ $rc -ne 2 || $(grep -c . <<<"$err") -ne 1 || $err != *"--backend cuda: "*"use --backend cpu or auto"* ]]; then
  echo "FAIL --backend cuda without a GPU: exit $rc: $err"; fail=1
else
  echo "ok   $err"
fi
source "$(dirname "$0")/cli_lib.sh"
check "unknown backend 'tpu' (valid: cpu, cuda, auto)" "$kvsim" run --trace "$dir/t.h5" --policy h2o@0.5 --backend tpu -q
check "NAME~decode:INTERVAL" "$kvsim" run --trace "$dir/t.h5" --policy 'h2o~decode:0@0.5' -q
exit $fail
