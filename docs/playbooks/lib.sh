# Sourced by every playbook script: the moetrain binary (the script's first argument,
# else $MOETRAIN, else build/moetrain), a scratch folder removed at exit, a tiny model
# and corpus, and the PASS/FAIL line each script ends with.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="$(realpath "${1:-${MOETRAIN:-$root/build/moetrain}}" 2>/dev/null || true)"
name="$(basename "$0" .sh)"
said=0
pass() { said=1; echo "PASS: $name: $*"; exit 0; }
fail() { said=1; echo "FAIL: $name: $*"; exit 1; }
[ -x "$bin" ] || fail "no moetrain binary at ${1:-${MOETRAIN:-$root/build/moetrain}} (build it: make build)"
work="$(mktemp -d "${TMPDIR:-/tmp}/moetrain-$name.XXXXXX")"
trap 'rc=$?; rm -rf "$work"; [ $rc = 0 ] || [ $said = 1 ] || echo "FAIL: $name: a step above exited $rc"' EXIT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# A 2-layer Qwen3-style MoE (4 experts, top-2) over the bundled 4096-token tokenizer.
tiny_model() {
  mkdir -p "$1"
  sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
      -e 's/"num_experts": 8/"num_experts": 4/' "$root/configs/demo/config.json" > "$1/config.json"
}

# Two jsonl files of short documents, one compressed with zstd.
tiny_text() {
  mkdir -p "$1"
  local i
  for i in $(seq 1 60); do
    echo "{\"text\": \"Document $i. The river runs to the sea, and the sea gives back the rain. Count $i, then $((i + 1)).\"}"
  done > "$1/a.jsonl"
  for i in $(seq 1 60); do
    echo "{\"text\": \"Note $i: a small model learns the shape of its data before it learns the data.\"}"
  done | zstd -q -o "$1/b.jsonl.zst"
}

# The loss of metrics.jsonl's first and last lines: "first last".
first_last_loss() {
  python3 -c 'import json,sys; l=[json.loads(x) for x in open(sys.argv[1])]; print(l[0]["loss"], l[-1]["loss"])' "$1"
}

# Train the tiny model on a corpus: train_tiny RUN CORPUS STEPS [overrides...]. In the
# background, `as=exec train_tiny ... &` makes the job moetrain itself, so that a kill of
# $! kills the run (not only the subshell around it, leaving the run going on).
train_tiny() {
  local run="$1" corpus="$2" steps="$3"; shift 3
  ${as:-} "$bin" train --model.config="$work/model/config.json" --data.corpus="$corpus" --data.seq_len=32 \
    --training.global_batch_size=4 --training.steps="$steps" --optimizer.lr=3e-3 \
    --lr_scheduler.warmup_steps=2 --job.dump_folder="$run" "$@"
}
