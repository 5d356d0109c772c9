#!/usr/bin/env bash
# The layering of README.md "Architecture", checked on the sources: no file includes a header of a
# layer above its own (kernels <- capture <- sim <- tools, viewer). Prints every offending include.
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
check kernels trace capture runner synth sim closedloop cli viewer
check capture/trace capture runner synth sim closedloop cli viewer
check capture sim closedloop cli viewer
check sim cli viewer
# The trace format library also stays free of the runner and the capture API.
check capture/synth runner capture sim closedloop cli viewer
exit $fail
