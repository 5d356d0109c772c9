#!/usr/bin/env bash
# scripts/gpu-check without a GPU: --pack of this build (a CUDA build packs its programs, CUDA tests and
# libraries; a build without CUDA is refused with one line and exit 2), then the prebuilt check of that
# pack with --allow-no-gpu and the tests step: every CUDA test executable starts from the unpacked
# archive (and skips), backend_cli.sh passes, and the summary says so.
#   gpu_check_dry_run.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
src=$1 build=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
export GPU_CHECK_PACK=$work/pack XZ_OPT=-0
fail() { echo "FAIL: $*"; exit 1; }

out=$("$src/scripts/gpu-check" --pack "$work/no-such-build" 2>&1); rc=$?
[[ $rc -eq 2 && $(grep -c . <<<"$out") -eq 1 && $out == *"no build folder"* ]] || fail "missing build: exit $rc: $out"

if ! compgen -G "$build/tests/test_*_cuda" >/dev/null; then
  out=$("$src/scripts/gpu-check" --pack "$build" 2>&1); rc=$?
  [[ $rc -eq 2 && $out == *"has no CUDA build"* ]] || fail "build without CUDA: exit $rc: $out"
  echo "ok: a build without CUDA is refused: $out"
  exit 0
fi
"$src/scripts/gpu-check" --pack "$build" >"$work/pack.out" 2>&1 || fail "--pack: $(cat "$work/pack.out")"
list=$(tar -tJf "$work/pack/pack.tar.xz") || fail "the pack is not an xz tar"
for f in ./bin/kvsim ./bin/kvcap ./bin/kvbench ./bin/kvrunner-bench ./tests/test_evaluate_cuda ./tests/test_runner_cuda \
         ./tests/test_decode ./source_dir ./lib-cuda/libcudart.so.13; do
  grep -qx -- "$f" <<<"$list" || fail "$f missing from the pack"
done
grep -q '^./lib/libopenblas' <<<"$list" || fail "OpenBLAS missing from the pack"
if grep -qE '^./lib/(libc|libstdc\+\+|libcublas)\.' <<<"$list"; then fail "the C/C++ runtime or cuBLAS was packed"; fi
echo "ok: $(tail -n 2 "$work/pack.out" | head -n 1)"

OUT=$work/out GPU_CHECK_STEPS=tests "$src/scripts/gpu-check" --allow-no-gpu >"$work/check.out" 2>&1
rc=$?
[[ $rc -eq 0 ]] || fail "prebuilt dry run: exit $rc: $(tail -n 20 "$work/check.out")"
grep -q "prebuilt pack from $src" "$work/out/summary.txt" || fail "summary does not name the pack"
grep -q "test_evaluate_cuda: ok" "$work/out/summary.txt" || fail "test_evaluate_cuda did not run"
grep -q "backend_cli.sh (kvsim --backend): ok" "$work/out/summary.txt" || fail "backend_cli.sh did not pass"
grep -q "ALL OK" "$work/out/summary.txt" || fail "summary: $(tail -n 3 "$work/out/summary.txt")"
echo "ok: prebuilt dry run: $(grep -c ': ok' "$work/out/summary.txt") steps ok"
rm -rf "$work"
