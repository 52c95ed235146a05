// Router on the GPU: one warp per token, f32 throughout, same contract as the CPU backend.
// Experts (and DeepSeek groups) are ranked by logit (or, with a bias, by biased score;
// sigmoid scoring by its scores), ties to the lower id, as on the CPU;
// the j-th pick is the best candidate strictly worse than the (j-1)-th in that order, so
// no "taken" flags or per-token storage. router_backward checks idx on the device (a bad
// entry traps the kernel) rather than on the host, which would need a synchronisation.

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/router.h"

namespace mt::cuda {

namespace {

constexpr int kWarps = 8;
constexpr unsigned kFull = 0xffffffffu;  // every lane takes part in the shuffles

struct Dims {
  int n, e, k;
};

struct Pick {
  float v;
  int id;  // -1: none
};

// a before b: larger value, then lower id; a pick beats no pick.
__device__ __forceinline__ bool before(Pick a, Pick b) {
  return a.id >= 0 && (b.id < 0 || a.v > b.v || (a.v == b.v && a.id < b.id));
}

__device__ __forceinline__ Pick warp_best(Pick p) {
#pragma unroll
  for (int w = 16; w > 0; w /= 2) {
    Pick o{__shfl_xor_sync(kFull, p.v, w), __shfl_xor_sync(kFull, p.id, w)};
    if (before(o, p)) p = o;
  }
  return p;
}

struct Forward {
  const float* logits;
  const float* bias;  // null: choose by logit (sigmoid: by score)
  int32_t* idx;
  float* weight;
  float* probs;
  float* score_sum;  // sigmoid only
  Dims d;
  int n_group, topk_group;
  bool topk_softmax, sigmoid, normalize;
  float scale;
};

__global__ void router_forward_kernel(Forward f) {
  const int t = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= f.d.n) return;
  const int e_n = f.d.e, k = f.d.k;
  const float* l = f.logits + static_cast<long long>(t) * e_n;
  float* p = f.probs + static_cast<long long>(t) * e_n;
  int32_t* it = f.idx + static_cast<long long>(t) * k;
  float* w = f.weight + static_cast<long long>(t) * k;

