#!/usr/bin/env bash
# A/B of two moetrain binaries on the GPU machine, in one call: the benchmark runs
# alternately with A and B, ROUNDS times each, so both see the same machine, clocks
# and neighbours (machines differ by a few percent; sessions more).
#
#   bench/ab.sh .gpurun/moetrain-a .gpurun/moetrain-b 2 --layers 8 --skip-baseline --learned-only
#
# Every argument after ROUNDS goes to bench/moe_bench.py.
set -euo pipefail
a="$1"
b="$2"
rounds="$3"
shift 3
for ((i = 1; i <= rounds; i++)); do
  for side in A B; do
    bin="$a"
    [ "$side" = B ] && bin="$b"
    echo "== round $i, $side: $bin"
    python3 bench/moe_bench.py --moetrain "$bin" "$@"
  done
done
