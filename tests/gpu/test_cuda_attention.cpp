// The CUDA attention, router and dispatch kernels against the CPU backend, on fresh
// random inputs (never zeros), with every output poisoned (NaN, or an impossible index)
// before the GPU writes it, over the awkward shapes of the CPU op table and a few large
// ones that span several tiles.
//
// Tolerances. Inputs are rounded to bf16 once and both backends read the same values
// (the CPU in f32), so every difference comes from the GPU's own roundings:
//   attention out    P is rounded to bf16 (relative 2^-9) before P V and the result is
//                    rounded to bf16 (2^-9 again); the weights sum to 1 and |v| <= 1, so
//                    |out - ref| <= 2^-8. Checked at 2^-7.
//   attention lse    f32 on both sides from the same scores: |lse - ref| <= 1e-4.
//   dq, dk, dv       the same two roundings on P and dS, plus delta = dout . out read
//                    from the bf16 output: relative error of order 2^-8 of the sum of
//                    the magnitudes of the terms. Checked as ||g - ref|| <= 1e-2 ||ref||
//                    (the usual band for bf16 operands) and |g - ref| <= 2^-5 max|ref|
//                    for every element, which a wrong or unwritten element cannot pass.
//   dsinks           a sum over rows of the same terms: ||g - ref|| <= 1e-2 ||ref||.
//   router           f32 on both sides; the picks must be identical, weights and probs
//                    within 1e-5 relative (expf and the summation order differ), dlogits
//                    within 2e-5 of its largest element.
//   dispatch         the plan is integers and must match exactly; the gathers copy bf16
//                    exactly; dispatch backward adds in the CPU's order in f32 and rounds
//                    once, so it equals the CPU result rounded to bf16; combine forward
//                    may differ from it by the fused multiply-adds' roundings, one bf16
//                    ulp; combine backward's dys is one product rounded (exact), dweight
//                    an f32 dot in another order, within 1e-5 of the sum of |terms|.
//
// Attention has two routes on the GPU (kernels/cuda/attention_cudnn.h): cuDNN's fused
// SDPA for the cases it computes exactly (head dims 64/64, 128/128 or 192/128, plain causal
// with or without a window, or every key visible; sinks or not), our kernel for the rest. A case marked .cudnn runs both,
// cuDNN and then our kernel forced, each against the CPU with the same tolerances (cuDNN
// too feeds P and dS to the tensor cores in bf16); the others must not reach cuDNN. The
// cuDNN route also prints whether two backwards gave the same bits (its dQ sums with
// atomics).
//
// DISABLED_TimeAttention times the Qwen3-30B-A3B attention shape on both routes; run it
// with --gtest_also_run_disabled_tests --gtest_filter='*TimeAttention*'.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/router.h"

namespace mt::gpu_test {
namespace {

// -1 is a valid slot_row (a dropped slot), so index outputs are poisoned with
// 0x7f7f7f7f instead, which is no index, count or offset.
void poison_index(DeviceTensor& d) {
  if (d.t.nbytes() > 0) CUDA_CHECK(cudaMemsetAsync(d.t.data, 0x7f, d.t.nbytes(), cuda::stream()));
}

// ||got - want|| / ||want|| and max |got - want|; NaN anywhere in got (an element left
// unwritten) makes both NaN, which fails every comparison.
struct Err {
  double rel, max;
};
Err error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0, mx = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return {NAN, NAN};
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
    mx = std::max(mx, std::fabs(d));
  }
  return {den > 0 ? std::sqrt(num / den) : std::sqrt(num), mx};
}

// ---------------------------------------------------------------- attention

struct AttnCase {
  int64_t b = 1, tq = 1, tk = 1, hq = 1, hkv = 1, d = 4, dv = 0, window = 0;  // dv: v's head dim, 0: d
  bool sinks = false;
  int64_t q_offset = 0, k_offset = 0;
  bool cudnn = false;  // the case is one cuDNN runs
};

// Sets the cuDNN switch for a scope, and puts back what it was.
class CudnnRoute {
 public:
  explicit CudnnRoute(bool on) : was_(cuda::attention_cudnn_enabled()) { cuda::set_attention_cudnn(on); }
  ~CudnnRoute() { cuda::set_attention_cudnn(was_); }
  CudnnRoute(const CudnnRoute&) = delete;
  CudnnRoute& operator=(const CudnnRoute&) = delete;

 private:
  bool was_;
};