  // Sigmoid scoring keeps the scores in p until the weights are made, then normalises them.
  float mx = -INFINITY, sum = 0.0f;
  if (f.sigmoid) {
    for (int e = lane; e < e_n; e += 32) p[e] = 1.0f / (1.0f + expf(-l[e]));
  } else {
    for (int e = lane; e < e_n; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    for (int e = lane; e < e_n; e += 32) sum += expf(l[e] - mx);
    sum = warp_sum(sum);
    for (int e = lane; e < e_n; e += 32) p[e] = expf(l[e] - mx) / sum;
  }
  __syncwarp();  // the groups below read other lanes' probabilities
  // What the choice ranks: the logit (the sigmoid score), or with a bias the biased score.
  auto key = [&](int e) {
    if (f.bias == nullptr) return f.sigmoid ? p[e] : l[e];
    return (f.topk_softmax ? l[e] : p[e]) + f.bias[e];
  };

  // DeepSeek: groups ranked by their best key (sigmoid: the sum of their two best);
  // lane x holds groups x and x + 32.
  uint64_t allowed = ~0ull;
  const int group_size = e_n / f.n_group;
  if (f.n_group > 1) {
    float gmax[2] = {-INFINITY, -INFINITY};
    for (int x = 0; x < 2; ++x) {
      const int grp = lane + 32 * x;
      if (grp >= f.n_group) continue;
      float second = -INFINITY;
      for (int e = grp * group_size; e < (grp + 1) * group_size; ++e) {
        const float v = key(e);
        if (v > gmax[x]) {
          second = gmax[x];
          gmax[x] = v;
        } else if (v > second) {
          second = v;
        }
      }
      if (f.sigmoid) gmax[x] += second;
    }
    allowed = 0;
    Pick prev{INFINITY, -1};
    for (int j = 0; j < f.topk_group; ++j) {
      Pick best{0.0f, -1};
      for (int x = 0; x < 2; ++x) {
        const Pick c{gmax[x], lane + 32 * x};
        if (c.id < f.n_group && (prev.id < 0 || before(prev, c)) && before(c, best)) best = c;
      }
      prev = warp_best(best);
      allowed |= 1ull << prev.id;
    }
  }

  Pick prev{INFINITY, -1};
  for (int j = 0; j < k; ++j) {
    Pick best{0.0f, -1};
    for (int e = lane; e < e_n; e += 32) {
      const Pick c{key(e), e};
      if ((allowed >> (e / group_size) & 1) && (prev.id < 0 || before(prev, c)) && before(c, best)) best = c;
    }
    prev = warp_best(best);
    if (lane == 0) it[j] = prev.id;
  }
  __syncwarp();  // the picks, written by lane 0, are read back by every lane

  if (f.topk_softmax) {
    // The shift by the largest chosen logit (the first, unless biased) keeps it stable.
    float top = l[it[0]];
    for (int j = 1; j < k; ++j) top = fmaxf(top, l[it[j]]);
    float s = 0.0f;
    for (int j = lane; j < k; j += 32) s += expf(l[it[j]] - top);
    s = warp_sum(s);
    for (int j = lane; j < k; j += 32) w[j] = expf(l[it[j]] - top) / s;
  } else if (f.sigmoid) {
    float s = 0.0f;
    for (int j = lane; j < k; j += 32) s += p[it[j]];
    s = warp_sum(s);
    // transformers' DeepSeek-V3 adds 1e-20 to the denominator.
    const float factor = f.normalize ? f.scale / (s + 1e-20f) : f.scale;
    for (int j = lane; j < k; j += 32) w[j] = p[it[j]] * factor;
    float total = 0.0f;
    for (int e = lane; e < e_n; e += 32) total += p[e];
    total = warp_sum(total);
    __syncwarp();  // every lane has read the chosen scores before they are normalised
    if (lane == 0) f.score_sum[t] = total;
    for (int e = lane; e < e_n; e += 32) p[e] /= total;
  } else {
    float s = 0.0f;
    for (int j = lane; j < k; j += 32) s += expf(l[it[j]] - mx) / sum;
    s = warp_sum(s);
    const float factor = f.normalize ? f.scale / s : f.scale;
    for (int j = lane; j < k; j += 32) w[j] = expf(l[it[j]] - mx) / sum * factor;
  }
}

struct Backward {
  const int32_t* idx;
  const float* weight;
  const float* probs;
  const float* dweight;
  const float* dprobs;     // null: no load-balance gradient
  const float* score_sum;  // sigmoid only
  long long group;         // tokens a dprobs row
  float* dlogits;
  Dims d;
  bool topk_softmax, sigmoid, normalize;
  float scale;
};

// Sigmoid scoring (router.h has the formula): dl first holds the gradient with respect
// to the scores s = p * S, then goes through the sigmoid.
__device__ void sigmoid_token_backward(const Backward& b, int t, const int32_t* it, const float* p, const float* dw,
                                       const float* dp, float* dl) {
  const int lane = threadIdx.x % 32, e_n = b.d.e, k = b.d.k;
  const float S = b.score_sum[t];
  float pdot = 0.0f;
  if (dp != nullptr)
    for (int e = lane; e < e_n; e += 32) pdot += p[e] * dp[e];
  pdot = warp_sum(pdot);
  for (int e = lane; e < e_n; e += 32) dl[e] = dp != nullptr ? (dp[e] - pdot) / S : 0.0f;
  __syncwarp();
  if (b.normalize) {
    float den = 0.0f, dot = 0.0f;
    for (int j = lane; j < k; j += 32) {
      den += p[it[j]] * S;
      dot += dw[j] * p[it[j]] * S;
    }
    den = warp_sum(den) + 1e-20f;
    dot = warp_sum(dot) / den;
    for (int j = lane; j < k; j += 32) dl[it[j]] += b.scale / den * (dw[j] - dot);
  } else {
    for (int j = lane; j < k; j += 32) dl[it[j]] += b.scale * dw[j];
  }
  __syncwarp();
  for (int e = lane; e < e_n; e += 32) {
    const float s = p[e] * S;
    dl[e] *= s * (1.0f - s);
  }
}

// dlogits first holds the gradient with respect to probs, then goes through the softmax;
// the scattered adds touch other lanes' elements, hence the warp barriers between phases.
__global__ void router_backward_kernel(Backward b) {
  const int t = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= b.d.n) return;
  const int e_n = b.d.e, k = b.d.k;
  const int32_t* it = b.idx + static_cast<long long>(t) * k;
  const float* p = b.probs + static_cast<long long>(t) * e_n;
  const float* dw = b.dweight + static_cast<long long>(t) * k;
  const float* w = b.weight + static_cast<long long>(t) * k;
  float* dl = b.dlogits + static_cast<long long>(t) * e_n;
  for (int j = lane; j < k; j += 32)
    if (it[j] < 0 || it[j] >= e_n) __trap();

