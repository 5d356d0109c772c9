# Sourced by the tests/sim/*_cli.sh scripts: the check every command-line error case makes.
# check EXPECTED COMMAND...: the command exits 2 within 60 s with exactly one line on stderr, and that
# line contains EXPECTED. Sets fail=1 (the caller's) otherwise.
check() {
  local want=$1; shift
  local err rc
  err=$(timeout 60 "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 || $(grep -c . <<<"$err") -ne 1 || $err != *"$want"* ]]; then
    echo "FAIL '$*': exit $rc, wanted one line with '$want', got: $err"; fail=1
  else
    echo "ok   $err"
  fi
}
