#!/usr/bin/env bash
# The GPU check (gpu-check.md) as far as a CPU goes: tests/gpu/meshes.py lists the
# four-rank meshes a one-GPU machine runs, and two of bench/gpu_suite.sh's mesh checks
# run on the CPU backend, 4 ranks against one.
source "$(dirname "$0")/lib.sh"
command -v mpirun > /dev/null || pass "no mpirun here: nothing to launch (the mesh list needs none, but the runs do)"
# meshes.py needs numpy: Debian's python3 has it (scripts/setup.sh).
py=python3
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c "import numpy" 2> /dev/null && py=/usr/bin/python3
meshes() { "$py" "$root/tests/gpu/meshes.py" "$bin" "$root" "$@"; }
meshes --gpus 1 --ranks 4 --dry-run --lb micro_batch > "$work/list.txt"
for m in "(1,1,1,4)" "(1,1,2,2)" "(1,2,1,2)" "(1,4,1,1)"; do
  grep -qF "$m" "$work/list.txt" || fail "the one-GPU, four-rank mesh list lacks $m: $(head -1 "$work/list.txt")"
done
[ "$(grep -c -- '-np 4' "$work/list.txt")" -eq 6 ] || fail "expected 6 four-rank runs in the dry run"
meshes --device cpu --ranks 4 --lb micro_batch --meshes "1,1,4 1,2,2" > "$work/ep.txt" 2>&1 ||
  fail "ep 4 and dp 2 x ep 2 differ from one rank: $(tail -3 "$work/ep.txt")"
meshes --device cpu --ranks 4 --lb sequence --pipeline --meshes "2,1,1,2" --schedules dualpipev \
  --extra="--training.router_z_loss_coef=0.01 --validation.interval=1 --validation.tokens=@TOKENS@" \
  > "$work/pp.txt" 2>&1 || fail "pp 2 x ep 2 with the balance terms differs from one rank: $(tail -3 "$work/pp.txt")"
pass "$(grep -c -- '-np' "$work/list.txt") mesh runs listed; $(grep -c ' ok' "$work/ep.txt") ep and $(grep -c ' ok' "$work/pp.txt") pp steps match one rank"