  const float* dp = b.dprobs != nullptr ? b.dprobs + static_cast<long long>(t) / b.group * e_n : nullptr;
  if (b.sigmoid) return sigmoid_token_backward(b, t, it, p, dw, dp, dl);
  for (int e = lane; e < e_n; e += 32) dl[e] = dp != nullptr ? dp[e] : 0.0f;
  __syncwarp();
  if (!b.topk_softmax) {
    if (b.normalize) {
      // w_j = scale * p_j / S with S the sum of the k chosen probabilities.
      float s = 0.0f, dot = 0.0f;
      for (int j = lane; j < k; j += 32) {
        s += p[it[j]];
        dot += dw[j] * p[it[j]];
      }
      s = warp_sum(s);
      dot = warp_sum(dot) / s;
      for (int j = lane; j < k; j += 32) dl[it[j]] += b.scale / s * (dw[j] - dot);
    } else {
      for (int j = lane; j < k; j += 32) dl[it[j]] += b.scale * dw[j];
    }
  }
  __syncwarp();
  float pdot = 0.0f;
  for (int e = lane; e < e_n; e += 32) pdot += p[e] * dl[e];
  pdot = warp_sum(pdot);
  for (int e = lane; e < e_n; e += 32) dl[e] = p[e] * (dl[e] - pdot);
  if (b.topk_softmax) {
    // The k weights are a softmax of the k chosen logits on their own.
    __syncwarp();
    float wdot = 0.0f;
    for (int j = lane; j < k; j += 32) wdot += w[j] * dw[j];
    wdot = warp_sum(wdot);
    for (int j = lane; j < k; j += 32) dl[it[j]] += w[j] * (dw[j] - wdot);
  }
}

// The CPU backend's argument rules, plus the GPU's own: everything on the device and at
// most 64 expert groups (one bit each in a lane's mask).
Dims check_router(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                  const Tensor& probs) {
  MT_CHECK(logits.ndim() == 2) << "router logits should be [N,E], got " << logits.str();
  const int64_t n = logits.dim(0), e = logits.dim(1), k = cfg.top_k;
  MT_CHECK(k >= 1 && k <= e) << "router top_k " << k << " should be in [1, " << e << "] (the number of experts)";
  MT_CHECK(cfg.n_group >= 1 && e % cfg.n_group == 0)
      << "router n_group " << cfg.n_group << " should divide the " << e << " experts";
  MT_CHECK(cfg.n_group <= 64) << "cuda router supports at most 64 expert groups, got n_group=" << cfg.n_group;
  if (cfg.n_group > 1) {
    MT_CHECK(cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group)
        << "router topk_group " << cfg.topk_group << " should be in [1, n_group=" << cfg.n_group << "]";
    MT_CHECK(cfg.topk_group * (e / cfg.n_group) >= k)
        << "router topk_group " << cfg.topk_group << " of " << cfg.n_group << " groups of " << e / cfg.n_group
        << " experts leave fewer than top_k=" << k << " experts to choose from";
  }
  MT_CHECK(cfg.scoring != cpu::RouterScoring::topk_softmax || (cfg.n_group == 1 && cfg.scale == 1.0f))
      << "topk_softmax routing (GPT-OSS) has no expert groups and no scale, got n_group=" << cfg.n_group
      << " scale=" << cfg.scale;
  MT_CHECK(cfg.scoring != cpu::RouterScoring::sigmoid || cfg.n_group == 1 || e / cfg.n_group >= 2)
      << "sigmoid routing ranks a group by its two best experts: n_group " << cfg.n_group << " of " << e
      << " experts leaves " << e / cfg.n_group << " a group";
  check_arg(logits, "router logits", {DType::f32}, {n, e});
  check_arg(idx, "router idx", {DType::i32}, {n, k});
  check_arg(weight, "router weight", {DType::f32}, {n, k});
  check_arg(probs, "router probs", {DType::f32}, {n, e});
  return {static_cast<int>(n), static_cast<int>(e), static_cast<int>(k)};
}

// The sigmoid scoring's per-token score sums: required there, refused elsewhere.
float* score_sum_of(const cpu::RouterConfig& cfg, const Tensor& score_sum, int64_t n) {
  if (cfg.scoring != cpu::RouterScoring::sigmoid) {
    MT_CHECK(score_sum.data == nullptr) << "router score_sum is for sigmoid scoring only, got " << score_sum.str();
    return nullptr;
  }
  MT_CHECK(score_sum.data != nullptr) << "sigmoid routing needs score_sum f32 [" << n
                                      << "] (each token's sum of scores, for the backward), got none";
  check_arg(score_sum, "router score_sum", {DType::f32}, {n});
  return score_sum.f32();
}

}  // namespace

