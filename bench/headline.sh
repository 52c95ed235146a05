#!/usr/bin/env bash
# The speed issue's headline rows in one call on the GPU machine: each family at the real
# batch (8 micro-batches of 2 x 4096), transformers torch.compile then moetrain bf16 and
# fp8 with fp32 moments, learned routing. 8 layers need an H200 (Qwen3 holds ~116 GB);
# on an 80 GB card pass 4 and the 4-layer cuts run instead.
#
#   bench/headline.sh BIN [LAYERS] [qwen3|deepseek|gpt-oss ...] [-- moe_bench.py flags]
#
# The rows it prints are bench/RESULTS.md's; set MOETRAIN_COMMIT to name the commit.
# GPT-OSS runs without transformers (its eager attention does not fit at 4 layers).
set -uo pipefail
bin="$1"
layers="${2:-8}"
shift 2 || shift $#
models=() extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then shift; extra=("$@"); break; fi
  models+=("$1"); shift
done
[ ${#models[@]} -eq 0 ] && models=(qwen3 deepseek)
for m in "${models[@]}"; do
  case "$m" in
    qwen3) model=(--layers "$layers") baseline=(--skip-eager) ;;
    deepseek) model=(--config "bench/configs/deepseek_v2_lite_${layers}l.json") baseline=(--skip-eager) ;;
    gpt-oss) model=(--config "bench/configs/gpt_oss_20b_${layers}l.json") baseline=(--skip-baseline) ;;
    *) echo "headline.sh: unknown model '$m' (qwen3, deepseek or gpt-oss)" >&2; exit 2 ;;
  esac
  if [ "$m" != qwen3 ] && [ ! -f "${model[1]}" ]; then
    echo "headline.sh: no ${model[1]} for $m at $layers layers" >&2
    exit 2
  fi
  echo "== $m, $layers layers"
  python3 bench/moe_bench.py --moetrain "$bin" "${model[@]}" "${baseline[@]}" --learned-only --fp8 none,blockwise "${extra[@]}"
done
