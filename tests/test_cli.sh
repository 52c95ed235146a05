#!/usr/bin/env bash
# The command-line contract: every subcommand answers --help with exit 0; an unbuilt
# one says so on stderr and exits non-zero; unknown commands fail; --version reports
# the CUDA build flag; the OpenMP defaults hold; every config under configs/ plans.
set -u
bin="$1"
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
for c in train eval encode tokenize export-hf plan; do
  check "$c --help" 0 "$bin" "$c" --help
  grep -q "usage: moetrain $c" $tmp/cli.out || { echo "FAIL: $c --help prints no usage line"; fail=1; }
done
check "--help" 0 "$bin" --help
check "no command" 2 "$bin"
check "unknown command" 2 "$bin" frobnicate
grep -q "unknown command 'frobnicate'" $tmp/cli.err || { echo "FAIL: unknown command not named"; fail=1; }
check "--version" 0 "$bin" --version
grep -Eq "^cuda: (built in|not built in)" $tmp/cli.out || { echo "FAIL: --version does not report cuda"; fail=1; }
# OpenMP defaults: idle threads sleep (libgomp's spin count 0) and each of mpirun's ranks
# on a host gets cores / ranks threads; what the user sets wins. omp VAR [ENV...] prints
# what libgomp last read for VAR (OMP_DISPLAY_ENV; the binary may run itself again).
omp() {
  local var="$1"; shift
  env -u OMP_WAIT_POLICY -u OMP_NUM_THREADS OMP_DISPLAY_ENV=verbose "$@" "$bin" --version 2>&1 >/dev/null |
    sed -n "s/^ *$var = '\(.*\)'/\1/p" | tail -n 1
}
[ "$(omp GOMP_SPINCOUNT)" = 0 ] || { echo "FAIL: idle OpenMP threads spin by default"; fail=1; }
[ "$(omp GOMP_SPINCOUNT OMP_WAIT_POLICY=active)" != 0 ] || { echo "FAIL: OMP_WAIT_POLICY=active ignored"; fail=1; }
want=$(( $(getconf _NPROCESSORS_ONLN) / 2 )); [ "$want" -gt "$(nproc)" ] && want=$(nproc); [ "$want" -lt 1 ] && want=1
[ "$(omp OMP_NUM_THREADS OMPI_COMM_WORLD_LOCAL_SIZE=2)" = "$want" ] ||
  { echo "FAIL: 2 ranks on a host do not get $want threads each"; fail=1; }
[ "$(omp OMP_NUM_THREADS OMPI_COMM_WORLD_LOCAL_SIZE=2 OMP_NUM_THREADS=3)" = 3 ] ||
  { echo "FAIL: OMP_NUM_THREADS=3 ignored under mpirun"; fail=1; }
# A command run without its inputs fails (exit 1) and names what is missing.
for pair in "train:model.config is not set" "eval:--model is required" "encode:--tokenizer is required" \
            "tokenize:--tokenizer is required" "export-hf:--checkpoint is required" "plan:model.config is not set"; do
  c="${pair%%:*}"
  "$bin" "$c" </dev/null >/dev/null 2>$tmp/cli.err
  rc=$?
  if [ "$rc" != 1 ] || ! grep -q -- "${pair#*:}" $tmp/cli.err; then
    echo "FAIL: $c without inputs: exit $rc, stderr: $(head -c 300 $tmp/cli.err)"; fail=1
  fi
done
# Every shipped config plans (run from the repository root, as its paths are written).
bin="$(realpath "$bin")"
cd "$(dirname "$0")/.." || exit 1
for cfg in configs/*.toml; do
  check "plan --config $cfg" 0 "$bin" plan --config "$cfg"
  grep -q "total" $tmp/cli.out || { echo "FAIL: plan of $cfg prints no total"; fail=1; }
done
[ $fail = 0 ] && echo "cli: all checks passed"
exit $fail
