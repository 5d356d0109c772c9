#!/usr/bin/env bash
# kvcap aggregate as a user sees it: stores /aggregates (validate reports them), kvsim sweep says it used
# them (stdout line and the results' attention_statistics attribute) with the table of a sweep without
# them, a different window is recomputed, and bad input is one line with exit 2.
set -uo pipefail
kvsim=$1 kvcap=$2 h5dump=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
"$kvcap" synth --preset tiny --image-tokens 36 --text 12 --decode 3 -q -o "$dir/plain.h5" >/dev/null || exit 1
cp "$dir/plain.h5" "$dir/t.h5"
fail=0
out=$("$kvcap" aggregate "$dir/t.h5" -q); rc=$?
[[ $rc -eq 0 && $out == "aggregated $dir/t.h5: 4 layers, T = 50, window 32: "*"GFLOP/s)" ]] || { echo "FAIL aggregate: exit $rc: $out"; fail=1; }
[[ ! -e $dir/t.h5.aggregates.partial ]] || { echo "FAIL staging file left behind"; fail=1; }
v=$("$kvcap" validate -q "$dir/t.h5"); rc=$?
[[ $rc -eq 0 && $v == *"valid kvscope trace v1.2 "*"; attention aggregates (window 32)" ]] || { echo "FAIL validate: $v"; fail=1; }
sweep() { "$kvsim" sweep --trace "$1" --policies full,h2o,snapkv,tova,unicache,adaptive --budgets 0.3,0.6 -q --alloc-search none "${@:2}" 2>/dev/null; }
with=$(sweep "$dir/t.h5" -o "$dir/r.h5"); without=$(sweep "$dir/plain.h5")
grep -q '^attention statistics: stored /aggregates (window 32) for cross-modal, h2o, redundancy 4/1, snapkv window 32, tova$' <<<"$with" ||
  { echo "FAIL sweep with aggregates says: $(grep 'attention statistics' <<<"$with")"; fail=1; }
grep -q '^attention statistics: recomputed: .*(the trace has no /aggregates; kvcap aggregate stores them)$' <<<"$without" ||
  { echo "FAIL sweep without aggregates says: $(grep 'attention statistics' <<<"$without")"; fail=1; }
# The result tables (3 decimals) are the same.
table() { sed -n '/^policy /,/^$/p' <<<"$1"; }
[[ -n $(table "$with") && $(table "$with") == "$(table "$without")" ]] || { echo "FAIL tables differ"; diff <(table "$with") <(table "$without"); fail=1; }
"$h5dump" -A -a /attention_statistics "$dir/r.h5" 2>/dev/null | grep -q 'stored /aggregates (window 32)' ||
  { echo "FAIL results lack the attention_statistics attribute"; fail=1; }
# Another window: snapkv is recomputed, the rest stays stored.
"$kvcap" aggregate "$dir/t.h5" -q --window 8 >/dev/null || { echo "FAIL aggregate --window 8"; fail=1; }
w8=$(sweep "$dir/t.h5")
grep -q '; recomputed: snapkv window 32 \[stored window is 8\]$' <<<"$w8" || { echo "FAIL window 8: $(grep 'attention statistics' <<<"$w8")"; fail=1; }
source "$(dirname "$0")/cli_lib.sh"
check "kvcap aggregate: missing TRACE" "$kvcap" aggregate
check "--window must be at least 1, got 0" "$kvcap" aggregate "$dir/t.h5" --window 0
check "no such file" "$kvcap" aggregate "$dir/none.h5"
head -c 20000 "$dir/plain.h5" > "$dir/cut.h5"
check "cut.h5" "$kvcap" aggregate "$dir/cut.h5"
[[ $fail -eq 0 ]] && echo "aggregate_cli: ok"
exit $fail
