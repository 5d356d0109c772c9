#!/usr/bin/env bash
# Datasets of traces (docs/datasets.md) as a user sees them: kvcap run --samples writes a dataset whose
# manifest pandas reads and whose capture commands reproduce each trace; kvsim sweep --dataset prints
# per-budget summaries with intervals and writes per-sample and aggregate tables (checked with h5py /
# pandas by dataset_check.py); corrupt traces fail the sweep naming them or, with --skip-bad, are
# recorded as failed; bad input is one line and exit 2.
set -uo pipefail
kvsim=$1 kvcap=$2 py=$3 model=$4 dir=$5 here=$(dirname "$0")
rm -rf "$dir" && mkdir -p "$dir"
fail=0
"$kvcap" run --model "$model" --samples 8 --max-new 6 -q -o "$dir/ds" > "$dir/cap.txt" 2>&1 ||
  { echo "FAIL kvcap run --samples: $(cat "$dir/cap.txt")"; exit 1; }
grep -q "wrote dataset $dir/ds: 8 samples" "$dir/cap.txt" || { echo "FAIL capture summary: $(cat "$dir/cap.txt")"; fail=1; }
[[ $(ls "$dir"/ds/s0000*.h5 | wc -l) -eq 8 && -f $dir/ds/manifest.csv && ! -e $dir/ds/manifest.csv.partial ]] ||
  { echo "FAIL dataset files"; fail=1; }
