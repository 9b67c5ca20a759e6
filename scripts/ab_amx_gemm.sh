#!/bin/bash
# A/B of the q4x8 AMX GEMM between two git revisions, call by call in one process (scripts/ab_amx_gemm.cpp), on one
# core, for the packaged 1.5B's q4x8 shapes (gate|up, q / o, down), each side in its own row chunks.
# Usage: scripts/ab_amx_gemm.sh REV_A REV_B [REPEATS] [M]
#   chunk sizes: A_CHUNK / B_CHUNK (env, rows at K 1536; default 1024 / 384) and A_CHUNK_DOWN / B_CHUNK_DOWN (K 8960;
#   default 160 / 160): what each revision's dw_wide_chunk_rows gives (gemm_wide.h)
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REV_A REV_B [REPEATS] [M]" >&2; exit 2; }
grep -q amx_int8 /proc/cpuinfo || { echo "this CPU has no AMX-INT8" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
reps=${3:-15}
M=${4:-1152}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags="-O3 -std=c++20 -ffp-contract=off -fno-math-errno -mamx-tile -mamx-int8 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512dq -mfma -mf16c"
for side in a b; do
  rev=$([ $side = a ] && echo "$1" || echo "$2")
  mkdir -p "$tmp/$side"
  git -C "$root" archive "$rev" draftwise/kernels/csrc | tar -x -C "$tmp/$side"
  src="$tmp/$side/draftwise/kernels/csrc"
  # symbols renamed per side (the shared inline helpers too, so neither side links the other's)
  g++ $flags -I"$src" -Ddwamx=dwamx_$side -Ddw_gemm_amx=${side}_dw_gemm_amx -Ddw_amx_scratch_bytes=${side}_scratch_bytes \
    -c "$src/gemm_q4x8_amx.cpp" -o "$tmp/$side.o"
done
g++ $flags -I"$tmp/b/draftwise/kernels/csrc" "$root/scripts/ab_amx_gemm.cpp" "$tmp/a.o" "$tmp/b.o" -o "$tmp/ab"
echo "A = $(git -C "$root" rev-parse --short "$1"), B = $(git -C "$root" rev-parse --short "$2"), one core (taskset -c 1), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
ca=${A_CHUNK:-1024}; cb=${B_CHUNK:-384}; da=${A_CHUNK_DOWN:-160}; db=${B_CHUNK_DOWN:-160}
taskset -c 1 "$tmp/ab" 17920 1536 "$M" "$ca" "$cb" "$reps"   # gate|up
taskset -c 1 "$tmp/ab" 1536 1536 "$M" "$ca" "$cb" "$reps"    # q, o
taskset -c 1 "$tmp/ab" 1536 8960 "$M" "$da" "$db" "$reps"    # down (q4x8 layers)
