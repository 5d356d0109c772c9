#!/usr/bin/env bash
# kvsim sweep --dataset under MPI (docs/datasets.md "MPI"): 2 ranks write the same file as one process
# (the same --threads per rank; but the wall clock, compare_results.py), also with policy groups; a
# corrupt trace fails naming it; a rank killed mid-run ends the job with a message and leaves no
# complete-looking results file. Skipped (77) when kvsim was built without MPI or mpirun is missing.
set -uo pipefail
kvsim=$1 kvcap=$2 py=$3 model=$4 dir=$5 here=$(dirname "$0")
command -v mpirun >/dev/null || { echo "SKIP: no mpirun (scripts/setup installs openmpi-bin)"; exit 77; }
# CI runs as root: OpenMPI refuses root without these; 2 ranks on fewer cores need --oversubscribe.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpi=(mpirun -np 2 --oversubscribe)
rm -rf "$dir" && mkdir -p "$dir"
fail=0
"$kvcap" run --model "$model" --samples 10 --max-new 6 -q -o "$dir/ds" > /dev/null 2>&1 || { echo "FAIL capture"; exit 1; }
sweep=(sweep --dataset "$dir/ds" --policies full,h2o,snapkv,tova,streamingllm,int8 --budgets 0.25,0.5 --threads 1 -q
       --by family --bootstrap 300)
# The same command line (recorded in the file) for both: the same relative -o in two directories.
mkdir -p "$dir/one" "$dir/two"
(cd "$dir/one" && "$kvsim" "${sweep[@]}" -o r.h5) > "$dir/one.txt" 2>&1 || { echo "FAIL one process: $(cat "$dir/one.txt")"; exit 1; }
(cd "$dir/two" && "${mpi[@]}" "$kvsim" "${sweep[@]}" -o r.h5) > "$dir/two.txt" 2>&1; rc=$?
if [[ $rc -ne 0 ]] && grep -q "built without MPI" "$dir/two.txt"; then echo "SKIP: kvsim built without MPI"; exit 77; fi
[[ $rc -eq 0 ]] || { echo "FAIL mpirun -np 2: exit $rc: $(tail -5 "$dir/two.txt")"; fail=1; }
grep -q "time: 10 units on 2 ranks" "$dir/two.txt" || { echo "FAIL not 2 ranks: $(grep time: "$dir/two.txt")"; fail=1; }
[[ $(grep -c "^dataset " "$dir/two.txt") -eq 1 ]] || { echo "FAIL the summary is not printed once (rank 0)"; fail=1; }
"$py" "$here/compare_results.py" "$dir/one/r.h5" "$dir/two/r.h5" && echo "ok   mpirun -np 2 writes the single-process file" || fail=1
diff <(grep -v '^time:\|^results:' "$dir/one.txt") <(grep -v '^time:\|^results:' "$dir/two.txt") > /dev/null ||
  { echo "FAIL the summaries differ"; fail=1; }
# Work units of (trace x policy group): 3 groups + the bound/search unit, dynamically over 2 ranks.
(cd "$dir/one" && "$kvsim" "${sweep[@]}" --policy-groups 3 -o g.h5) > /dev/null 2>&1
(cd "$dir/two" && "${mpi[@]}" "$kvsim" "${sweep[@]}" --policy-groups 3 -o g.h5) > "$dir/two-g.txt" 2>&1 || { echo "FAIL groups"; fail=1; }
grep -q "time: 40 units on 2 ranks" "$dir/two-g.txt" || { echo "FAIL group units: $(grep time: "$dir/two-g.txt")"; fail=1; }
"$py" "$here/compare_results.py" "$dir/one/g.h5" "$dir/two/g.h5" && echo "ok   --policy-groups 3 over 2 ranks" || fail=1
# A corrupt trace under MPI: the job fails naming it, no results file.
cp -r "$dir/ds" "$dir/bad" && head -c 3000 "$dir/ds/s00004.h5" > "$dir/bad/s00004.h5"
"${mpi[@]}" "$kvsim" sweep --dataset "$dir/bad" --policies h2o --budgets 0.5 --threads 1 -q -o "$dir/bad.h5" > "$dir/bad.txt" 2>&1; rc=$?
[[ $rc -ne 0 ]] && grep -q "kvsim sweep: sample s00004: .*s00004.h5" "$dir/bad.txt" && [[ ! -e $dir/bad.h5 ]] ||
  { echo "FAIL corrupt trace under MPI: exit $rc: $(tail -3 "$dir/bad.txt")"; fail=1; }
# A killed rank: kill -9 rank 1 while the units run; the job must fail and leave no r.h5.
kill_test() {
  rm -f "$dir/killed.h5" "$dir/killed.h5.partial"
  # (20,000 resamples: rank 0 aggregates for seconds after the units, so the kill lands mid-run even
  # when the units take well under the second below on a quiet machine)
  "${mpi[@]}" "$kvsim" sweep --dataset "$dir/ds" --threads 1 --budgets 0.1:0.9:0.1 --bootstrap 20000 -o "$dir/killed.h5" > "$dir/killed.txt" 2>&1 &
  local job=$! victim="" t
  for t in $(seq 1 300); do  # find rank 1 (OMPI_COMM_WORLD_RANK=1 in its environment)
    for p in $(pgrep -f "kvsim sweep --dataset $dir/ds --threads 1 --budgets"); do
      if tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then victim=$p; fi
    done
    [[ -n $victim ]] && break
    sleep 0.1
  done
  [[ -n $victim ]] || { echo "FAIL rank 1 never started"; wait $job; return 1; }
  sleep 1
  kill -9 "$victim"
  wait $job; local rc=$?
  if [[ $rc -eq 0 ]]; then echo "FAIL the job succeeded after its rank 1 was killed"; return 1; fi
  if [[ -e $dir/killed.h5 ]]; then echo "FAIL a killed job left $dir/killed.h5"; return 1; fi
  grep -q "rank 0: terminated (another rank died or the job was cancelled); no results file written" "$dir/killed.txt" &&
    grep -qi "signal 9\|killed" "$dir/killed.txt" ||
    { echo "FAIL no message about the killed rank: $(tail -5 "$dir/killed.txt")"; return 1; }
  echo "ok   killed rank 1: exit $rc, no results file; $(grep -i -m1 'signal 9\|killed' "$dir/killed.txt")"
}
kill_test || fail=1
exit $fail
