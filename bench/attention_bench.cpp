// Attention at Qwen3-30B-A3B's shape (B=2, T=4096, Hq=32, Hkv=4, D=128, causal, bf16), or
// GPT-OSS's (Hq=64, Hkv=8, D=64: plain causal, then with sinks, then sinks and a 128-key
// window), on both GPU routes: cuDNN's fused SDPA and our mma.sync kernel (kernels/cuda/attention_cudnn.h).
// Times the forward and the forward+backward, each the median of 20 runs after 3 warm-ups,
// with CUDA events on the backend's stream, and prints TFLOPS from the causal FLOPs:
// forward 2 products of 2*B*Hq*D a visible (query, key) pair; backward 2.5 times that.
// Then prints how far apart the two routes' results are (max |difference| of out, lse,
// dq, dk, dv); the GPU op tests compare each route with the CPU.
//
// qwen3.5: one Qwen3.5-35B-A3B layer of each kind, the same way: its full attention
// (Hq=16, Hkv=2, D=256) on cuDNN, and its gated DeltaNet's chunked rule (32 value heads
// of 128 x 128, kernels/gated_delta.h) on our kernels, forward and forward+backward, and
// the ratio of the two (the target: the rule within 2x of the attention).
//
//   attention_bench [T] [qwen3|gpt-oss|qwen3.5]      (T defaults to 4096)
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
#include "kernels/gated_delta.h"
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

// One attention shape to time: heads, head dim, window (0: plain causal) and sinks.
struct Shape_ {
  const char* name;
  int64_t hq, hkv, d, window;
  bool sinks;
};

// (query, key) pairs a causal mask leaves visible in T rows, within a window if one is set.
double visible_pairs(int64_t t, int64_t window) {
  const int64_t w = window > 0 ? std::min(window, t) : t;
  return static_cast<double>(w) * (w + 1) / 2 + static_cast<double>(t - w) * w;
}

// Times one shape on both routes and prints how far apart their results are.
void run_shape(int64_t b, int64_t t, const Shape_& c) {
  const Shape qs{b, t, c.hq, c.d}, ks{b, t, c.hkv, c.d}, ls{b, c.hq, t};
  Buffer q(DType::bf16, qs), k(DType::bf16, ks), v(DType::bf16, ks), dout(DType::bf16, qs);
  Buffer sinks(DType::f32, {c.hq}), dsinks(DType::f32, {c.hq});
  fill_random(q.t, -2.0f, 2.0f, 1);
  fill_random(k.t, -1.0f, 1.0f, 2);
  fill_random(v.t, -1.0f, 1.0f, 3);
  fill_random(dout.t, -1.0f, 1.0f, 4);
  fill_random(sinks.t, -1.0f, 2.0f, 5);
  fill_random(dsinks.t, -1.0f, 1.0f, 6);  // an accumulator: any start will do
  const Tensor sinks_t = c.sinks ? sinks.t : Tensor(), dsinks_t = c.sinks ? dsinks.t : Tensor();
  cpu::AttentionArgs a;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  a.window = c.window;

  const double fwd_flops = 2.0 * 2.0 * b * c.hq * visible_pairs(t, c.window) * c.d;
  const double train_flops = 3.5 * fwd_flops;  // forward + backward (2.5x forward)
  std::printf("attention %s: B=%ld T=%ld Hq=%ld Hkv=%ld D=%ld causal%s%s bf16\n", c.name, static_cast<long>(b),
              static_cast<long>(t), static_cast<long>(c.hq), static_cast<long>(c.hkv), static_cast<long>(c.d),
              c.window > 0 ? (" window " + std::to_string(c.window)).c_str() : "", c.sinks ? " sinks" : "");
  std::vector<std::vector<float>> results[2];
  for (const bool use_cudnn : {true, false}) {
    cuda::set_attention_cudnn(use_cudnn);
    Buffer out(DType::bf16, qs), lse(DType::f32, ls), dq(DType::bf16, qs), dk(DType::bf16, ks), dv(DType::bf16, ks);
    auto fwd = [&] { mt::attention_forward(q.t, k.t, v.t, sinks_t, a, out.t, lse.t); };
    auto train = [&] {
      fwd();
      mt::attention_backward(q.t, k.t, v.t, sinks_t, a, out.t, lse.t, dout.t, dq.t, dk.t, dv.t, dsinks_t);
    };
    const int64_t calls = cuda::attention_cudnn_calls();
    const double fwd_ms = median_ms(fwd);
    const double train_ms = median_ms(train);
    const bool ran_cudnn = cuda::attention_cudnn_calls() > calls;
    std::printf("  %-7s forward %8.3f ms %7.1f TFLOPS | forward+backward %8.3f ms %7.1f TFLOPS%s\n",
                use_cudnn ? "cuDNN" : "kernel", fwd_ms, fwd_flops / fwd_ms / 1e9, train_ms, train_flops / train_ms / 1e9,
                use_cudnn && !ran_cudnn ? "  (cuDNN declined: these are the kernel's)" : "");
    results[use_cudnn ? 0 : 1] = {download(out.t), download(lse.t), download(dq.t), download(dk.t), download(dv.t)};
  }
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  std::printf("  max |cuDNN - kernel|:");
  for (size_t i = 0; i < 5; ++i) std::printf(" %s %.2e", names[i], max_diff(results[0][i], results[1][i]));
  std::printf("\n");
}