void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias, const Tensor& score_sum) {
  const Dims d = check_router(cfg, logits, idx, weight, probs);
  if (bias.data != nullptr) check_arg(bias, "router bias", {DType::f32}, {d.e});
  float* sums = score_sum_of(cfg, score_sum, d.n);
  if (d.n == 0) return;
  Forward f{logits.f32(),
            bias.data != nullptr ? bias.f32() : nullptr,
            idx.i32(),
            weight.f32(),
            probs.f32(),
            sums,
            d,
            static_cast<int>(cfg.n_group),
            static_cast<int>(cfg.topk_group),
            cfg.scoring == cpu::RouterScoring::topk_softmax,
            cfg.scoring == cpu::RouterScoring::sigmoid,
            cfg.normalize,
            cfg.scale};
  router_forward_kernel<<<blocks_for(d.n, kWarps), kWarps * 32, 0, stream()>>>(f);
  CUDA_CHECK_LAUNCH();
}

void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits,
                     const Tensor& score_sum) {
  const Dims d = check_router(cfg, logits, idx, weight, probs);
  const float* sums = score_sum_of(cfg, score_sum, d.n);
  check_arg(dweight, "router dweight", {DType::f32}, {d.n, d.k});
  check_arg(dlogits, "router dlogits", {DType::f32}, {d.n, d.e});
  const int64_t groups = dprobs.data != nullptr && dprobs.ndim() == 2 ? dprobs.dim(0) : 1;
  MT_CHECK(groups >= 1 && d.n % groups == 0) << "router dprobs " << dprobs.str() << ": its rows should divide the "
                                             << d.n << " tokens";
  if (dprobs.data != nullptr) check_arg(dprobs, "router dprobs", {DType::f32}, {groups, d.e});
  if (d.n == 0) return;
  Backward b{idx.i32(),
             weight.f32(),
             probs.f32(),
             dweight.f32(),
             dprobs.data != nullptr ? dprobs.f32() : nullptr,
             sums,
             d.n / groups,
             dlogits.f32(),
             d,
             cfg.scoring == cpu::RouterScoring::topk_softmax,
             cfg.scoring == cpu::RouterScoring::sigmoid,
             cfg.normalize,
             cfg.scale};
  router_backward_kernel<<<blocks_for(d.n, kWarps), kWarps * 32, 0, stream()>>>(b);
  CUDA_CHECK_LAUNCH();
}

