#!/usr/bin/env bash
# `h5dump -H` of a kvcap trace shows the layout docs/trace-format.md documents.
set -uo pipefail
kvcap=$1 dir=$2
mkdir -p "$dir"
"$kvcap" synth --preset tiny -q -o "$dir/t.h5" >/dev/null || exit 1
dump=$(h5dump -H "$dir/t.h5") || { echo "h5dump failed"; exit 1; }
fail=0
expect() { grep -q -- "$1" <<<"$dump" || { echo "FAIL: h5dump -H lacks: $1"; fail=1; }; }
for a in format version synthetic complete creator created model_name device dtype num_layers num_q_heads \
         num_kv_heads head_dim rope_theta; do expect "ATTRIBUTE \"$a\""; done
for g in tokens layers 000 003 decode profile; do expect "GROUP \"$g\""; done
for d in modality position token_id segment grid q k v kernels ranges; do expect "DATASET \"$d\""; done
expect 'DATASPACE  SIMPLE { ( 4, 90, 32 ) / ( 4, 90, 32 ) }'   # q [Hq, T, D]
expect 'DATASPACE  SIMPLE { ( 2, 90, 32 ) / ( 2, 90, 32 ) }'   # k, v [Hkv, T, D]
expect 'DATASPACE  SIMPLE { ( 90, 2 ) / ( 90, 2 ) }'           # tokens/grid
expect 'H5T_IEEE_F16LE\|16-bit little-endian floating-point\|H5T_FLOAT'
[[ $fail -eq 0 ]] && echo "h5dump layout ok"
exit $fail
