#!/usr/bin/env bash
# The pipeline issue's one-GPU measurement: the 8-layer benchmark model (Qwen3-30B-A3B
# cut to 8 layers) trained with the sequential schedule and with dualpipev on one rank
# (the V's two chunks both there, each forward paired stage by stage with another
# micro-batch's backward), from the same weights on the same batch: 4 sequences of
# 4096 tokens in micro-batches of 1, bf16 AdamW moments. Prints each run's losses and
# mean tokens/s after the first two steps, and copies the metrics (every step's stage
# profile) to OUT, where `moetrain plan --schedule --profile` reads them.
#
#   bench/pipeline_one_gpu.sh BIN OUT [STEPS]
set -euo pipefail
bin="$1"
out="$2"
steps="${3:-6}"
tmp="$(mktemp -d)"
python3 -c "import numpy as np; np.save('$tmp/tokens.npy', np.random.default_rng(0).integers(0, 151936, size=(4, 4097), dtype=np.int64))"
for schedule in auto dualpipev; do
  "$bin" train --model.config=bench/configs/qwen3_30b_a3b_8l.json --data.tokens="$tmp/tokens.npy" \
    --training.steps="$steps" --training.device=cuda --training.micro_batch_size=1 --optimizer.state_dtype=bf16 \
    --optimizer.lr=1e-4 --training.clip_grad_norm=1.0 --training.load_balance_coef=0.001 --metrics.profile=true \
    --parallelism.pipeline_schedule="$schedule" --job.dump_folder="$tmp/$schedule" > "$tmp/$schedule.log" 2>&1 ||
    { tail -20 "$tmp/$schedule.log"; exit 1; }
  cp "$tmp/$schedule/metrics.jsonl" "$out/metrics-$schedule.jsonl"
  python3 - "$tmp/$schedule/metrics.jsonl" "$schedule" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = sum(r["tokens_per_s"] for r in rows[2:]) / max(1, len(rows) - 2)
losses = " ".join("%.5f" % r["loss"] for r in rows)
norms = " ".join("%.4f" % r["grad_norm"] for r in rows)
print(f"{sys.argv[2]}: losses {losses}; grad norms {norms}; {tps:,.0f} tokens/s; "
      f"held {max(r.get('device_memory_bytes', 0) for r in rows) / 1e9:.1f} GB")
b = rows[-1]["breakdown_ms"]
print("  last step by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(b.items(), key=lambda kv: -kv[1])))
PY
done
