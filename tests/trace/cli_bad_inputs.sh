#!/usr/bin/env bash
# Every bad input makes `kvcap validate` and `kvsim info` exit 2 with exactly one
# line on stderr naming the file and the expected problem; a good trace exits 0.
set -uo pipefail
make_bad=$1 kvcap=$2 kvsim=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
"$make_bad" "$dir" || { echo "make_bad_traces failed"; exit 1; }
fail=0
check() {  # tool name file expect
  local tool=$1 name=$2 file=$3 expect=$4 err rc lines
  err=$("${@:5}" 2>&1 >/dev/null); rc=$?
  err=$(printf '%s\n' "$err" | grep -v '^kvcap validate \[' )  # drop progress lines
  lines=$(printf '%s\n' "$err" | grep -c .)
  if [[ $rc -ne 2 ]]; then echo "FAIL $tool $name: exit $rc, want 2 ($err)"; fail=1; return; fi
  if [[ $lines -ne 1 ]]; then echo "FAIL $tool $name: $lines lines on stderr: $err"; fail=1; return; fi
  if [[ $err != *"$file"* ]]; then echo "FAIL $tool $name: message does not name $file: $err"; fail=1; return; fi
  if [[ $tool == validate && $err != *"$expect"* ]]; then echo "FAIL $tool $name: '$err' lacks '$expect'"; fail=1; return; fi
  echo "ok   $tool $name: $err"
}
while IFS=$'\t' read -r name file expect; do
  check validate "$name" "$file" "$expect" "$kvcap" validate -q "$file"
  # kvsim info reads metadata only: NaN inside a tensor is the validator's job.
  case $name in nan|inf_decode) ;; *) check info "$name" "$file" "$expect" "$kvsim" info "$file" ;; esac
done < "$dir/cases.tsv"
"$kvcap" validate -q "$dir/good.h5" >/dev/null || { echo "FAIL good trace rejected"; fail=1; }
"$kvsim" info "$dir/good.h5" >/dev/null || { echo "FAIL kvsim info on good trace"; fail=1; }
# Nonsense flags and unknown commands are usage errors, also exit 2 with one line.
for cmd in "$kvcap frobnicate" "$kvcap synth --preset tiny --bogus 1 -o $dir/x.h5" \
           "$kvcap synth --preset nope -o $dir/x.h5" "$kvcap synth --preset tiny --text -5 -o $dir/x.h5" \
           "$kvcap synth --preset tiny --dtype int8 -o $dir/x.h5" "$kvsim info" "$kvsim explode" \
           "$kvsim sweep -t $dir/good.h5 -q --threads 65536" "$kvsim run -t $dir/good.h5 -q --policy full --threads 10000" \
           "$kvsim sweep -t $dir/good.h5 -q --threads -1" \
           "$kvsim sweep -t $dir/good.h5 -q --policies h2o --budgets 0.1:0.9:1e-7" \
           "$kvsim sweep -t $dir/good.h5 -q --policies h2o,snapkv --budgets 0.0001:1:0.0001" \
           "$kvcap run --model $dir --scene 1 --question q -o $dir/x.h5 --threads 65536" \
           "$kvsim sweep -t $dir/good.h5 -q stray" "$kvcap synth --preset tiny -o $dir/x.h5 stray" \
           "$kvcap validate $dir/good.h5 stray"; do
  err=$($cmd 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 || $(printf '%s\n' "$err" | grep -c .) -ne 1 ]]; then echo "FAIL '$cmd': exit $rc: $err"; fail=1
  else echo "ok   '$cmd': $err"; fi
done
# Caps name the number asked for and the maximum.
err=$("$kvsim" sweep -t "$dir/good.h5" -q --policies h2o --budgets 0.1:0.9:1e-7 2>&1 >/dev/null)
[[ $err == *"asks for 8000001 budgets; at most 10000"* ]] || { echo "FAIL budget cap message: $err"; fail=1; }
err=$("$kvsim" sweep -t "$dir/good.h5" -q --threads 65536 2>&1 >/dev/null)
[[ $err == *"--threads 65536 is more than the maximum of"* ]] || { echo "FAIL threads cap message: $err"; fail=1; }
# A bare argument that no positional option takes is an error, not silently dropped.
err=$("$kvsim" sweep -t "$dir/good.h5" -q stray 2>&1 >/dev/null)
[[ $err == *"too many positional options"* ]] || { echo "FAIL stray argument message: $err"; fail=1; }
[[ ! -e $dir/x.h5 && ! -e $dir/x.h5.partial ]] || { echo "FAIL rejected synth left a file behind"; fail=1; }
exit $fail
