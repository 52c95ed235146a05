#!/usr/bin/env bash
# Debug a loss spike or NaN (debug-loss-spike.md): find the step in metrics.jsonl where
# the loss jumps or stops being finite, with its grad_norm and lr, then rerun from the
# checkpoint before it with a lower lr (or tighter training.clip_grad_norm).
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_a"
run() {  # run FOLDER LR [FLAGS]: prints the banner's notes
  local folder="$1" lr="$2"
  shift 2
  "$bin" train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=12 --optimizer.lr="$lr" \
    --training.clip_grad_norm=0 --lr_scheduler.warmup_steps=0 --checkpoint.interval=2 --checkpoint.keep=8 --job.dump_folder="$folder" \
    "$@" | grep "note:" || true
}
# The first step whose loss is not finite or above 1.5x the lowest so far: "step loss grad_norm lr", or nothing.
spike() {
  python3 - "$1" <<'PY'
import json, math, sys
low = math.inf
for line in open(sys.argv[1]):
    m = json.loads(line)
    loss = float(m["loss"]) if m["loss"] is not None else math.nan
    if not math.isfinite(loss) or loss > 1.5 * low:
        print(m["step"], loss, m["grad_norm"], m["lr"])
        break
    low = min(low, loss)
PY
}
run "$work/hot" 0.5
found="$(spike "$work/hot/metrics.jsonl")"
[ -n "$found" ] || fail "lr 0.5 without clipping gave no spike to find"
read -r step _ _ _ <<< "$found"
# The checkpoint before the spike, and a branch from it at a sane lr in the same folder.
before=$(( (step - 1) / 2 * 2 ))
[ "$before" -gt 0 ] || fail "the spike at step $step has no checkpoint before it (every 2 steps)"
ckpt="$(printf '%s/hot/checkpoints/step-%08d' "$work" "$before")"
run "$work/hot" 1e-3 --checkpoint.load="$ckpt" --checkpoint.allow_config_change=true > "$work/branch.txt"
aside="$(printf '%s/hot/branches/from-step-%08d' "$work" "$before")"
grep -q "note: branching from step $before" "$work/branch.txt" || fail "the branch did not say so: $(cat "$work/branch.txt")"
[ -s "$aside/metrics.jsonl" ] || fail "the abandoned steps' metrics lines are not in $aside"
# The branch's own steps (after the branch point) run clean.
python3 -c 'import json,sys; [print(l, end="") for l in open(sys.argv[1]) if json.loads(l)["step"] > int(sys.argv[2])]' \
  "$work/hot/metrics.jsonl" "$before" > "$work/branch.jsonl"
[ -s "$work/branch.jsonl" ] || fail "the branch wrote no metrics lines after step $before"
[ -z "$(spike "$work/branch.jsonl")" ] || fail "the branch at lr 1e-3 spiked too: $(spike "$work/branch.jsonl")"
pass "spike at step $step (step loss grad_norm lr: $found); branched from step $before's checkpoint at lr 1e-3, clean; the abandoned steps are in branches/"
