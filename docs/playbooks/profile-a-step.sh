#!/usr/bin/env bash
# Profile a step (profile-a-step.md): metrics.profile times every stage of a step into
# metrics.jsonl, and `moetrain plan --schedule --profile` replays them. DEVICE=cuda on a
# GPU machine (the numbers that matter); the CPU run shows the same output.
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_a"
"$bin" train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=3 --metrics.profile=true \
  --training.device="${DEVICE:-cpu}" --checkpoint.save_final=false --job.dump_folder="$work/run" > /dev/null
python3 - "$work/run/metrics.jsonl" > "$work/stages.txt" <<'PY'
import json, sys
ms = [json.loads(l) for l in open(sys.argv[1])][-1].get("breakdown_ms", {})
for stage, t in sorted(ms.items(), key=lambda kv: -kv[1]):
    print(f"{stage:24s} {t:8.3f} ms")
PY
[ -s "$work/stages.txt" ] || fail "metrics.jsonl's last line has no profile"
"$bin" plan --model.init="hf:$fx" --data.seq_len=16 --training.global_batch_size=3 --schedule --profile "$work/run/metrics.jsonl" --output "$work/schedule.svg" \
  > "$work/plan.txt"
head -n 5 "$work/stages.txt"
grep -qi "step" "$work/plan.txt" || fail "plan --schedule --profile printed no step time"
pass "$(wc -l < "$work/stages.txt") stages timed and replayed by plan --schedule"