bool same_bits(const Tensor& a, const Tensor& b) {
  std::vector<uint8_t> x(a.nbytes()), y(b.nbytes());
  cuda::copy(Tensor(x.data(), a.shape, a.dtype), a);
  cuda::copy(Tensor(y.data(), b.shape, b.dtype), b);
  return x == y;
}

std::string name_of(const AttnCase& c) {
  std::ostringstream s;
  s << "B=" << c.b << " Tq=" << c.tq << " Tk=" << c.tk << " Hq=" << c.hq << " Hkv=" << c.hkv << " D=" << c.d
    << (c.dv > 0 ? " Dv=" + std::to_string(c.dv) : "") << " window=" << c.window << (c.sinks ? " sinks" : "")
    << " q_offset=" << c.q_offset << " k_offset=" << c.k_offset << (c.cudnn ? " (cuDNN)" : "");
  return s.str();
}

// gtest prints a failing case by its shape rather than as bytes.
void PrintTo(const AttnCase& c, std::ostream* os) { *os << name_of(c); }

class CudaAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(CudaAttention, MatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  const AttnCase c = GetParam();
  const int64_t d_v = c.dv > 0 ? c.dv : c.d;
  const Shape qs{c.b, c.tq, c.hq, c.d}, ks{c.b, c.tk, c.hkv, c.d}, ls{c.b, c.hq, c.tq};
  const Shape vs{c.b, c.tk, c.hkv, d_v}, os{c.b, c.tq, c.hq, d_v};
  const uint64_t seed = static_cast<uint64_t>(c.b * 1000003 + c.tq * 10007 + c.tk * 101 + c.d * 7 + c.hq + c.dv * 13);
  // q spans [-2, 2] so that some rows' softmax is peaked, not nearly uniform.
  std::vector<float> q = round_bf16(random_floats(qs.numel(), -2.0f, 2.0f, seed));
  std::vector<float> k = round_bf16(random_floats(ks.numel(), -1.0f, 1.0f, seed + 1));
  std::vector<float> v = round_bf16(random_floats(vs.numel(), -1.0f, 1.0f, seed + 2));
  std::vector<float> dout = round_bf16(random_floats(os.numel(), -1.0f, 1.0f, seed + 3));
  std::vector<float> sinks = random_floats(c.hq, -1.0f, 2.0f, seed + 4);
  cpu::AttentionArgs a;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  a.window = c.window;
  a.q_offset = c.q_offset;
  a.k_offset = c.k_offset;

  // CPU reference on the bf16-rounded inputs, in f32. dsinks starts at 1: both backends
  // accumulate into it.
  std::vector<float> out_ref(static_cast<size_t>(os.numel())), lse_ref(static_cast<size_t>(ls.numel()));
  std::vector<float> dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size()), ds_ref(sinks.size(), 1.0f);
  Tensor sinks_h = c.sinks ? host(sinks, {c.hq}) : Tensor();
  cpu::attention_forward(host(q, qs), host(k, ks), host(v, vs), sinks_h, a, host(out_ref, os), host(lse_ref, ls));
  cpu::attention_backward(host(q, qs), host(k, ks), host(v, vs), sinks_h, a, host(out_ref, os), host(lse_ref, ls),
                          host(dout, os), host(dq_ref, qs), host(dk_ref, ks), host(dv_ref, vs),
                          c.sinks ? host(ds_ref, {c.hq}) : Tensor());

  auto qd = upload(q, DType::bf16, qs), kd = upload(k, DType::bf16, ks), vd = upload(v, DType::bf16, vs);
  auto gd = upload(dout, DType::bf16, os), sd = upload(sinks, DType::f32, {c.hq});
  const Tensor sinks_d = c.sinks ? sd.t : Tensor();
  // A cuDNN case runs on cuDNN, then on our kernel forced; any other case runs once, on our kernel.
  for (const bool use_cudnn : c.cudnn ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
    const char* route = c.cudnn ? (use_cudnn ? "cudnn" : "kernel") : "kernel";
    SCOPED_TRACE(std::string("route ") + route);
    const CudnnRoute on(use_cudnn);
    auto dsd = upload(std::vector<float>(static_cast<size_t>(c.hq), 1.0f), DType::f32, {c.hq});
    auto out = poisoned(DType::bf16, os), lse = poisoned(DType::f32, ls), dq = poisoned(DType::bf16, qs);
    auto dk = poisoned(DType::bf16, ks), dv = poisoned(DType::bf16, vs);
    const int64_t calls = cuda::attention_cudnn_calls();
    mt::attention_forward(qd.t, kd.t, vd.t, sinks_d, a, out.t, lse.t);
    mt::attention_backward(qd.t, kd.t, vd.t, sinks_d, a, out.t, lse.t, gd.t, dq.t, dk.t, dv.t,
                           c.sinks ? dsd.t : Tensor());
    cuda::synchronize();
    const bool on_cudnn = c.cudnn && use_cudnn;
    ASSERT_EQ(cuda::attention_cudnn_calls() - calls, on_cudnn ? 2 : 0)
        << (on_cudnn ? "cuDNN declined the case (see its warning above)" : "the case reached cuDNN");

    const std::vector<float> o = download(out.t), l = download(lse.t);
    const Err eo = error(o, out_ref);
    EXPECT_TRUE(near("out", o, out_ref, Tol(0, 2 * kBf16Round)));
    for (size_t i = 0; i < l.size(); ++i) {
      if (std::isinf(lse_ref[i])) {
        EXPECT_EQ(l[i], lse_ref[i]) << "lse row " << i << " sees nothing";
      } else {
        ASSERT_NEAR(l[i], lse_ref[i], 1e-4) << "lse at " << i;
      }
    }
    const std::vector<float> gq = download(dq.t), gk = download(dk.t), gv = download(dv.t);
    const Err eq = error(gq, dq_ref), ek = error(gk, dk_ref), ev = error(gv, dv_ref);
    for (auto [e, ref, what] : {std::tuple{eq, &dq_ref, "dq"}, std::tuple{ek, &dk_ref, "dk"},
                                std::tuple{ev, &dv_ref, "dv"}}) {
      EXPECT_LE(e.rel, 1e-2) << what;
      EXPECT_LE(e.max, max_abs(*ref) / 32) << what;
    }
    Err es{0, 0};
    if (c.sinks) {
      es = error(download(dsd.t), ds_ref);
      EXPECT_LE(es.rel, 1e-2) << "dsinks";
    }
    std::string repeat;
    if (on_cudnn) {
      auto dq2 = poisoned(DType::bf16, qs), dk2 = poisoned(DType::bf16, ks), dv2 = poisoned(DType::bf16, vs);
      auto ds2 = upload(std::vector<float>(static_cast<size_t>(c.hq), 1.0f), DType::f32, {c.hq});
      mt::attention_backward(qd.t, kd.t, vd.t, sinks_d, a, out.t, lse.t, gd.t, dq2.t, dk2.t, dv2.t,
                             c.sinks ? ds2.t : Tensor());
      cuda::synchronize();
      repeat = std::string(" | again: dq ") + (same_bits(dq.t, dq2.t) ? "same" : "differs") + ", dk " +
               (same_bits(dk.t, dk2.t) ? "same" : "differs") + ", dv " + (same_bits(dv.t, dv2.t) ? "same" : "differs");
    }
    std::printf("  [attention %s, %s] out max %.2e | rel dq %.2e dk %.2e dv %.2e dsinks %.2e%s\n", name_of(c).c_str(),
                route, eo.max, eq.rel, ek.rel, ev.rel, es.rel, repeat.c_str());
  }
}

