#!/usr/bin/env bash
# kvsim run / sweep as a user sees them: results files, and one-line errors with exit 2.
set -uo pipefail
kvsim=$1 kvcap=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
"$kvcap" synth --preset tiny --image-tokens 36 --text 12 --decode 3 -q -o "$dir/t.h5" >/dev/null || exit 1
fail=0
out=$("$kvsim" sweep --trace "$dir/t.h5" --policies full,h2o,int8 --budgets 0.25,0.5 --oracle none -q -o "$dir/r.h5" --csv "$dir/r.csv" 2>/dev/null)
rc=$?
[[ $rc -eq 0 ]] || { echo "FAIL sweep exit $rc"; fail=1; }
for want in "full" "h2o " "int8" "0.25" "0.5"; do
  grep -q -- "$want" <<<"$out" || { echo "FAIL sweep table lacks '$want'"; fail=1; }
done
[[ -s $dir/r.h5 && -s $dir/r.csv ]] || { echo "FAIL results files missing"; fail=1; }
# 4 points (full, h2o@0.25, h2o@0.5, int8) x (4 layers + all) x (text, vision, special + all) + header
rows=$(wc -l < "$dir/r.csv")
[[ $rows -eq $((4 * 5 * 4 + 1)) ]] || { echo "FAIL csv has $rows lines"; fail=1; }
# The default sweep adds oracle rows (one per budget) beside the policies.
oracle=$("$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 0.25,0.5 -q 2>/dev/null | grep -c '^oracle-')
[[ $oracle -eq 2 ]] || { echo "FAIL expected 2 oracle rows, got $oracle"; fail=1; }
"$kvsim" run --trace "$dir/t.h5" --policy unicache@0.5 -q --layers >/dev/null 2>&1 || { echo "FAIL run unicache"; fail=1; }
check() {  # expected-substring command...
  local want=$1; shift
  local err rc
  err=$("$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 || $(grep -c . <<<"$err") -ne 1 || $err != *"$want"* ]]; then
    echo "FAIL '$*': exit $rc: $err"; fail=1
  else
    echo "ok   $err"
  fi
}
check "unknown policy 'h2oo'" "$kvsim" run --trace "$dir/t.h5" --policy h2oo@0.3 -q
check "malformed budget" "$kvsim" run --trace "$dir/t.h5" --policy h2o@lots -q
check "must be in (0, 1]" "$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 2 -q
check "no such file" "$kvsim" sweep --trace "$dir/missing.h5" -q
check "missing --trace" "$kvsim" sweep -q
check "cannot open policy file" "$kvsim" run --trace "$dir/t.h5" --policy-file "$dir/none.ini" --policy h2o -q
check "unrecognised option" "$kvsim" sweep --trace "$dir/t.h5" --frobnicate -q
printf '[policy x]\nbase = h2o\nbogus = 1\n' > "$dir/bad.ini"
check "bad.ini:3: unknown parameter 'bogus'" "$kvsim" run --trace "$dir/t.h5" --policy-file "$dir/bad.ini" --policy x@0.5 -q
exit $fail
