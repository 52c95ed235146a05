#!/usr/bin/env bash
# Fine-tune from a Hugging Face model (fine-tune.md): model.init = hf:DIR starts from its
# weights (its config.json is the architecture); the first step's loss is the model's.
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_a"
start="$("$bin" eval --model "$fx" --tokens "$fx/tokens.npy" | python3 -c 'import json,sys; print(json.load(sys.stdin)["loss"])')"
"$bin" train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=10 --optimizer.lr=1e-3 \
  --optimizer.weight_decay=0 --lr_scheduler.warmup_steps=0 --job.dump_folder="$work/run" > /dev/null
read -r first last < <(first_last_loss "$work/run/metrics.jsonl")
python3 -c "import sys; sys.exit(0 if abs($first - $start) <= 1e-5 * $start and $last < $first else 1)" ||
  fail "eval $start, first step $first, last $last"
pass "the model's loss $start; fine-tuned $first -> $last"