# The manifest's capture command of sample 3 captures the same trace again: same replay results.
cmd=$("$py" -c "import pandas as pd, sys; m = pd.read_csv(sys.argv[1], dtype=str, keep_default_na=False); print(m.capture_command[3])" "$dir/ds/manifest.csv")
again=${cmd/#kvcap/$kvcap}
again=${again/$dir\/ds\/s00003.h5/$dir/again.h5}
eval "$again" > /dev/null 2>&1 || { echo "FAIL capture command: $cmd"; fail=1; }
for t in "$dir/ds/s00003.h5" "$dir/again.h5"; do
  "$kvsim" sweep --trace "$t" --policies h2o,snapkv --budgets 0.3 --no-bound --alloc-search none -q --threads 1 \
    --csv "$t.csv" > /dev/null 2>&1 || { echo "FAIL sweep $t"; fail=1; }
done
cmp -s "$dir/ds/s00003.h5.csv" "$dir/again.h5.csv" || { echo "FAIL the capture command does not reproduce sample 3"; fail=1; }
rm -f "$dir/ds/s00003.h5.csv"

sweep=("$kvsim" sweep --dataset "$dir/ds" --policies full,h2o,snapkv,streamingllm --budgets 0.25,0.5 --threads 1 -q)
out=$("${sweep[@]}" --by family,length --bootstrap 500 -o "$dir/r.h5" --csv "$dir/agg.csv" \
      --samples-csv "$dir/samples.csv" 2>"$dir/err.txt"); rc=$?
[[ $rc -eq 0 ]] || { echo "FAIL dataset sweep exit $rc: $(cat "$dir/err.txt")"; fail=1; }
echo "$out" | head -20
for want in "dataset $dir/ds: 8 of 8 samples replayed" "95 % bootstrap intervals (500 resamples, seed 0)" \
            "all samples (n = 8)" "family = counting" "oracle-topk (bound)" "time: 8 units on 1 rank"; do
  grep -qF -- "$want" <<<"$out" || { echo "FAIL summary lacks '$want'"; fail=1; }
done
grep -qE '^  0\.25 +[a-z]+ +[0-9.]+ +[0-9.]+ \[[0-9.]+, [0-9.]+\]' <<<"$out" || { echo "FAIL no budget row with an interval"; fail=1; }
# Sample 3's single-trace sweep with the same options: its /sample_points rows are that CSV's (proxies too).
"$kvsim" sweep --trace "$dir/ds/s00003.h5" --policies full,h2o,snapkv,streamingllm --budgets 0.25,0.5 --threads 1 -q \
  --csv "$dir/one3.csv" > /dev/null 2>&1 || { echo "FAIL single-trace sweep of sample 3"; fail=1; }
"$py" "$here/dataset_check.py" "$dir/r.h5" "$dir/agg.csv" "$dir/samples.csv" "$dir/ds/manifest.csv" 8 \
  "$dir/one3.csv" 3 || fail=1
# Deterministic: the same sweep again gives the same file (but the wall clock) and the same aggregate CSV;
# two policy groups (a unit per group and one for the bound/search rows) give the same aggregates.
mkdir -p "$dir/first" && mv "$dir/r.h5" "$dir/agg.csv" "$dir/first/"
"${sweep[@]}" --by family,length --bootstrap 500 -o "$dir/r.h5" --csv "$dir/agg.csv" --samples-csv "$dir/samples.csv" >/dev/null 2>&1
"$py" "$here/compare_results.py" "$dir/first/r.h5" "$dir/r.h5" || { echo "FAIL rerun differs"; fail=1; }
cmp -s "$dir/first/agg.csv" "$dir/agg.csv" || { echo "FAIL rerun's aggregate CSV differs"; fail=1; }
"${sweep[@]}" --by family,length --bootstrap 500 --policy-groups 3 --csv "$dir/agg3.csv" >/dev/null 2>&1 ||
  { echo "FAIL --policy-groups 3"; fail=1; }
cmp -s "$dir/agg.csv" "$dir/agg3.csv" || { echo "FAIL --policy-groups 3 gives other aggregates"; fail=1; }
# A list / glob of traces is a dataset without a manifest.
out=$("$kvsim" sweep --dataset "$dir/ds/s0000[0-3].h5,$dir/ds/s00007.h5" --policies h2o --budgets 0.5 --threads 1 -q \
      --by length --bootstrap 50 2>&1); rc=$?
[[ $rc -eq 0 ]] && grep -q "5 of 5 samples" <<<"$out" || { echo "FAIL glob dataset: $rc $out"; fail=1; }

# A corrupt trace: the sweep fails naming it, and leaves no results file; --skip-bad records it.
cp -r "$dir/ds" "$dir/bad"
head -c 3000 "$dir/ds/s00002.h5" > "$dir/bad/s00002.h5"
err=$("$kvsim" sweep --dataset "$dir/bad" --policies h2o --budgets 0.5 --threads 1 -q -o "$dir/bad.h5" 2>&1 >/dev/null); rc=$?
[[ $rc -eq 2 && $(grep -c . <<<"$err") -eq 1 && $err == *"sample s00002"*"s00002.h5"*"--skip-bad"* ]] ||
  { echo "FAIL corrupt trace: exit $rc: $err"; fail=1; }
[[ ! -e $dir/bad.h5 && ! -e $dir/bad.h5.partial ]] || { echo "FAIL a results file after a failed sweep"; fail=1; }
out=$("$kvsim" sweep --dataset "$dir/bad" --policies h2o --budgets 0.5 --threads 1 -q --skip-bad -o "$dir/skip.h5" 2>&1); rc=$?
[[ $rc -eq 0 ]] && grep -q "7 of 8 samples replayed (1 failed)" <<<"$out" && grep -q "^failed: sample s00002: " <<<"$out" ||
  { echo "FAIL --skip-bad: exit $rc: $out"; fail=1; }
"$py" - "$dir/skip.h5" <<'PY' || fail=1
import sys, h5py
with h5py.File(sys.argv[1], "r") as f:
    st = list(f["samples/status"].asstr()[:])
    assert st.count("failed") == 1 and st[2] == "failed", st
    assert "s00002.h5" in f["samples/error"].asstr()[2], f["samples/error"].asstr()[2]
    assert f.attrs["failed_samples"] == 1 and f.attrs["num_samples"] == 8
    by, n = f["aggregate/by"].asstr()[:], f["aggregate/n"][:]
    assert set(n[by == "all"]) == {7}, set(n[by == "all"])
    assert 2 not in set(f["sample_points/sample"][:])
PY

source "$(dirname "$0")/cli_lib.sh"
check "manifest.csv: no such file" "$kvsim" sweep --dataset "$dir" -q
check "the pattern matches no file" "$kvsim" sweep --dataset "$dir/none*.h5" -q
check "--by nosuch: no such column in the manifest" "$kvsim" sweep --dataset "$dir/ds" --by nosuch -q
check "only --by length works" "$kvsim" sweep --dataset "$dir/ds/s00000.h5" --by family -q
check "--by needs --dataset" "$kvsim" sweep --trace "$dir/ds/s00000.h5" --by family -q
check "--layers is for one trace" "$kvsim" sweep --dataset "$dir/ds" --layers -q
check "--bootstrap must be in 0..100000" "$kvsim" sweep --dataset "$dir/ds" --bootstrap -1 -q
mkdir -p "$dir/m1" "$dir/m2" "$dir/m3"
printf 'sample,trace\ns0,a.h5,extra\n' > "$dir/m1/manifest.csv"
check "row 1: 3 fields, the header has 2" "$kvsim" sweep --dataset "$dir/m1" -q
printf 'sample,file\ns0,a.h5\n' > "$dir/m2/manifest.csv"
check "no 'trace' column" "$kvsim" sweep --dataset "$dir/m2" -q
printf 'sample,trace\ns0,"a.h5\n' > "$dir/m3/manifest.csv"
check "unterminated quote" "$kvsim" sweep --dataset "$dir/m3" -q
check "already a dataset" "$kvcap" run --model "$model" --samples 2 -o "$dir/ds"
check "--samples 2000 but" "$kvcap" run --model "$model" --samples 2000 -o "$dir/big"
check "--scene captures one trace" "$kvcap" run --model "$model" --samples 2 --scene 3 -o "$dir/x"
exit $fail
