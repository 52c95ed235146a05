#!/usr/bin/env bash
# The command-line contract: every subcommand answers --help with exit 0; an unbuilt
# one says so on stderr and exits non-zero; unknown commands fail; --version reports
# the CUDA build flag; train --help lists every key and --print-config the resolved
# config; errors lead with the message (the source place only with --verbose); every
# config under configs/ plans from another working folder; the OpenMP defaults hold.
set -u
bin="$1"
here="$(cd "$(dirname "$0")" && pwd)"
fail=0
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
check() {  # check <description> <expected-exit> <command...>
  local what="$1" want="$2"; shift 2
  "$@" >$tmp/cli.out 2>$tmp/cli.err
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: exit $got, expected $want"; cat $tmp/cli.err; fail=1
  fi
}
for c in train eval encode tokenize export-hf generate plan; do
  check "$c --help" 0 "$bin" "$c" --help
  grep -q "usage: moetrain $c" $tmp/cli.out || { echo "FAIL: $c --help prints no usage line"; fail=1; }
done
check "--help" 0 "$bin" --help
check "no command" 2 "$bin"
check "unknown command" 2 "$bin" frobnicate
grep -q "unknown command 'frobnicate'" $tmp/cli.err || { echo "FAIL: unknown command not named"; fail=1; }
check "--version" 0 "$bin" --version
grep -Eq "^cuda: (built in|not built in)" $tmp/cli.out || { echo "FAIL: --version does not report cuda"; fail=1; }
no_gpu=0
grep -Eq "^cuda: not built in|^cuda devices: none" $tmp/cli.out && no_gpu=1
if grep -q "^cuda devices: none" $tmp/cli.out && ! grep -q "no usable GPU" $tmp/cli.out; then
  echo "FAIL: --version without a device does not say there is no usable GPU: $(cat $tmp/cli.out)"; fail=1
fi
# OpenMP defaults: idle threads sleep (libgomp's spin count 0) and each of mpirun's ranks
# on a host gets cores / ranks threads; what the user sets wins. omp VAR [ENV...] prints
# what libgomp last read for VAR (OMP_DISPLAY_ENV; the binary may run itself again).
omp() {
  local var="$1"; shift
  env -u OMP_WAIT_POLICY -u OMP_NUM_THREADS OMP_DISPLAY_ENV=verbose "$@" "$bin" --version 2>&1 >/dev/null |
    sed -n "s/^ *$var = '\(.*\)'/\1/p" | tail -n 1
}
# libgomp (GCC's OpenMP, what moetrain ships with) only: `make sanitize` builds with clang,
# whose libomp reads and shows its settings otherwise.
if ldd "$bin" | grep -q libgomp; then
  [ "$(omp GOMP_SPINCOUNT)" = 0 ] || { echo "FAIL: idle OpenMP threads spin by default"; fail=1; }
  [ "$(omp GOMP_SPINCOUNT OMP_WAIT_POLICY=active)" != 0 ] || { echo "FAIL: OMP_WAIT_POLICY=active ignored"; fail=1; }
  want=$(( $(getconf _NPROCESSORS_ONLN) / 2 )); [ "$want" -gt "$(nproc)" ] && want=$(nproc); [ "$want" -lt 1 ] && want=1
  [ "$(omp OMP_NUM_THREADS OMPI_COMM_WORLD_LOCAL_SIZE=2)" = "$want" ] ||
    { echo "FAIL: 2 ranks on a host do not get $want threads each"; fail=1; }
  [ "$(omp OMP_NUM_THREADS OMPI_COMM_WORLD_LOCAL_SIZE=2 OMP_NUM_THREADS=3)" = 3 ] ||
    { echo "FAIL: OMP_NUM_THREADS=3 ignored under mpirun"; fail=1; }
else
  echo "note: $bin does not use libgomp; the OpenMP thread defaults are not checked"
fi
# train --help: every key with its type, default and meaning (a sample of each kind).
check "train --help" 0 "$bin" train --help
for line in "optimizer.state_dtype +string +'fp32' +AdamW's moments" "data.tokens +path +'' +a .npy" \
            "training.steps +integer +10 +optimizer steps" "optimizer.lr +number +3e-04 +the peak learning rate" \
            "metrics.tensorboard +bool +false +also write TensorBoard event files to job.dump_folder/tb"; do
  grep -Eq "^  $line" $tmp/cli.out || { echo "FAIL: train --help lacks '$line'"; fail=1; }
done
# --print-config: the resolved config (overrides applied), exit 0, nothing trained or written.
check "train --print-config" 0 "$bin" train --print-config --optimizer.lr=1e-3 --job.dump_folder=/nonexistent/run
grep -q "^lr = 0.001$" $tmp/cli.out && grep -q "^\[checkpoint\]$" $tmp/cli.out ||
  { echo "FAIL: --print-config: $(head -c 300 $tmp/cli.out)"; fail=1; }