// The CPU table's rows (one token, GQA 6/2 and 4/1, windows, sinks, Tq != Tk with
// offsets and rows that see no key, B = 2, head dims 5 and 16), then sizes that span
// several tiles with head dims 8, 64, 96, 128 (the 16-byte load path and both paddings).
// Then cuDNN's cases: causal GQA at D = 128 (Qwen3's 32/4 heads), causal with equal
// non-zero offsets, every key visible (a ring attention block, and Tq != Tk at D = 64);
// causal with a window, with sinks, with both (GPT-OSS's 64-dim heads), a ring block whose
// keys all lie inside the window; and cases it must leave to our kernel: a causal diagonal
// shifted by one, a ring block that the window cuts.
// Then MLA's value head dim differing from the query/key one: odd dims (element path), 24/16
// with sinks and a window (the 64/64 padding), Dv > Dqk (128/128), DeepSeek-V2's 192/128 on
// cuDNN (causal MHA, and a ring block with every key visible), and on our kernel (192/128
// padding) with a window and sinks, and 192/64 with offsets. The 192/128 case with a window
// and sinks runs on cuDNN.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Values(AttnCase{.tq = 1, .tk = 1, .hq = 2, .hkv = 2, .d = 5, .sinks = true},
                      AttnCase{.tq = 1, .tk = 9, .hq = 4, .hkv = 2, .d = 16, .q_offset = 8},
                      AttnCase{.b = 2, .tq = 7, .tk = 7, .hq = 3, .hkv = 3, .d = 16},
                      AttnCase{.tq = 13, .tk = 13, .hq = 6, .hkv = 2, .d = 5},
                      AttnCase{.tq = 7, .tk = 7, .hq = 4, .hkv = 1, .d = 16, .window = 3},
                      AttnCase{.tq = 7, .tk = 7, .hq = 2, .hkv = 2, .d = 5, .sinks = true},
                      AttnCase{.b = 2, .tq = 13, .tk = 13, .hq = 6, .hkv = 2, .d = 5, .window = 3, .sinks = true},
                      AttnCase{.tq = 5, .tk = 7, .hq = 4, .hkv = 2, .d = 5, .q_offset = 7},
                      AttnCase{.b = 2, .tq = 5, .tk = 7, .hq = 4, .hkv = 1, .d = 5, .window = 4, .q_offset = 7},
                      AttnCase{.tq = 7, .tk = 5, .hq = 6, .hkv = 2, .d = 5, .k_offset = 4},
                      AttnCase{.tq = 7, .tk = 5, .hq = 6, .hkv = 2, .d = 16, .window = 3, .sinks = true, .k_offset = 4},
                      AttnCase{.tq = 33, .tk = 33, .hq = 2, .hkv = 1, .d = 8},
                      AttnCase{.b = 2, .tq = 130, .tk = 130, .hq = 4, .hkv = 2, .d = 64, .cudnn = true},
                      AttnCase{.tq = 200, .tk = 200, .hq = 4, .hkv = 1, .d = 128, .window = 70, .sinks = true, .cudnn = true},
                      AttnCase{.tq = 100, .tk = 300, .hq = 2, .hkv = 1, .d = 128, .q_offset = 200},
                      AttnCase{.tq = 150, .tk = 100, .hq = 2, .hkv = 2, .d = 128, .k_offset = 120},
                      AttnCase{.tq = 77, .tk = 77, .hq = 6, .hkv = 2, .d = 96},
                      AttnCase{.b = 2, .tq = 257, .tk = 257, .hq = 8, .hkv = 1, .d = 64, .sinks = true, .cudnn = true},
                      AttnCase{.b = 2, .tq = 512, .tk = 512, .hq = 32, .hkv = 4, .d = 128, .cudnn = true},
                      AttnCase{.tq = 192, .tk = 192, .hq = 8, .hkv = 8, .d = 128, .q_offset = 256, .k_offset = 256,
                               .cudnn = true},
                      AttnCase{.b = 2, .tq = 256, .tk = 256, .hq = 16, .hkv = 4, .d = 128, .q_offset = 512,
                               .k_offset = 256, .cudnn = true},
                      AttnCase{.tq = 100, .tk = 300, .hq = 4, .hkv = 1, .d = 64, .q_offset = 300, .cudnn = true},
                      AttnCase{.tq = 256, .tk = 256, .hq = 8, .hkv = 2, .d = 128, .window = 64, .cudnn = true},
                      AttnCase{.tq = 128, .tk = 128, .hq = 8, .hkv = 2, .d = 128, .sinks = true, .cudnn = true},
                      AttnCase{.b = 2, .tq = 512, .tk = 512, .hq = 16, .hkv = 2, .d = 64, .window = 128,
                               .sinks = true, .cudnn = true},
                      AttnCase{.tq = 100, .tk = 300, .hq = 4, .hkv = 1, .d = 64, .window = 400, .sinks = true,
                               .q_offset = 300, .cudnn = true},
                      AttnCase{.tq = 100, .tk = 300, .hq = 4, .hkv = 1, .d = 64, .window = 200, .q_offset = 300},
                      AttnCase{.tq = 256, .tk = 256, .hq = 8, .hkv = 2, .d = 128, .q_offset = 257, .k_offset = 256},
                      AttnCase{.tq = 13, .tk = 13, .hq = 6, .hkv = 2, .d = 12, .dv = 5, .window = 3, .sinks = true},
                      AttnCase{.b = 2, .tq = 77, .tk = 77, .hq = 6, .hkv = 2, .d = 24, .dv = 16, .window = 20,
                               .sinks = true},
                      AttnCase{.tq = 70, .tk = 90, .hq = 4, .hkv = 1, .d = 32, .dv = 96, .q_offset = 20},
                      AttnCase{.b = 2, .tq = 256, .tk = 256, .hq = 16, .hkv = 16, .d = 192, .dv = 128, .cudnn = true},
                      AttnCase{.tq = 128, .tk = 192, .hq = 4, .hkv = 4, .d = 192, .dv = 128, .q_offset = 192,
                               .cudnn = true},
                      AttnCase{.tq = 200, .tk = 200, .hq = 4, .hkv = 2, .d = 192, .dv = 128, .window = 70,
                               .sinks = true, .cudnn = true},
                      AttnCase{.tq = 100, .tk = 300, .hq = 2, .hkv = 1, .d = 192, .dv = 64, .q_offset = 200},
                      // Qwen3.5's full attention: head dim 256, GQA, causal.
                      AttnCase{.b = 2, .tq = 200, .tk = 200, .hq = 4, .hkv = 2, .d = 256, .cudnn = true},
                      AttnCase{.tq = 70, .tk = 90, .hq = 2, .hkv = 1, .d = 256, .dv = 200, .q_offset = 20}),
    [](const ::testing::TestParamInfo<AttnCase>& i) { return "case" + std::to_string(i.index); });

