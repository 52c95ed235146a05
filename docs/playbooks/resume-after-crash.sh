#!/usr/bin/env bash
# Resume after a crash (resume-after-crash.md): kill -9 a run after a checkpoint, run the
# same command again, and get the losses of a run that never stopped, bit for bit.
source "$(dirname "$0")/lib.sh"
tiny_model "$work/model"
tiny_text "$work/text"
"$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$work/text" --output "$work/corpus" > /dev/null
train_tiny "$work/straight" "$work/corpus" 12 > /dev/null
# The same run, killed once its step-4 checkpoint is complete (the delay keeps it from
# finishing first), then started again as it was.
as=exec MOETRAIN_CHECKPOINT_DELAY_MS=200 train_tiny "$work/crashed" "$work/corpus" 12 --checkpoint.interval=4 > /dev/null &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$work/crashed/checkpoints/step-00000004/COMPLETE" ] && break
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null || fail "the run ended before it could be killed"
wait "$pid" 2>/dev/null || true
train_tiny "$work/crashed" "$work/corpus" 12 --checkpoint.interval=4 > "$work/resume.log"
grep -q "start: resumed from" "$work/resume.log" || fail "the second run did not resume"
losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1])))' "$1"; }
[ "$(losses "$work/straight/metrics.jsonl")" = "$(losses "$work/crashed/metrics.jsonl")" ] ||
  fail "the resumed losses differ from the uninterrupted run's"
pass "$(grep -o 'resumed from [^ ]*' "$work/resume.log"); 12 losses equal bit for bit"
