#!/usr/bin/env bash
# Writes the generated fuzzing seeds into OUT: small synthetic traces (float16; float16 with token roles;
# bfloat16 with deflate; float32 with audio) and small results files of kvsim sweep, beside the shipped traces.
# Usage: make_seeds.sh KVCAP KVSIM OUT [PYTHON]   (PYTHON with h5py; default /usr/bin/python3)
set -euo pipefail
kvcap=$1 kvsim=$2 out=$3 python=${4:-/usr/bin/python3}
mkdir -p "$out"
synth() { "$kvcap" synth --preset tiny -q "$@"; }
synth --images 1 --image-tokens 16 --text 8 --decode 2 -o "$out/mini-f16.h5"
synth --images 2 --image-tokens 9 --text 6 --decode 3 --dtype bfloat16 --deflate 4 --seed 1 -o "$out/mini-bf16-deflate.h5"
synth --images 1 --image-tokens 4 --text 5 --audio 6 --decode 2 --dtype float32 --seed 2 -o "$out/mini-f32-audio.h5"
# Token roles (trace format 1.1): the float16 seed with /tokens/role and /decode/tokens/role.
cp "$out/mini-f16.h5" "$out/mini-roles.h5"
"$python" - "$out/mini-roles.h5" <<'PY'
import sys
import h5py
import numpy as np
with h5py.File(sys.argv[1], "r+") as f:
    f.attrs["version"] = "1.1"
    T = f["tokens/modality"].shape[0]
    f["tokens/role"] = np.array([3] + [0] * (T - 1), np.uint8)
    f["decode/tokens/role"] = np.array([1, 2], np.uint8)
PY
"$kvsim" sweep --trace "$out/mini-f16.h5" --backend cpu -q --policies full,snapkv,h2o+int8 --budgets 0.5 \
  -o "$out/results-mini.h5" >/dev/null 2>&1
"$kvsim" sweep --trace "$out/mini-bf16-deflate.h5" --backend cpu -q --policies full,snapkv~decode,int4,unicache \
  --budgets 0.3,0.7 -o "$out/results-mini-decode.h5" >/dev/null 2>&1
ls "$out"/*.h5 >/dev/null