// B=2, T=4096, Hq=32, Hkv=4, D=128 (Qwen3-30B-A3B), causal, on cuDNN and on our kernel:
// the median of 20 timed runs after 3 warm-ups, with CUDA events. FLOPs count the
// products the math needs (forward 2, backward 5, each 2*T*T*D per head, halved by the
// causal mask), not the ones an implementation recomputes.
TEST(CudaAttentionTiming, DISABLED_TimeAttention) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t b = 2, t = 4096, hq = 32, hkv = 4, d = 128;
  const Shape qs{b, t, hq, d}, ks{b, t, hkv, d};
  auto q = upload(random_floats(qs.numel(), -2.0f, 2.0f, 1), DType::bf16, qs);
  auto k = upload(random_floats(ks.numel(), -1.0f, 1.0f, 2), DType::bf16, ks);
  auto v = upload(random_floats(ks.numel(), -1.0f, 1.0f, 3), DType::bf16, ks);
  auto g = upload(random_floats(qs.numel(), -1.0f, 1.0f, 4), DType::bf16, qs);
  auto out = poisoned(DType::bf16, qs), lse = poisoned(DType::f32, {b, hq, t}), dq = poisoned(DType::bf16, qs);
  auto dk = poisoned(DType::bf16, ks), dv = poisoned(DType::bf16, ks);
  cpu::AttentionArgs a;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  auto fwd = [&] { mt::attention_forward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t); };
  auto bwd = [&] {
    mt::attention_backward(q.t, k.t, v.t, Tensor(), a, out.t, lse.t, g.t, dq.t, dk.t, dv.t, Tensor());
  };
  auto median_ms = [&](auto&& f) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < 3; ++i) f();
    std::vector<float> ms;
    for (int i = 0; i < 20; ++i) {
      CUDA_CHECK(cudaEventRecord(start, cuda::stream()));
      f();
      CUDA_CHECK(cudaEventRecord(stop, cuda::stream()));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float x = 0;
      CUDA_CHECK(cudaEventElapsedTime(&x, start, stop));
      ms.push_back(x);
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[ms.size() / 2]);
  };
  const double product = 2.0 * b * hq * t * t * d / 2;  // one causal T x T x D product
  for (const bool use_cudnn : {true, false}) {
    const CudnnRoute on(use_cudnn);
    const double fwd_ms = median_ms(fwd);
    const double bwd_ms = median_ms(bwd);
    std::printf("attention (%s) B=%ld T=%ld Hq=%ld Hkv=%ld D=%ld causal: forward %.3f ms (%.1f TFLOPS), backward "
                "%.3f ms (%.1f TFLOPS), forward+backward %.1f TFLOPS\n",
                use_cudnn ? "cuDNN" : "kernel", static_cast<long>(b), static_cast<long>(t), static_cast<long>(hq),
                static_cast<long>(hkv), static_cast<long>(d), fwd_ms, 2 * product / fwd_ms / 1e9, bwd_ms,
                5 * product / bwd_ms / 1e9, 7 * product / (fwd_ms + bwd_ms) / 1e9);
  }
}