[ -e /nonexistent/run ] && { echo "FAIL: --print-config created the run folder"; fail=1; }
# Errors: the message first, with a suggestion; the source place only with --verbose.
check "unknown key" 1 "$bin" train --optimizer.lrr=1
grep -q "^moetrain train: error: unknown option --optimizer.lrr: no such config key; did you mean --optimizer.lr?" \
  $tmp/cli.err && ! grep -q "src/" $tmp/cli.err ||
  { echo "FAIL: unknown key: $(cat $tmp/cli.err)"; fail=1; }
check "unknown key --verbose" 1 "$bin" train --optimizer.lrr=1 --verbose
grep -q "^  (check .* failed at src/train/config.cpp:[0-9]*)$" $tmp/cli.err ||
  { echo "FAIL: --verbose shows no source place: $(cat $tmp/cli.err)"; fail=1; }
if [ $no_gpu = 1 ]; then
  check "train on cuda without a GPU" 1 "$bin" train --training.device=cuda --model.config="$(dirname "$0")/../configs/demo/config.json"
  grep -q "training.device = cuda, but there is no usable GPU" $tmp/cli.err ||
    { echo "FAIL: no GPU: $(cat $tmp/cli.err)"; fail=1; }
  check "generate on cuda without a GPU" 1 "$bin" generate --model "$here/fixtures/qwen3_moe_a" --prompt-ids 1,2 \
    --device cuda
  grep -q "^moetrain generate: error: --device cuda, but there is no usable GPU" $tmp/cli.err ||
    { echo "FAIL: generate without a GPU: $(cat $tmp/cli.err)"; fail=1; }
fi
# A command run without its inputs fails (exit 1) and names what is missing.
for pair in "train:model.config is not set" "eval:--model is required" "encode:--tokenizer is required" \
            "tokenize:--tokenizer is required" "export-hf:--checkpoint is required" "generate:--model is required" \
            "plan:model.config is not set"; do
  c="${pair%%:*}"
  "$bin" "$c" </dev/null >/dev/null 2>$tmp/cli.err
  rc=$?
  if [ "$rc" != 1 ] || ! grep -q -- "${pair#*:}" $tmp/cli.err; then
    echo "FAIL: $c without inputs: exit $rc, stderr: $(head -c 300 $tmp/cli.err)"; fail=1
  fi
done
# Numbers in flags: a value that is not a number, or is out of range, names the flag and
# the range (stoll threw a bare out_of_range on 20 digits; --world 0 divided by zero).
for pair in "generate --model . --top-p 2:--top-p should be a number in [1e-09, 1], got '2'" \
            "generate --model . --max-new-tokens 3x:--max-new-tokens should be an integer in [0, 16777216], got '3x'" \
            "export-hf --checkpoint . --output x --max-shard-size 99999999999999999999GB:--max-shard-size should look like 5GB" \
            "export-hf --checkpoint . --output x --max-shard-size 2000000TB:--max-shard-size should look like 5GB" \
            "plan --config $(dirname "$0")/../configs/demo.toml --world 0:--world should be an integer in [1, 1048576], got '0'"; do
  # shellcheck disable=SC2086  # the command's words
  "$bin" ${pair%%:*} >/dev/null 2>$tmp/cli.err
  rc=$?
  if [ "$rc" != 1 ] || ! grep -qF -- "${pair#*:}" $tmp/cli.err; then
    echo "FAIL: ${pair%%:*}: exit $rc, stderr: $(head -c 300 $tmp/cli.err)"; fail=1
  fi
done
# Every shipped config plans from another working folder: its paths are taken against
# the config file's folder.
bin="$(realpath "$bin")"
configs="$(realpath "$(dirname "$0")/../configs")"
cd / || exit 1
for cfg in "$configs"/*.toml; do
  check "plan --config $cfg" 0 "$bin" plan --config "$cfg"
  grep -q "total" $tmp/cli.out || { echo "FAIL: plan of $cfg prints no total"; fail=1; }
done
# tokenize over lines none of which has the text field (a misspelled --field) is an
# error naming the field, not a corpus of nothing.
mkdir -p "$tmp/notext"
printf '{"body": "one"}\n{"body": "two"}\n' > "$tmp/notext/a.jsonl"
check "tokenize without the field" 1 "$bin" tokenize --tokenizer "$here/fixtures/tokenizers/gpt2_style.json" \
  --input "$tmp/notext/a.jsonl" --output "$tmp/notext/out" --workers 1
grep -q 'no document was found: all 2 lines were skipped (see above); is the JSON field holding the text "text"' \
  $tmp/cli.err || { echo "FAIL: tokenize without the field: $(cat $tmp/cli.err)"; fail=1; }
[ $fail = 0 ] && echo "cli: all checks passed"
exit $fail
