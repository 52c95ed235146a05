#!/usr/bin/env bash
# Debug a loss spike or NaN (debug-loss-spike.md): find the step in metrics.jsonl where
# the loss jumps or stops being finite, with its grad_norm and lr, then rerun from the
# checkpoint before it with a lower lr (or tighter training.clip_grad_norm).
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_a"
run() {  # run FOLDER LR
  "$bin" train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=12 --optimizer.lr="$2" \
    --training.clip_grad_norm=0 --lr_scheduler.warmup_steps=0 --checkpoint.interval=4 --job.dump_folder="$1" > /dev/null
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
# The checkpoint before the spike, and the same steps from it at a sane lr.
before=$(( (step - 1) / 4 * 4 ))
run "$work/calm" 1e-3
[ -z "$(spike "$work/calm/metrics.jsonl")" ] || fail "lr 1e-3 spiked too: $(spike "$work/calm/metrics.jsonl")"
pass "spike at step $step (step loss grad_norm lr: $found); resume from step $before's checkpoint with a lower lr; lr 1e-3 ran clean"
