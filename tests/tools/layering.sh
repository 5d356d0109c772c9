#!/usr/bin/env bash
# The layering of README.md "Architecture", checked on the sources: no file includes a header of a
# layer above its own (kernels <- capture <- sim <- tools, viewer, python). Prints every offending include.
set -uo pipefail
root=$1
fail=0
check() {  # DIR FORBIDDEN-HEADER-PREFIX...
  local dir=$1; shift
  local pattern
  pattern=$(printf '|kvscope/%s/' "$@"); pattern="#include [\"<](${pattern:1})"
  local hits
  hits=$(grep -rnE "$pattern" "$root/$dir" --include='*.cpp' --include='*.hpp' --include='*.h' \
         --include='*.cu' --include='*.cuh' 2>/dev/null)
  if [[ -n $hits ]]; then echo "FAIL $dir includes a higher layer:"; echo "$hits"; fail=1
  else echo "ok   $dir: no include of ${*}"; fi
}
check kernels trace capture runner synth sim closedloop cli viewer python
check capture/trace capture runner synth sim closedloop cli viewer python
check capture sim closedloop cli viewer python
check sim cli viewer python
# The Python extension (python/) sits above the libraries beside the tools: it never uses the command-line
# programs' code (importing kvscope never needs them).
check python cli viewer
# The trace format library also stays free of the runner and the capture API.
check capture/synth runner capture sim closedloop cli viewer
exit $fail