// Two passes in a fixed order, so the result does not depend on timing: block (x, c) sums
// rows [c*kRows, (c+1)*kRows) of 128 columns in double, a thread a column (neighbours read
// neighbouring columns); then one thread per column adds the chunks' partials in order.
constexpr int kProbSumRows = 256;

__global__ void router_prob_partial_kernel(const float* probs, long long n, int e_n, double* partial) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= e_n) return;
  const long long t0 = static_cast<long long>(blockIdx.y) * kProbSumRows;
  const long long t1 = t0 + kProbSumRows < n ? t0 + kProbSumRows : n;
  double s = 0;
  for (long long t = t0; t < t1; ++t) s += probs[t * e_n + e];
  partial[static_cast<long long>(blockIdx.y) * e_n + e] = s;
}

__global__ void router_prob_total_kernel(const double* partial, int chunks, int e_n, float* sums) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= e_n) return;
  double s = 0;
  for (int c = 0; c < chunks; ++c) s += partial[static_cast<long long>(c) * e_n + e];
  sums[e] = static_cast<float>(s);
}

void router_prob_sum(const Tensor& probs, const Tensor& sums) {
  MT_CHECK(probs.dtype == DType::f32 && probs.ndim() == 2) << "router_prob_sum wants probs f32 [N,E], got "
                                                            << probs.str();
  const int64_t n = probs.dim(0), e_n = probs.dim(1);
  check_arg(probs, "router probs", {DType::f32}, {n, e_n});
  check_arg(sums, "router prob sums", {DType::f32}, {e_n});
  if (e_n == 0) return;
  const int chunks = static_cast<int>(std::max<int64_t>(1, (n + kProbSumRows - 1) / kProbSumRows));
  auto* partial = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(chunks * e_n)));
  const unsigned cols = static_cast<unsigned>((e_n + 127) / 128);
  router_prob_partial_kernel<<<dim3(cols, static_cast<unsigned>(chunks)), 128, 0, stream()>>>(
      probs.f32(), n, static_cast<int>(e_n), partial);
  CUDA_CHECK_LAUNCH();
  router_prob_total_kernel<<<cols, 128, 0, stream()>>>(partial, chunks, static_cast<int>(e_n), sums.f32());
  CUDA_CHECK_LAUNCH();
}