// ---------------------------------------------------------------- router

struct RouterCase {
  int64_t rows = 1, experts = 8, top_k = 2;
  bool gpt_oss = false, normalize = false;
  float scale = 1.0f;
  int64_t n_group = 1, topk_group = 1;
  bool dprobs = false;
  bool ties = false;  // logits on a grid of 0.25: many equal logits, and equal group maxima
};

void PrintTo(const RouterCase& r, std::ostream* os) {
  *os << "N=" << r.rows << " E=" << r.experts << " k=" << r.top_k << (r.gpt_oss ? " topk_softmax" : " softmax_topk")
      << " norm=" << r.normalize << " scale=" << r.scale << " groups=" << r.n_group << "/" << r.topk_group
      << " dprobs=" << r.dprobs << " ties=" << r.ties;
}

class CudaRouter : public ::testing::TestWithParam<RouterCase> {};

TEST_P(CudaRouter, MatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  const RouterCase r = GetParam();
  const int64_t n = r.rows, e = r.experts, k = r.top_k;
  cpu::RouterConfig cfg;
  cfg.top_k = k;
  cfg.scoring = r.gpt_oss ? cpu::RouterScoring::topk_softmax : cpu::RouterScoring::softmax_topk;
  cfg.normalize = r.normalize;
  cfg.scale = r.scale;
  cfg.n_group = r.n_group;
  cfg.topk_group = r.topk_group;
  const uint64_t seed = static_cast<uint64_t>(n * 131 + e * 7 + k);
  std::vector<float> logits = random_floats(n * e, -2.0f, 2.0f, seed);
  if (r.ties)
    for (float& x : logits) x = std::round(x * 4.0f) / 4.0f;
  std::vector<float> dweight = random_floats(n * k, -1.0f, 1.0f, seed + 1);
  std::vector<float> dprobs = random_floats(n * e, -1.0f, 1.0f, seed + 2);

  std::vector<int32_t> idx_ref(static_cast<size_t>(n * k));
  std::vector<float> w_ref(static_cast<size_t>(n * k)), p_ref(static_cast<size_t>(n * e)), dl_ref(p_ref.size());
  cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}));
  cpu::router_backward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                       host(dweight, {n, k}), r.dprobs ? host(dprobs, {n, e}) : Tensor(), host(dl_ref, {n, e}));

  auto ld = upload(logits, DType::f32, {n, e}), dwd = upload(dweight, DType::f32, {n, k});
  auto dpd = upload(dprobs, DType::f32, {n, e});
  auto idx = poisoned(DType::i32, {n, k}), w = poisoned(DType::f32, {n, k}), p = poisoned(DType::f32, {n, e});
  auto dl = poisoned(DType::f32, {n, e});
  mt::router_forward(cfg, ld.t, idx.t, w.t, p.t);
  mt::router_backward(cfg, ld.t, idx.t, w.t, p.t, dwd.t, r.dprobs ? dpd.t : Tensor(), dl.t);
  cuda::synchronize();

  EXPECT_EQ(download_ints(idx.t), idx_ref) << "chosen experts";
  const std::vector<float> gl = download(dl.t);
  EXPECT_TRUE(near("weight", download(w.t), w_ref, Tol(1e-5, 1e-7)));
  EXPECT_TRUE(near("probs", download(p.t), p_ref, Tol(1e-5, 1e-9)));
  EXPECT_TRUE(near("dlogits", gl, dl_ref, Tol(0, 2e-5 * max_abs(dl_ref))));
  const Err el = error(gl, dl_ref);
  std::printf("  [router N=%ld E=%ld k=%ld] dlogits max error %.2e of max %.2e\n", static_cast<long>(n),
              static_cast<long>(e), static_cast<long>(k), el.max, max_abs(dl_ref));
}

