#!/usr/bin/env bash
# Train on a weighted mixture of two corpora with a held-out validation split
# (validation-and-mixtures.md): val_loss every few steps, each corpus's share of the
# sequences, and a resume that continues the mixture where it stopped; then the balance
# terms (sequence-level loss, z-loss, expert biases) logged apart.
source "$(dirname "$0")/lib.sh"
tiny_model "$work/model"
tiny_text "$work/text"
mkdir -p "$work/text_a" "$work/text_b"
mv "$work/text/a.jsonl" "$work/text_a/"
mv "$work/text/b.jsonl.zst" "$work/text_b/"
for c in a b; do
  "$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$work/text_$c" --output "$work/corpus_$c" \
    > "$work/tokenize_$c.log" 2>&1
done
run() {
  "$bin" train --model.config="$work/model/config.json" --data.mixture="1:$work/corpus_a,3:$work/corpus_b" \
    --data.seq_len=32 --training.global_batch_size=4 --optimizer.lr=3e-3 --lr_scheduler.warmup_steps=2 \
    --validation.split=0.1 --validation.interval=5 --checkpoint.interval=10 --job.dump_folder="$work/run" "$@"
}
run --training.steps=10 > "$work/first.log"
run --training.steps=20 > "$work/second.log"
grep -q "validation: every 5 steps" "$work/first.log" || fail "the banner does not describe the validation"
python3 - "$work/run/metrics.jsonl" <<'PY' || fail "val_loss or data_shares are not as expected (above)"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == 20, len(lines)
val = [(l["step"], l["val_loss"]) for l in lines if "val_loss" in l]
assert [s for s, _ in val] == [5, 10, 15, 20], val
assert val[-1][1] < val[0][1], f"val_loss did not fall: {val}"
share = lines[-1]["data_shares"]
assert abs(share[0] - 0.25) <= 0.02 and abs(share[1] - 0.75) <= 0.02, share
print("val_loss", " -> ".join(f"{v:.3f}" for _, v in val), "; shares", share)
PY
# The balance terms a pretraining run adds: DeepSeek's sequence-level loss, the router
# z-loss and DeepSeek-V3's expert biases, each logged apart.
"$bin" train --model.config="$work/model/config.json" --data.mixture="1:$work/corpus_a,3:$work/corpus_b" \
  --data.seq_len=32 --training.global_batch_size=4 --training.steps=10 --optimizer.lr=3e-3 \
  --training.load_balance_type=sequence --training.load_balance_coef=0.01 --training.router_z_loss_coef=0.001 \
  --training.expert_bias_update_rate=0.001 --job.dump_folder="$work/balanced" > "$work/balanced.log"
python3 - "$work/balanced/metrics.jsonl" <<'PY' || fail "the balance terms are not logged as expected (above)"
import json, math, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]
assert math.isfinite(last["lb_loss"]) and last["lb_loss"] > 0.5, last["lb_loss"]  # ~1 a layer when balanced
assert math.isfinite(last["z_loss"]) and last["z_loss"] > 0, last["z_loss"]
assert any(b != 0 for layer in last["expert_bias"] for b in layer), last["expert_bias"]
print("lb_loss", last["lb_loss"], "z_loss", last["z_loss"])
PY
pass "val_loss at steps 5, 10, 15, 20 falls; shares $(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["data_shares"])' "$work/run/metrics.jsonl")"
