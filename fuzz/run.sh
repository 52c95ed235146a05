#!/usr/bin/env bash
# Runs the fuzz targets of a `make sanitize` build: fuzz/run.sh BUILD SECONDS [TARGET...]
# (all seven by default), as many at once as there are cores, each for SECONDS.
# Each grows its own corpus in BUILD/fuzz/corpus/<target> from the seeds in
# fuzz/corpus/<target> (which stay as committed); a crash, sanitizer report, leak,
# input slower than 10 s or over 2 GB of memory is saved in BUILD/fuzz/artifacts/ and
# fails the run. Prints one line per target: executions, coverage, corpus size.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="$(cd "${1:?usage: fuzz/run.sh BUILD SECONDS [TARGET...]}" && pwd)"
seconds="${2:?usage: fuzz/run.sh BUILD SECONDS [TARGET...]}"
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors npy corpus_bin train_state config_toml hf_config tokenizer)
jobs="${FUZZ_JOBS:-$(nproc)}"

run_one() {
  local t="$1" bin="$build/fuzz/fuzz_$1" corpus="$build/fuzz/corpus/$1" art="$build/fuzz/artifacts/$1/"
  [ -x "$bin" ] || { echo "fuzz: $bin missing: build with make sanitize first" >"$build/fuzz/$t.log"; return 1; }
  mkdir -p "$corpus" "$art"
  # Leaks are findings (detect_leaks); one worker, so the figures are per core.
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" "$bin" "$corpus" "$here/corpus/$t" -max_total_time="$seconds" \
    -timeout=10 -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1 -artifact_prefix="$art" >"$build/fuzz/$t.log" 2>&1
}

mkdir -p "$build/fuzz"
declare -A pid_of
failed=0
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
  run_one "$t" &
  pid_of[$t]=$!
  running=$((running + 1))
done
for t in "${targets[@]}"; do
  if wait "${pid_of[$t]}"; then result=ok; else result=FAILED; failed=1; fi
  log="$build/fuzz/$t.log"
  execs=$(grep -o 'number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$')
  speed=$(grep -o 'average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$')
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1)
  printf 'fuzz %-12s %-6s %10s execs  %6s/s  %-22s corpus %s files\n' "$t" "$result" "${execs:-?}" "${speed:-?}" \
    "${cov:-?}" "$(find "$build/fuzz/corpus/$t" -type f 2>/dev/null | wc -l)"
  if [ "$result" = FAILED ]; then
    echo "---- $log (last 40 lines); the input that failed is in $build/fuzz/artifacts/$t/"
    tail -40 "$log"
  fi
done
exit "$failed"
