// AdamW on the host (OpenMP over the cores) at one Qwen3-30B-A3B layer's routed experts:
// the alternative to offload.experts = optimizer's streamed update (train/offload.h),
// which moves 24 bytes a parameter over PCIe (12 in, 12 out) and updates on the GPU.
// On the host the update needs only the gradients down (4 bytes) and the bf16 copies
// up (2), but runs at the host's memory bandwidth. Prints, per layer, the host update
// (AdamW, then the bf16 copy) and the two PCIe legs at the measured 55 GB/s.
//
//   adamw_host_bench [elements = 603979776] [reps = 3]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/arena.h"
#include "kernels/adamw.h"
#include "kernels/elementwise.h"
#include "train/offload.h"

int main(int argc, char** argv) {
  using namespace mt;
  // 128 experts of gate_up [1536, 2048] and down [2048, 768].
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : int64_t{128} * 3 * 2048 * 768;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  std::printf("host AdamW over %lld elements (one Qwen3-30B-A3B layer's experts), %d OpenMP threads\n",
              static_cast<long long>(n), omp_get_max_threads());
  for (DType state : {DType::f32, DType::bf16}) {
    Arena a("bench", Device::cpu, static_cast<size_t>(n) * (4 + 4 + 2 + 2 * dtype_size(state)) + 4096);
    const Tensor p = a.alloc(DType::f32, {n}), g = a.alloc(DType::f32, {n}), c = a.alloc(DType::bf16, {n});
    const Tensor m = a.alloc(state, {n}), v = a.alloc(state, {n});
    fill(p, 0.01f);
    fill(g, 0.001f);
    fill(m, 0.0f);
    fill(v, 0.0f);
    cpu::AdamWStep s;
    s.lr = 1e-4;
    s.weight_decay = 0.1;
    double best = 1e30, best_cast = 1e30;
    for (int r = 0; r < reps; ++r) {
      s.step = r + 1;
      const auto t0 = std::chrono::steady_clock::now();
      cpu::adamw_step(p, g, m, v, s, 0);
      const auto t1 = std::chrono::steady_clock::now();
      cpu::cast(p, c);
      const auto t2 = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
      best_cast = std::min(best_cast, std::chrono::duration<double>(t2 - t1).count());
    }
    const double bytes = static_cast<double>(n) * (4 * 3 + 4 * dtype_size(state)), down = 4.0 * n, up = 2.0 * n;
    std::printf("%s moments: AdamW %.1f ms (%.1f GB/s of weights, gradients and moments), bf16 copy %.1f ms; "
                "PCIe gradients down %.1f ms, copies up %.1f ms; the streamed update moves %.1f GB each way "
                "(%.1f ms a direction at 55 GB/s)\n",
                state == DType::f32 ? "f32" : "bf16", 1e3 * best, bytes / best / 1e9, 1e3 * best_cast,
                1e3 * down / kPcieBytesPerSecond, 1e3 * up / kPcieBytesPerSecond,
                static_cast<double>(n) * (4 + 2 * dtype_size(state)) / 1e9,
                1e3 * static_cast<double>(n) * (4 + 2 * dtype_size(state)) / kPcieBytesPerSecond);
  }
  return 0;
}
