#!/usr/bin/env bash
# docs/policies.md's stage and parameter tables must be what `kvsim stages --markdown` prints from the
# stage declarations (the block between the two "kvsim stages --markdown" markers). On a mismatch
# it prints the diff; regenerate the block with scripts/update-policy-tables.
set -uo pipefail
kvsim=$1 doc=$2
begin='<!-- BEGIN kvsim stages --markdown -->' end='<!-- END kvsim stages --markdown -->'
grep -qF -- "$begin" "$doc" && grep -qF -- "$end" "$doc" || { echo "FAIL $doc lacks the markers '$begin' / '$end'"; exit 1; }
documented=$(awk -v b="$begin" -v e="$end" '$0 == e {p = 0} p {print} $0 == b {p = 1}' "$doc")
generated=$("$kvsim" stages --markdown) || { echo "FAIL kvsim stages --markdown exited $?"; exit 1; }
if [[ "$documented" != "$generated" ]]; then
  echo "FAIL $doc's stage tables differ from 'kvsim stages --markdown' (run scripts/update-policy-tables):"
  diff <(printf '%s\n' "$documented") <(printf '%s\n' "$generated")
  exit 1
fi
echo "ok   $doc stage tables match the registry ($(grep -c '^| ' <<<"$generated") rows)"