// The CPU table's rows (k = 1, k = E, renormalised, scaled, DeepSeek groups, GPT-OSS),
// then real sizes (Qwen3's 128 experts top-8, DeepSeek-V3's 256 in 8 groups, k > 32),
// and logits with ties, where only "ties to the lower id" decides.
INSTANTIATE_TEST_SUITE_P(
    Configs, CudaRouter,
    ::testing::Values(RouterCase{.rows = 1, .experts = 4, .top_k = 1},
                      RouterCase{.rows = 6, .experts = 8, .top_k = 2, .normalize = true, .dprobs = true},
                      RouterCase{.rows = 5, .experts = 6, .top_k = 6, .scale = 2.5f},
                      RouterCase{.rows = 7, .experts = 8, .top_k = 3, .normalize = true, .scale = 2.5f, .n_group = 4,
                                 .topk_group = 2, .dprobs = true},
                      RouterCase{.rows = 9, .experts = 16, .top_k = 4, .n_group = 4, .topk_group = 1},
                      RouterCase{.rows = 5, .experts = 32, .top_k = 4, .gpt_oss = true, .dprobs = true},
                      RouterCase{.rows = 1, .experts = 5, .top_k = 5, .gpt_oss = true},
                      RouterCase{.rows = 3, .experts = 7, .top_k = 1, .gpt_oss = true},
                      RouterCase{.rows = 1000, .experts = 128, .top_k = 8, .normalize = true, .dprobs = true},
                      RouterCase{.rows = 300, .experts = 256, .top_k = 8, .normalize = true, .scale = 2.5f,
                                 .n_group = 8, .topk_group = 4, .dprobs = true},
                      RouterCase{.rows = 100, .experts = 64, .top_k = 64, .dprobs = true},
                      RouterCase{.rows = 500, .experts = 128, .top_k = 8, .normalize = true, .ties = true},
                      RouterCase{.rows = 200, .experts = 64, .top_k = 6, .n_group = 8, .topk_group = 3, .ties = true},
                      RouterCase{.rows = 200, .experts = 32, .top_k = 4, .gpt_oss = true, .ties = true}),
    [](const ::testing::TestParamInfo<RouterCase>& i) { return "case" + std::to_string(i.index); });