namespace {

// Block g counts group g's slots per expert in shared memory (an out-of-range expert traps).
__global__ void router_counts_kernel(const int32_t* idx, long long slots, int e_n, int32_t* counts) {
  extern __shared__ int c[];
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) c[e] = 0;
  __syncthreads();
  const int32_t* it = idx + static_cast<long long>(blockIdx.x) * slots;
  for (long long s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = it[s];
    if (e < 0 || e >= e_n) __trap();
    atomicAdd(&c[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) counts[static_cast<long long>(blockIdx.x) * e_n + e] = c[e];
}

}  // namespace

void router_counts(const Tensor& idx, const Tensor& counts) {
  MT_CHECK(idx.ndim() == 2 && counts.ndim() == 2 && counts.dim(0) >= 1 && idx.dim(0) % counts.dim(0) == 0)
      << "router_counts wants idx i32 [N,k] and counts i32 [G,E] with G dividing N, got " << idx.str() << " and "
      << counts.str();
  check_arg(idx, "router idx", {DType::i32}, {idx.dim(0), idx.dim(1)});
  check_arg(counts, "router counts", {DType::i32}, {counts.dim(0), counts.dim(1)});
  const int64_t groups = counts.dim(0), e_n = counts.dim(1);
  if (e_n == 0) return;
  router_counts_kernel<<<static_cast<unsigned>(groups), 256, static_cast<size_t>(e_n) * sizeof(int), stream()>>>(
      idx.i32(), idx.numel() / groups, static_cast<int>(e_n), counts.i32());
  CUDA_CHECK_LAUNCH();
}

namespace {

// logsumexp of row t of logits [N, E] across one warp, in double (every lane gets it).
__device__ double warp_row_lse(const float* l, int e_n) {
  const int lane = threadIdx.x & 31;
  double m = -INFINITY;
  for (int e = lane; e < e_n; e += 32) m = fmax(m, double{l[e]});
  for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  double s = 0;
  for (int e = lane; e < e_n; e += 32) s += exp(double{l[e]} - m);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return m + log(s);
}

// A block of 8 warps takes kProbSumRows tokens, a warp a token at a time; lane 0 of each
// warp writes its tokens' lse and adds their z in order, then thread 0 adds the warps'
// sums in order.
__global__ void router_z_partial_kernel(const float* logits, long long n, int e_n, float* lse_out, double* partial) {
  __shared__ double warps[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long t0 = static_cast<long long>(blockIdx.x) * kProbSumRows;
  double s = 0;
  for (long long t = t0 + warp; t < t0 + kProbSumRows && t < n; t += 8) {
    const double lse = warp_row_lse(logits + t * e_n, e_n);
    if (lane == 0) lse_out[t] = static_cast<float>(lse);
    s += lse * lse;
  }
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < 8; ++w) total += warps[w];
    partial[blockIdx.x] = total;
  }
}

__global__ void router_z_total_kernel(const double* partial, int chunks, float* sum) {
  double s = 0;
  for (int c = 0; c < chunks; ++c) s += partial[c];
  sum[0] = static_cast<float>(s);
}

__global__ void router_z_backward_kernel(const float* lse, const float* probs, long long total, int e_n, float scale,
                                         float* dlogits) {
  MT_GRID_STRIDE(i, total) dlogits[i] += 2.0f * scale * lse[i / e_n] * probs[i];
}

}  // namespace

void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum) {
  MT_CHECK(logits.dtype == DType::f32 && logits.ndim() == 2 && logits.dim(1) >= 1)
      << "router_z_forward wants logits f32 [N,E], got " << logits.str();
  const int64_t n = logits.dim(0), e_n = logits.dim(1);
  check_arg(logits, "router logits", {DType::f32}, {n, e_n});
  check_arg(lse, "router z lse", {DType::f32}, {n});
  check_arg(sum, "router z sum", {DType::f32}, {1});
  const int chunks = static_cast<int>(std::max<int64_t>(1, (n + kProbSumRows - 1) / kProbSumRows));
  auto* partial = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(chunks)));
  router_z_partial_kernel<<<static_cast<unsigned>(chunks), 256, 0, stream()>>>(logits.f32(), n, static_cast<int>(e_n),
                                                                                lse.f32(), partial);
  CUDA_CHECK_LAUNCH();
  router_z_total_kernel<<<1, 1, 0, stream()>>>(partial, chunks, sum.f32());
  CUDA_CHECK_LAUNCH();
}

void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits) {
  MT_CHECK(probs.dtype == DType::f32 && probs.ndim() == 2) << "router_z_backward wants probs f32 [N,E], got "
                                                            << probs.str();
  const int64_t n = probs.dim(0), e_n = probs.dim(1);
  check_arg(lse, "router z lse", {DType::f32}, {n});
  check_arg(probs, "router probs", {DType::f32}, {n, e_n});
  check_arg(dlogits, "router z dlogits", {DType::f32}, {n, e_n});
  if (n * e_n == 0) return;
  router_z_backward_kernel<<<blocks_for(n * e_n, 256), 256, 0, stream()>>>(lse.f32(), probs.f32(), n * e_n,
                                                                           static_cast<int>(e_n), scale, dlogits.f32());
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
