// Speed of the grouped expert GEMM at Qwen3-30B-A3B's expert shapes: 8192 tokens routed
// top-8 over 128 experts (65536 rows), hidden 2048, expert FFN 768, so gate_up (K=2048,
// O=1536) and down (K=768, O=2048). Each product (forward y bf16, B dx bf16, W dw f32
// accumulated, as the model runs them) on balanced and on skewed routing, through the
// public functions (which take CUTLASS's Hopper grouped GEMM at these shapes) and through
// the WMMA kernel they replaced. Then the FP8 forward and B (training.fp8 = blockwise:
// x or dy in 1x128 tiles, the weight in 128x128 blocks, grouped_gemm_fp8), timed alone
// and with the activation's quantization pass the model runs before it.
//
// Timing: CUDA events on the backend's stream, median of --reps runs after 3 warm-up runs;
// the operands rotate over enough copies that a run never finds the previous run's data
// in L2. Before timing, each product's two routes run once on the same inputs and the
// largest difference is printed (relative to the largest WMMA output), a quick check that
// the fast route computes the same thing.
//
//   grouped_gemm_bench [--reps N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/fp8_quant.h"
#include "kernels/grouped_gemm.h"
#include "bench_util.h"

namespace mt {
namespace {

using bench::Buffer;
using bench::download;
using bench::median_ms;

constexpr int64_t kTokens = 8192, kTopK = 8, kExperts = 128, kRows = kTokens * kTopK;
constexpr int64_t kHidden = 2048, kExpertFfn = 768;

// max |a - b| / max |b|
double relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<float> va = download(a), vb = download(b);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(va[i]) - vb[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(vb[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// Balanced: 512 rows each. Skewed: log-normal expert popularity (sigma 1, so the busiest
// experts get several times the mean and some get a few rows), two experts never chosen.
std::vector<int32_t> segment_offsets(bool skewed) {
  std::vector<double> weight(kExperts, 1.0);
  if (skewed) {
    std::mt19937_64 g(2024);
    std::lognormal_distribution<double> d(0.0, 1.0);
    for (double& w : weight) w = d(g);
    weight[17] = weight[90] = 0.0;
  }
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
  std::vector<int32_t> offsets{0};
  double cum = 0;
  for (double w : weight) {
    cum += w;
    offsets.push_back(static_cast<int32_t>(std::llround(cum / total * kRows)));
  }
  offsets.back() = static_cast<int32_t>(kRows);
  return offsets;
}

// One product's operands and outputs, for one (K, O).
struct Operands {
  Operands(int64_t k, int64_t o, uint64_t seed)
      : x(DType::bf16, {kRows, k}), w(DType::bf16, {kExperts, o, k}), dy(DType::bf16, {kRows, o}),
        y(DType::bf16, {kRows, o}), dx(DType::bf16, {kRows, k}), dw(DType::f32, {kExperts, o, k}) {
    bench::fill_random(x.t, -1.0f, 1.0f, seed);
    bench::fill_random(w.t, -1.0f, 1.0f, seed + 1);
    bench::fill_random(dy.t, -1.0f, 1.0f, seed + 2);
    bench::fill_random(dw.t, -1.0f, 1.0f, seed + 3);
  }
  // The FP8 operands (kernels/fp8_quant.h): x and dy row-quantized, w and its transpose
  // block-quantized.
  struct Fp8 {
    Fp8(int64_t k, int64_t o)
        : xq(DType::f8e4m3, {kRows, k}), xs(DType::f32, {fp8::tiles(k), kRows}), dyq(DType::f8e4m3, {kRows, o}),
          dys(DType::f32, {fp8::tiles(o), kRows}), wq(DType::f8e4m3, {kExperts, o, k}),
          ws(DType::f32, {kExperts, fp8::tiles(o), fp8::block_scale_cols(k)}), wqt(DType::f8e4m3, {kExperts, k, o}),
          wst(DType::f32, {kExperts, fp8::tiles(k), fp8::block_scale_cols(o)}) {}
    Buffer xq, xs, dyq, dys, wq, ws, wqt, wst;
  };
  size_t bytes() const {
    return x.t.nbytes() + w.t.nbytes() + dy.t.nbytes() + y.t.nbytes() + dx.t.nbytes() + dw.t.nbytes();
  }
  Buffer x, w, dy, y, dx, dw;
};

double tflops(int64_t k, int64_t o, double ms) { return 2.0 * kRows * k * o / (ms * 1e-3) / 1e12; }

void bench_shape(const char* name, int64_t k, int64_t o, int reps, size_t l2_bytes) {
  // Copies enough that consecutive runs touch twice the L2 in between (one copy of these
  // shapes already is many times the L2, so this is normally 2).
  std::vector<std::unique_ptr<Operands>> sets;
  sets.push_back(std::make_unique<Operands>(k, o, 10));
  const size_t copies = std::max<size_t>(2, (2 * l2_bytes + sets[0]->bytes() - 1) / sets[0]->bytes());
  while (sets.size() < copies) sets.push_back(std::make_unique<Operands>(k, o, 10 + 10 * sets.size()));
  Tensor none;

  for (bool skewed : {false, true}) {
    std::vector<int32_t> offsets = segment_offsets(skewed);
    int32_t fewest = kRows, most = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      fewest = std::min(fewest, offsets[e + 1] - offsets[e]);
      most = std::max(most, offsets[e + 1] - offsets[e]);
    }
    Buffer off(DType::i32, {kExperts + 1});
    cuda::copy(off.t, Tensor(offsets.data(), {kExperts + 1}, DType::i32));
    std::printf("%s K=%ld O=%ld, %s routing (rows per expert %d..%d)\n", name, static_cast<long>(k),
                static_cast<long>(o), skewed ? "skewed" : "balanced", fewest, most);

    // The two routes on the same inputs, outputs side by side.
    Operands& s = *sets[0];
    Buffer y2(DType::bf16, {kRows, o}), dx2(DType::bf16, {kRows, k}), dw2(DType::f32, {kExperts, o, k});
    cuda::grouped_gemm(s.x.t, s.w.t, none, off.t, s.y.t);
    cuda::grouped_gemm_wmma(s.x.t, s.w.t, none, off.t, y2.t);
    cuda::grouped_gemm_backward_input(s.dy.t, s.w.t, off.t, s.dx.t);
    cuda::grouped_gemm_backward_input_wmma(s.dy.t, s.w.t, off.t, dx2.t);
    cuda::grouped_gemm_backward_weight(s.x.t, s.dy.t, off.t, s.dw.t, none, false);
    cuda::grouped_gemm_backward_weight_wmma(s.x.t, s.dy.t, off.t, dw2.t, false);
    std::printf("  routes differ by at most: y %.2e, dx %.2e, dw %.2e (relative to the largest value)\n",
                relative_difference(s.y.t, y2.t), relative_difference(s.dx.t, dx2.t),
                relative_difference(s.dw.t, dw2.t));
    Operands::Fp8 q(k, o);
    cuda::quantize_blocks(s.w.t, q.wq.t, q.ws.t, false, q.wqt.t, q.wst.t);
    cuda::quantize_rows(s.x.t, q.xq.t, q.xs.t, false);
    cuda::quantize_rows(s.dy.t, q.dyq.t, q.dys.t, false);
    cuda::grouped_gemm_fp8(q.xq.t, q.xs.t, q.wq.t, q.ws.t, off.t, y2.t);
    cuda::grouped_gemm_fp8(q.dyq.t, q.dys.t, q.wqt.t, q.wst.t, off.t, dx2.t);
    std::printf("  FP8 against bf16 differs by at most: y %.2e, dx %.2e\n", relative_difference(y2.t, s.y.t),
                relative_difference(dx2.t, s.dx.t));

    auto at = [&](int run) -> Operands& { return *sets[static_cast<size_t>(run) % sets.size()]; };
    const double f_new = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm(p.x.t, p.w.t, none, off.t, p.y.t);
    });
    const double f_old = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm_wmma(p.x.t, p.w.t, none, off.t, p.y.t);
    });
    const double b_new = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm_backward_input(p.dy.t, p.w.t, off.t, p.dx.t);
    });
    const double b_old = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm_backward_input_wmma(p.dy.t, p.w.t, off.t, p.dx.t);
    });
    const double w_new = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm_backward_weight(p.x.t, p.dy.t, off.t, p.dw.t, none, true);
    });
    const double w_old = median_ms(reps, [&](int r) {
      Operands& p = at(r);
      cuda::grouped_gemm_backward_weight_wmma(p.x.t, p.dy.t, off.t, p.dw.t, true);
    });
    // FP8 on one operand set (the weights' codes are the optimizer's, not the step's): the
    // activations' copies still rotate through the bf16 sets for their quantization.
    const double f_fp8 = median_ms(reps, [&](int) { cuda::grouped_gemm_fp8(q.xq.t, q.xs.t, q.wq.t, q.ws.t, off.t, y2.t); });
    const double f_quant = median_ms(reps, [&](int r) { cuda::quantize_rows(at(r).x.t, q.xq.t, q.xs.t, false); });
    const double b_fp8 =
        median_ms(reps, [&](int) { cuda::grouped_gemm_fp8(q.dyq.t, q.dys.t, q.wqt.t, q.wst.t, off.t, dx2.t); });
    const double b_quant = median_ms(reps, [&](int r) { cuda::quantize_rows(at(r).dy.t, q.dyq.t, q.dys.t, false); });
    const struct {
      const char* what;
      double now, before, fp8, quant;
    } rows[] = {{"forward", f_new, f_old, f_fp8, f_quant}, {"B (dx)", b_new, b_old, b_fp8, b_quant},
                {"W (dw += )", w_new, w_old, 0, 0}};
    for (const auto& r : rows) {
      std::printf("  %-10s CUTLASS %7.3f ms %6.0f TFLOPS | WMMA %7.3f ms %6.0f TFLOPS | %.2fx\n", r.what, r.now,
                  tflops(k, o, r.now), r.before, tflops(k, o, r.before), r.before / r.now);
      if (r.fp8 > 0)
        std::printf("  %-10s FP8 %7.3f ms %6.0f TFLOPS (%.2fx bf16) | with its quantize_rows %7.3f ms: %.2fx bf16\n",
                    "", r.fp8, tflops(k, o, r.fp8), r.now / r.fp8, r.fp8 + r.quant, r.now / (r.fp8 + r.quant));
    }
  }
}

int run(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--reps N]\n", argv[0]);
      return 2;
    }
  }
  const cuda::DeviceInfo info = cuda::query_device();
  if (info.count == 0 || !info.kernels_run) {
    std::fprintf(stderr, "grouped_gemm_bench needs a GPU that runs sm_90a kernels: %s\n",
                 info.count == 0 ? "no device found" : (info.name + " did not run one").c_str());
    return 1;
  }
  int device = 0, l2 = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  std::printf("%s, %d SMs, L2 %d MiB; %ld rows over %ld experts, median of %d runs\n", info.name.c_str(),
              cuda::sm_count(), l2 >> 20, static_cast<long>(kRows), static_cast<long>(kExperts), reps);
  bench_shape("gate_up", kHidden, 2 * kExpertFfn, reps, static_cast<size_t>(l2));
  bench_shape("down", kExpertFfn, kHidden, reps, static_cast<size_t>(l2));
  return 0;
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  try {
    return mt::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
