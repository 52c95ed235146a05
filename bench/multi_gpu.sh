#!/usr/bin/env bash
# The multi-GPU issue's runs, one command each, in the order of their value, for a machine
# of GPUS GPUs (2, 4 or 8; source bench/device_env.sh first). Each prints the rows that go
# to bench/RESULTS.md.
#
#   bench/multi_gpu.sh BIN GPUS correctness|full|scaling|replicas|offload [FLAGS]
#
# FLAGS go to bench/moe_bench.py for full and scaling, to moetrain itself for replicas and
# offload, and are not taken by correctness.
# correctness  bench/gpu_suite.sh's mesh checks with meshes of up to GPUS ranks (its header
#              lists them: dp/cp/ep, zero3, both pipeline schedules, replicas, each
#              recompute mode, the offload tiers, the balance terms and FP8).
# full         the whole Qwen3-30B-A3B (48 layers), seq 4096, 8 micro-batches of 2 a data
#              rank, on ep GPUS, then pp x ep meshes down to pp GPUS (DualPipeV and 1F1B),
#              each after `moetrain plan`'s memory for its mesh.
# scaling      8 layers at a fixed batch a GPU, ep = 1, 2, .. GPUS.
# replicas     8 layers at ep GPUS, expert_replicas 0 and 2 (for trained routing pass
#              --model.init=hf:DIR of a trained checkpoint).
# offload      the 48-layer model at ep GPUS with offload.experts = optimizer, then weights.
set -uo pipefail
bin="$1" gpus="$2" run="$3"
shift 3
bench() { python3 bench/moe_bench.py --moetrain "$bin" --skip-baseline --learned-only "$@"; }
full_config=bench/configs/qwen3_30b_a3b.json
case "$run" in
  correctness)
    bash bench/gpu_suite.sh "$bin" --ranks "$gpus" --only '^(meshes|zero3|pipeline|replicas|recompute|offload|balance|fp8)'
    ;;
  full)
    pp=1
    while [ "$pp" -le "$gpus" ]; do
      ep=$((gpus / pp))
      "$bin" plan --model.config="$full_config" --data.seq_len=4096 --training.device=cuda --world "$gpus" \
        --parallelism.pp="$pp" --parallelism.ep="$ep" --training.micro_batch_size=$([ "$pp" -gt 1 ] && echo 1 || echo 2) \
        --training.global_batch_size=$((16 * gpus / pp)) | grep -E "^mesh|total"
      for schedule in $([ "$pp" -gt 1 ] && echo "dualpipev 1f1b" || echo "dualpipev"); do
        bench --layers 48 --ranks "$gpus" --pp "$pp" --ep "$ep" --schedule "$schedule" "$@"
      done
      pp=$((pp * 2))
    done
    ;;
  scaling)
    e=1
    while [ "$e" -le "$gpus" ]; do bench --layers 8 --ranks "$e" --ep "$e" "$@"; e=$((e * 2)); done
    ;;
  replicas)
    for r in 0 2; do bench --layers 8 --ranks "$gpus" --ep "$gpus" --extra="--parallelism.expert_replicas=$r $*"; done
    ;;
  offload)
    for tier in optimizer weights; do
      bench --layers 48 --ranks "$gpus" --ep "$gpus" --extra="--offload.experts=$tier $*"
    done
    ;;
  *)
    echo "multi_gpu.sh: unknown run '$run' (correctness, full, scaling, replicas or offload)" >&2
    exit 2
    ;;
esac