// ---------------------------------------------------------------- dispatch

struct DispatchCase {
  int64_t tokens = 1, experts = 4, k = 1, dim = 5, capacity = 0;
  bool ends_empty = false;  // experts 0 and E-1 never picked
  bool skewed = false;      // three quarters of the picks go to experts 1..3
};

// k distinct experts per token, drawn at random.
std::vector<int32_t> random_routes(const DispatchCase& c, uint64_t seed) {
  std::mt19937_64 g(seed);
  const int32_t lo = c.ends_empty ? 1 : 0, hi = static_cast<int32_t>(c.ends_empty ? c.experts - 2 : c.experts - 1);
  std::uniform_int_distribution<int32_t> any(lo, hi), hot(1, 3), coin(0, 3);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::vector<int32_t> mine;
    while (static_cast<int64_t>(mine.size()) < c.k) {
      const int32_t e = c.skewed && coin(g) != 0 ? hot(g) : any(g);
      if (std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
    }
    idx.insert(idx.end(), mine.begin(), mine.end());
  }
  return idx;
}

void PrintTo(const DispatchCase& c, std::ostream* os) {
  *os << "N=" << c.tokens << " E=" << c.experts << " k=" << c.k << " D=" << c.dim << " capacity=" << c.capacity
      << " ends_empty=" << c.ends_empty << " skewed=" << c.skewed;
}

