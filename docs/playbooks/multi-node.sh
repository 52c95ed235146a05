#!/usr/bin/env bash
# Launch on several nodes (multi-node.md): mpirun with a hostfile, here one that lists
# this host twice, so the script runs anywhere. Two expert-parallel ranks must give the
# losses of one rank (to fp32 rounding: the sums run in another order).
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_b"
args=(train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=4 --checkpoint.save_final=false)
"$bin" "${args[@]}" --job.dump_folder="$work/one" > /dev/null 2>&1
echo "localhost slots=2" > "$work/hosts"
root_flag=()
[ "$(id -u)" = 0 ] && root_flag=(--allow-run-as-root)
# A session folder of its own: another mpirun job ending removes a shared one.
OMPI_MCA_orte_tmpdir_base="$work" mpirun "${root_flag[@]}" -np 2 --hostfile "$work/hosts" --bind-to none -x OMP_NUM_THREADS \
  "$bin" "${args[@]}" --parallelism.ep=2 --job.dump_folder="$work/two" > "$work/mpirun.log" 2>&1 ||
  { tail -n 20 "$work/mpirun.log"; fail "mpirun failed"; }
python3 - "$work/one/metrics.jsonl" "$work/two/metrics.jsonl" <<'PY' || fail "2 ranks' losses differ from one rank's"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:])
assert len(a) == len(b) == 4, (a, b)
assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)
PY
pass "2 ranks (ep 2, from a hostfile) match one rank's 4 losses"
