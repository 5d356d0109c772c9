#!/usr/bin/env bash
# kvsim run / sweep as a user sees them: results files, and one-line errors with exit 2.
set -uo pipefail
kvsim=$1 kvcap=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
"$kvcap" synth --preset tiny --image-tokens 36 --text 12 --decode 3 -q -o "$dir/t.h5" >/dev/null || exit 1
fail=0
out=$("$kvsim" sweep --trace "$dir/t.h5" --policies full,h2o,int8 --budgets 0.25,0.5 --alloc-search none --no-bound -q -o "$dir/r.h5" --csv "$dir/r.csv" 2>/dev/null)
rc=$?
[[ $rc -eq 0 ]] || { echo "FAIL sweep exit $rc"; fail=1; }
for want in "full" "h2o " "int8" "0.25" "0.5"; do
  grep -q -- "$want" <<<"$out" || { echo "FAIL sweep table lacks '$want'"; fail=1; }
done
[[ -s $dir/r.h5 && -s $dir/r.csv ]] || { echo "FAIL results files missing"; fail=1; }
# 4 points (full, h2o@0.25, h2o@0.5, int8) x (4 layers + all) x (text, vision, special + all) + header
rows=$(wc -l < "$dir/r.csv")
[[ $rows -eq $((4 * 5 * 4 + 1)) ]] || { echo "FAIL csv has $rows lines"; fail=1; }
# The default sweep adds the oracle-topk bound and the alloc-search:tova rows (one each per budget)
# beside the policies, in their own table, never on the Pareto front (CSV column kind, pareto 0).
table=$("$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 0.25,0.5 -q --csv "$dir/b.csv" 2>/dev/null)
bound=$(grep -c '^oracle-topk .* bound' <<<"$table")
search=$(grep -c '^alloc-search:tova .* search' <<<"$table")
[[ $bound -eq 2 && $search -eq 2 ]] || { echo "FAIL expected 2 bound and 2 search rows, got $bound and $search"; fail=1; }
grep -q '^Not policies' <<<"$table" || { echo "FAIL the bound rows are not in their own table"; fail=1; }
head -1 "$dir/b.csv" | grep -q ',mode,kind,error_worst_query,.*,topk_mass,specific_recall,specific_recall_min$' || { echo "FAIL csv lacks the kind and proxy columns"; fail=1; }
# kind is column 25 (the proxy columns of results format 1.3 follow it)
bad=$(awk -F, 'NR > 1 && $25 != "policy" && $19 != 0' "$dir/b.csv" | wc -l)
[[ $bad -eq 0 ]] || { echo "FAIL $bad bound/search csv rows on the Pareto front"; fail=1; }
[[ $(awk -F, '$25 == "bound"' "$dir/b.csv" | wc -l) -gt 0 && $(awk -F, '$25 == "search"' "$dir/b.csv" | wc -l) -gt 0 ]] ||
  { echo "FAIL csv roles"; fail=1; }
nobound=$("$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 0.25,0.5 -q --no-bound --alloc-search none 2>/dev/null)
grep -q 'oracle-topk\|alloc-search' <<<"$nobound" && { echo "FAIL --no-bound --alloc-search none still reports them"; fail=1; }
# The old flag name still works, with one deprecation line on stderr.
err=$("$kvsim" sweep --trace "$dir/t.h5" --policies h2o --budgets 0.5 -q --oracle h2o 2>&1 >"$dir/old.txt"); rc=$?
[[ $rc -eq 0 && $err == *"--oracle is deprecated, use --alloc-search h2o"* ]] || { echo "FAIL --oracle: exit $rc: $err"; fail=1; }
grep -q '^alloc-search:h2o ' "$dir/old.txt" || { echo "FAIL --oracle h2o gives no alloc-search:h2o row"; fail=1; }
"$kvsim" run --trace "$dir/t.h5" --policy unicache@0.5 -q --layers >/dev/null 2>&1 || { echo "FAIL run unicache"; fail=1; }
source "$(dirname "$0")/cli_lib.sh"
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