class CudaDispatch : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(CudaDispatch, MatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  const DispatchCase c = GetParam();
  const int64_t n = c.tokens, e = c.experts, k = c.k, d = c.dim, slots = n * k;
  const uint64_t seed = static_cast<uint64_t>(n * 31 + e * 7 + k + c.capacity);
  std::vector<int32_t> idx = random_routes(c, seed);

  std::vector<int32_t> counts_ref(static_cast<size_t>(e)), offsets_ref(static_cast<size_t>(e + 1));
  std::vector<int32_t> order_ref(static_cast<size_t>(slots)), slot_row_ref(static_cast<size_t>(slots));
  const int64_t dropped_ref =
      cpu::dispatch_plan(host(idx, {n, k}), e, c.capacity, host(counts_ref, {e}), host(offsets_ref, {e + 1}),
                         host(order_ref, {slots}), host(slot_row_ref, {slots}));
  const int64_t rows = offsets_ref[e];
  order_ref.resize(static_cast<size_t>(rows));

  auto idx_d = upload(idx, {n, k});
  DeviceTensor counts(DType::i32, {e}), offsets(DType::i32, {e + 1}), order(DType::i32, {slots});
  DeviceTensor slot_row(DType::i32, {slots});
  for (DeviceTensor* x : {&counts, &offsets, &order, &slot_row}) poison_index(*x);
  const int64_t dropped = mt::dispatch_plan(idx_d.t, e, c.capacity, counts.t, offsets.t, order.t, slot_row.t);
  cuda::synchronize();
  EXPECT_EQ(dropped, dropped_ref);
  EXPECT_EQ(download_ints(counts.t), counts_ref);
  EXPECT_EQ(download_ints(offsets.t), offsets_ref);
  std::vector<int32_t> order_g = download_ints(order.t);
  order_g.resize(static_cast<size_t>(rows));
  EXPECT_EQ(order_g, order_ref);
  EXPECT_EQ(download_ints(slot_row.t), slot_row_ref);

  // The gathers, on the CPU's plan (now known to be the GPU's too).
  std::vector<float> x = round_bf16(random_floats(n * d, -1.0f, 1.0f, seed + 1));
  std::vector<float> ys = round_bf16(random_floats(rows * d, -1.0f, 1.0f, seed + 2));
  std::vector<float> dy = round_bf16(random_floats(n * d, -1.0f, 1.0f, seed + 3));
  std::vector<float> dxs = round_bf16(random_floats(rows * d, -1.0f, 1.0f, seed + 4));
  std::vector<float> weight = random_floats(n * k, 0.0f, 1.0f, seed + 5);
  std::vector<float> xs_ref(static_cast<size_t>(rows * d)), dx_ref(x.size()), y_ref(x.size());
  std::vector<float> dys_ref(ys.size()), dw_ref(weight.size());
  cpu::dispatch_forward(host(x, {n, d}), host(order_ref, {rows}), k, host(xs_ref, {rows, d}));
  cpu::dispatch_backward(host(dxs, {rows, d}), host(slot_row_ref, {slots}), host(dx_ref, {n, d}));
  cpu::combine_forward(host(ys, {rows, d}), host(weight, {n, k}), host(slot_row_ref, {slots}), host(y_ref, {n, d}));
  cpu::combine_backward(host(ys, {rows, d}), host(weight, {n, k}), host(slot_row_ref, {slots}), host(dy, {n, d}),
                        host(dys_ref, {rows, d}), host(dw_ref, {n, k}));

  auto xd = upload(x, DType::bf16, {n, d}), ysd = upload(ys, DType::bf16, {rows, d});
  auto dyd = upload(dy, DType::bf16, {n, d}), dxsd = upload(dxs, DType::bf16, {rows, d});
  auto wd = upload(weight, DType::f32, {n, k});
  auto xs = poisoned(DType::bf16, {rows, d}), dx = poisoned(DType::bf16, {n, d}), y = poisoned(DType::bf16, {n, d});
  auto dys = poisoned(DType::bf16, {rows, d}), dw = poisoned(DType::f32, {n, k});
  mt::dispatch_forward(xd.t, order.t, k, xs.t);
  mt::dispatch_backward(dxsd.t, slot_row.t, dx.t);
  mt::combine_forward(ysd.t, wd.t, slot_row.t, y.t);
  mt::combine_backward(ysd.t, wd.t, slot_row.t, dyd.t, dys.t, dw.t);
  cuda::synchronize();

  EXPECT_TRUE(near("dispatch forward", download(xs.t), xs_ref, Tol{}));
  EXPECT_TRUE(near("dispatch backward", download(dx.t), round_bf16(dx_ref), Tol{}));
  EXPECT_TRUE(near("combine backward dys", download(dys.t), round_bf16(dys_ref), Tol{}));
  EXPECT_TRUE(near("combine forward", download(y.t), y_ref, Tol(kBf16Round, 1e-6)));
  std::vector<float> dot_terms(static_cast<size_t>(slots), 0.0f);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t j = 0; slot_row_ref[s] >= 0 && j < d; ++j)
      dot_terms[s] += std::fabs(dy[s / k * d + j] * ys[slot_row_ref[s] * d + j]);
  for (float& t : dot_terms) t *= 1e-5f;
  EXPECT_TRUE(near("combine backward dweight", download(dw.t), dw_ref, Tol(0, 1e-7, dot_terms)));
}

// One token, k = 1, k = E, the first and last expert empty, capacity dropping (light
// and, with skewed routing, heavy), head dims 5 (element path) and multiples of 8 (16-
// byte path), and plans longer than one 512-slot chunk.
INSTANTIATE_TEST_SUITE_P(
    Routes, CudaDispatch,
    ::testing::Values(DispatchCase{.tokens = 1, .experts = 4, .k = 1, .dim = 5},
                      DispatchCase{.tokens = 7, .experts = 5, .k = 5, .dim = 5},
                      DispatchCase{.tokens = 13, .experts = 8, .k = 2, .dim = 16, .ends_empty = true},
                      DispatchCase{.tokens = 13, .experts = 8, .k = 2, .dim = 5, .capacity = 3},
                      DispatchCase{.tokens = 500, .experts = 16, .k = 2, .dim = 64, .capacity = 40, .skewed = true},
                      DispatchCase{.tokens = 1000, .experts = 128, .k = 8, .dim = 256, .ends_empty = true},
                      DispatchCase{.tokens = 4096, .experts = 128, .k = 8, .dim = 64, .capacity = 200},
                      DispatchCase{.tokens = 3000, .experts = 64, .k = 6, .dim = 40, .capacity = 250, .ends_empty = true}),
    [](const ::testing::TestParamInfo<DispatchCase>& i) { return "case" + std::to_string(i.index); });

}  // namespace
}  // namespace mt::gpu_test