// The gated delta rule at Qwen3.5-35B-A3B's linear-attention shape against cuDNN's
// attention at its full-attention shape, both bf16, B x T tokens.
void run_qwen35(int64_t b, int64_t t) {
  const int64_t hq = 16, hkv = 2, d = 256, h = 32, dk = 128, dv = 128;
  const Shape qs{b, t, hq, d}, ks{b, t, hkv, d}, ls{b, hq, t};
  cuda::set_attention_cudnn(true);
  Buffer q(DType::bf16, qs), k(DType::bf16, ks), v(DType::bf16, ks), dout(DType::bf16, qs);
  fill_random(q.t, -2.0f, 2.0f, 1);
  fill_random(k.t, -1.0f, 1.0f, 2);
  fill_random(v.t, -1.0f, 1.0f, 3);
  fill_random(dout.t, -1.0f, 1.0f, 4);
  cpu::AttentionArgs a;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  Buffer out(DType::bf16, qs), lse(DType::f32, ls), dq(DType::bf16, qs), dk_(DType::bf16, ks), dv_(DType::bf16, ks);
  auto afwd = [&] { mt::attention_forward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t); };
  auto atrain = [&] {
    afwd();
    mt::attention_backward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t, dout.t, dq.t, dk_.t, dv_.t, Tensor());
  };
  const int64_t calls = cuda::attention_cudnn_calls();
  const double afwd_ms = median_ms(afwd), atrain_ms = median_ms(atrain);
  const double flops = 2.0 * 2.0 * b * hq * visible_pairs(t, 0) * d;
  std::printf("Qwen3.5-35B-A3B layers: B=%ld T=%ld bf16\n", static_cast<long>(b), static_cast<long>(t));
  std::printf("  full attention (Hq=16 Hkv=2 D=256, %s): forward %8.3f ms %7.1f TFLOPS | forward+backward %8.3f ms "
              "%7.1f TFLOPS\n",
              cuda::attention_cudnn_calls() > calls ? "cuDNN" : "our kernel: cuDNN declined", afwd_ms,
              flops / afwd_ms / 1e9, atrain_ms, 3.5 * flops / atrain_ms / 1e9);
  // The rule's inputs as the mixer makes them: unit key rows (q also times 1 / sqrt(Dk)
  // in the model; the scale does not change the work), decays and betas in range.
  const Shape rq{b, t, h, dk}, rv{b, t, h, dv}, rs{b, t, h};
  Buffer rq_(DType::bf16, rq), rk(DType::bf16, rq), rv_(DType::bf16, rv), rdo(DType::bf16, rv), g(DType::f32, rs),
      beta(DType::f32, rs);
  fill_random(rq_.t, -0.09f, 0.09f, 5);  // |row| about 0.6
  fill_random(rk.t, -0.15f, 0.15f, 6);   // about 1
  fill_random(rv_.t, -1.0f, 1.0f, 7);
  fill_random(rdo.t, -1.0f, 1.0f, 8);
  fill_random(g.t, -0.5f, -0.01f, 9);
  fill_random(beta.t, 0.05f, 0.95f, 10);
  Buffer o(DType::bf16, rv), gq(DType::bf16, rq), gk(DType::bf16, rq), gv(DType::bf16, rv), gg(DType::f32, rs),
      gb(DType::f32, rs);
  auto rfwd = [&] { mt::gated_delta_forward(rq_.t, rk.t, rv_.t, g.t, beta.t, Tensor(), o.t, Tensor()); };
  auto rtrain = [&] {
    rfwd();
    mt::gated_delta_backward(rq_.t, rk.t, rv_.t, g.t, beta.t, Tensor(), rdo.t, Tensor(), gq.t, gk.t, gv.t, gg.t, gb.t,
                             Tensor());
  };
  for (const bool tc : {false, true}) {
    cuda::set_gated_delta_tensor_cores(tc);
    const double rfwd_ms = median_ms(rfwd), rtrain_ms = median_ms(rtrain);
    std::printf("  gated delta rule (H=32 Dk=Dv=128, chunks of 64, %s): forward %8.3f ms | forward+backward "
                "%8.3f ms; rule / attention: forward %.2fx, forward+backward %.2fx\n",
                tc ? "tensor cores, tf32" : "SIMT f32", rfwd_ms, rtrain_ms, rfwd_ms / afwd_ms, rtrain_ms / atrain_ms);
  }
  const std::vector<float> got = download(o.t);
  double top = 0;
  for (float x : got) top = std::max(top, static_cast<double>(std::fabs(x)));
  std::printf("  max |rule output| %.3g (finite: %s)\n", top, std::isfinite(top) ? "yes" : "no");
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "attention_bench: no CUDA device\n");
    return 1;
  }
  const int64_t b = 2, t = argc > 1 ? std::atoll(argv[1]) : 4096;
  const std::string model = argc > 2 ? argv[2] : "qwen3";
  if (t <= 0 || (model != "qwen3" && model != "gpt-oss" && model != "qwen3.5")) {
    std::fprintf(stderr, "attention_bench: usage: attention_bench [T > 0] [qwen3|gpt-oss|qwen3.5], got '%s' '%s'\n",
                 argc > 1 ? argv[1] : "", model.c_str());
    return 1;
  }
  // GPT-OSS's layers alternate a 128-key window with full causal attention, both with sinks;
  // its plain causal row is the ceiling the issue measures them against.
  const std::vector<Shape_> shapes =
      model == "qwen3" ? std::vector<Shape_>{{"Qwen3-30B-A3B", 32, 4, 128, 0, false}}
                       : std::vector<Shape_>{{"GPT-OSS plain", 64, 8, 64, 0, false},
                                             {"GPT-OSS full layer", 64, 8, 64, 0, true},
                                             {"GPT-OSS window layer", 64, 8, 64, 128, true}};
  try {
    if (model == "qwen3.5") {
      run_qwen35(b, t);
      return 0;
    }
    for (const Shape_& c : shapes) run_shape(b, t, c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
