#!/usr/bin/env bash
# The command-line contract: every subcommand answers --help with exit 0; an unbuilt
# one says so on stderr and exits non-zero; unknown commands fail; --version reports
# the CUDA build flag; every config under configs/ plans.
set -u
bin="$1"
fail=0
check() {  # check <description> <expected-exit> <command...>
  local what="$1" want="$2"; shift 2
  "$@" >/tmp/moetrain-cli.out 2>/tmp/moetrain-cli.err
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: exit $got, expected $want"; cat /tmp/moetrain-cli.err; fail=1
  fi
}
for c in train eval encode tokenize export-hf generate plan; do
  check "$c --help" 0 "$bin" "$c" --help
  grep -q "usage: moetrain $c" /tmp/moetrain-cli.out || { echo "FAIL: $c --help prints no usage line"; fail=1; }
done
check "--help" 0 "$bin" --help
check "no command" 2 "$bin"
check "unknown command" 2 "$bin" frobnicate
grep -q "unknown command 'frobnicate'" /tmp/moetrain-cli.err || { echo "FAIL: unknown command not named"; fail=1; }
check "--version" 0 "$bin" --version
grep -Eq "^cuda: (built in|not built in)" /tmp/moetrain-cli.out || { echo "FAIL: --version does not report cuda"; fail=1; }
# A command run without its inputs fails (exit 1) and names what is missing.
for pair in "train:model.config is not set" "eval:--model is required" "encode:--tokenizer is required" \
            "tokenize:--tokenizer is required" "export-hf:--checkpoint is required" "generate:--model is required" \
            "plan:model.config is not set"; do
  c="${pair%%:*}"
  "$bin" "$c" </dev/null >/dev/null 2>/tmp/moetrain-cli.err
  rc=$?
  if [ "$rc" != 1 ] || ! grep -q -- "${pair#*:}" /tmp/moetrain-cli.err; then
    echo "FAIL: $c without inputs: exit $rc, stderr: $(head -c 300 /tmp/moetrain-cli.err)"; fail=1
  fi
done
# Every shipped config plans (run from the repository root, as its paths are written).
bin="$(realpath "$bin")"
cd "$(dirname "$0")/.." || exit 1
for cfg in configs/*.toml; do
  check "plan --config $cfg" 0 "$bin" plan --config "$cfg"
  grep -q "total" /tmp/moetrain-cli.out || { echo "FAIL: plan of $cfg prints no total"; fail=1; }
done
[ $fail = 0 ] && echo "cli: all checks passed"
exit $fail
