// Attention at Qwen3-30B-A3B's shape (B=2, T=4096, Hq=32, Hkv=4, D=128, causal, bf16) on
// both GPU routes: cuDNN's fused SDPA and our mma.sync kernel (kernels/cuda/attention_cudnn.h).
// Times the forward and the forward+backward, each the median of 20 runs after 3 warm-ups,
// with CUDA events on the backend's stream, and prints TFLOPS from the causal FLOPs:
// forward 2 products of 2*B*Hq*T*T*D, halved by the mask; backward 2.5 times that.
// Then prints how far apart the two routes' results are (max |difference| of out, lse,
// dq, dk, dv); the GPU op tests compare each route with the CPU.
//
//   attention_bench [T]      (T defaults to 4096)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/runtime.h"
#include "bench_util.h"

namespace {

using namespace mt;
using bench::Buffer;
using bench::download;
using bench::fill_random;

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

double median_ms(const std::function<void()>& f) {
  return bench::median_ms(20, [&](int) { f(); });
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "attention_bench: no CUDA device\n");
    return 1;
  }
  const int64_t b = 2, t = argc > 1 ? std::atoll(argv[1]) : 4096, hq = 32, hkv = 4, d = 128;
  if (t <= 0) {
    std::fprintf(stderr, "attention_bench: T must be a positive integer, got '%s'\n", argv[1]);
    return 1;
  }
  try {
    const Shape qs{b, t, hq, d}, ks{b, t, hkv, d}, ls{b, hq, t};
    Buffer q(DType::bf16, qs), k(DType::bf16, ks), v(DType::bf16, ks), dout(DType::bf16, qs);
    fill_random(q.t, -2.0f, 2.0f, 1);
    fill_random(k.t, -1.0f, 1.0f, 2);
    fill_random(v.t, -1.0f, 1.0f, 3);
    fill_random(dout.t, -1.0f, 1.0f, 4);
    cpu::AttentionArgs a;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));

    const double fwd_flops = 2.0 * 2.0 * b * hq * t * t * d / 2;
    const double train_flops = 3.5 * fwd_flops;  // forward + backward (2.5x forward)
    std::printf("attention B=%ld T=%ld Hq=%ld Hkv=%ld D=%ld causal bf16\n", static_cast<long>(b),
                static_cast<long>(t), static_cast<long>(hq), static_cast<long>(hkv), static_cast<long>(d));
    std::vector<std::vector<float>> results[2];
    for (const bool use_cudnn : {true, false}) {
      cuda::set_attention_cudnn(use_cudnn);
      Buffer out(DType::bf16, qs), lse(DType::f32, ls), dq(DType::bf16, qs), dk(DType::bf16, ks),
          dv(DType::bf16, ks);
      auto fwd = [&] { mt::attention_forward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t); };
      auto train = [&] {
        fwd();
        mt::attention_backward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t, dout.t, dq.t, dk.t, dv.t, Tensor());
      };
      const int64_t calls = cuda::attention_cudnn_calls();
      const double fwd_ms = median_ms(fwd);
      const double train_ms = median_ms(train);
      const bool ran_cudnn = cuda::attention_cudnn_calls() > calls;
      std::printf("  %-7s forward %8.3f ms %7.1f TFLOPS | forward+backward %8.3f ms %7.1f TFLOPS%s\n",
                  use_cudnn ? "cuDNN" : "kernel", fwd_ms, fwd_flops / fwd_ms / 1e9, train_ms,
                  train_flops / train_ms / 1e9,
                  use_cudnn && !ran_cudnn ? "  (cuDNN declined: these are the kernel's)" : "");
      results[use_cudnn ? 0 : 1] = {download(out.t), download(lse.t), download(dq.t), download(dk.t),
                                    download(dv.t)};
    }
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    std::printf("  max |cuDNN - kernel|:");
    for (size_t i = 0; i < 5; ++i) std::printf(" %s %.2e", names[i], max_diff(results[0][i], results[1][i]));
    std::printf("\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
