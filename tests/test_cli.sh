#!/usr/bin/env bash
# The command-line contract: every subcommand answers --help with exit 0; an unbuilt
# one says so on stderr and exits non-zero; unknown commands fail; --version reports
# the CUDA build flag.
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
for c in train eval encode tokenize export-hf plan; do
  check "$c --help" 0 "$bin" "$c" --help
  grep -q "usage: moetrain $c" /tmp/moetrain-cli.out || { echo "FAIL: $c --help prints no usage line"; fail=1; }
done
check "--help" 0 "$bin" --help
check "no command" 2 "$bin"
check "unknown command" 2 "$bin" frobnicate
grep -q "unknown command 'frobnicate'" /tmp/moetrain-cli.err || { echo "FAIL: unknown command not named"; fail=1; }
check "--version" 0 "$bin" --version
grep -Eq "^cuda: (built in|not built in)" /tmp/moetrain-cli.out || { echo "FAIL: --version does not report cuda"; fail=1; }
# A command that is not built yet must say so and fail; once built it must not say so.
for c in train eval encode tokenize export-hf plan; do
  "$bin" "$c" >/dev/null 2>/tmp/moetrain-cli.err
  rc=$?
  if grep -q "not built yet" /tmp/moetrain-cli.err && [ "$rc" = 0 ]; then
    echo "FAIL: $c says it is not built yet but exits 0"; fail=1
  fi
done
[ $fail = 0 ] && echo "cli: all checks passed"
exit $fail
