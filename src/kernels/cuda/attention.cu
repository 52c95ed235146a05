// Causal flash attention on the GPU (docs/architecture.md, src/kernels, has the design):
// bf16 q/k/v/out/dout, f32 softmax statistics, mma.sync m16n8k16 on the tensor cores, 4 warps
// a block of 16 rows each, heads zero-padded in shared memory: q/k to DQ = 64, 128, 192 or
// 256 columns, v/out to DV = 64, 128 or 256 (DV = DQ but MLA's 192/128; 256/256 is
// Qwen3.5's full attention, whose per-thread accumulators spill: cuDNN's route first).
//   forward  a block per 64 query rows of one (b, h), over 64-key tiles, online softmax
//   dK, dV   a block per 64-key tile of one (b, kv head), over its group's query heads
//   dQ       a block per 64 query rows of one (b, h), over 32-key tiles, recomputing Q K^T
//            and dout V^T rather than adding into dQ with atomics
// delta = dout . out runs first, dsinks last. P is recomputed from lse in every pass and
// nothing is accumulated in a scheduling-dependent order, so runs repeat bit for bit.

#include <cmath>

#include "kernels/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  const bf16 *q, *k, *v, *out, *dout;
  const float* sinks;  // null without sinks
  const float* lse;
  float* lse_out;
  float* delta;  // backward scratch [B,Hq,Tq]
  bf16 *o, *dq, *dk, *dv;
  float* dsinks;
  int b, tq, tk, hq, hkv, d, d_v, group;  // d: q and k's head dim, d_v: v and out's
  long long shift;   // q_offset - k_offset: query i sits shift + i - j positions after key j
  long long window;  // 0: none
  float scale, scale_log2;
  bool vec;  // head rows are 16-byte aligned (d and d_v multiples of 8): tiles load with cp.async
};

// Query i sees key j when it is not earlier and, with a window, less than window back.
__device__ __forceinline__ bool visible(const Params& p, int i, int j) {
  if (i >= p.tq || j >= p.tk) return false;
  const long long back = p.shift + i - j;
  return back >= 0 && (p.window == 0 || back < p.window);
}

// Every pair of rows [i0, i1] x keys [j0, j1] visible: the tile needs no mask.
__device__ __forceinline__ bool all_visible(const Params& p, int i0, int i1, int j0, int j1) {
  return i1 < p.tq && j1 < p.tk && p.shift + i0 - j1 >= 0 && (p.window == 0 || p.shift + i1 - j0 < p.window);
}

// Keys [lo, hi] that query rows [i0, i1] can see (empty when lo > hi).
__device__ __forceinline__ void keys_seen(const Params& p, int i0, int i1, int& lo, int& hi) {
  long long l = p.window > 0 ? p.shift + i0 - p.window + 1 : 0;
  long long h = p.shift + i1;
  lo = static_cast<int>(l < 0 ? 0 : l);
  hi = static_cast<int>(h >= p.tk ? p.tk - 1 : h);
}

// Query rows [lo, hi] that can see keys [j0, j1].
__device__ __forceinline__ void queries_seeing(const Params& p, int j0, int j1, int& lo, int& hi) {
  long long l = j0 - p.shift;
  long long h = p.window > 0 ? j1 - p.shift + p.window - 1 : p.tq - 1;
  lo = static_cast<int>(l < 0 ? 0 : (l > p.tq ? p.tq : l));
  hi = static_cast<int>(h >= p.tq ? p.tq - 1 : h);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // A source size of 0 writes 16 zero bytes and reads nothing.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p, bool trans) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// c += a (16x16, row-major fragment) * b (16x8, column fragment), f32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x in one MUFU instruction. Flushing subnormal results to 0 changes nothing that
// matters here: such probabilities vanish next to the row's largest, which is 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Fragments from a shared tile with row stride S elements (ldmatrix: lane l names a row
// of one of four 8x8 matrices). An A operand at rows m0.., columns k0..: a[0..3].
template <int S>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int m0, int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4(a, tile + (m0 + l % 8 + (l / 8) % 2 * 8) * S + k0 + l / 16 * 8, false);
}
// B operands of the n-tiles n0 and n0+8 over k0..k0+15, from a tile stored [n][k]
// (K rows for Q K^T): b[0..1] for n0, b[2..3] for n0+8.
template <int S>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* tile, int n0, int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4(b, tile + (n0 + l % 8 + l / 16 * 8) * S + k0 + (l / 8) % 2 * 8, false);
}
// The same from a tile stored [k][n] (V rows for P V), through the transposing load.
template <int S>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* tile, int k0, int n0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4(b, tile + (k0 + l % 8 + (l / 8) % 2 * 8) * S + n0 + l / 16 * 8, true);
}

// c[t] += a b[0..1], c[t + 1] += a b[2..3]: the two n-tiles of a B pair from load_b_nk/kn.
template <int N>
__device__ __forceinline__ void mma_pair(float (&c)[N][4], int t, const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma(c[t], a, b[0], b[1]);
  mma(c[t + 1], a, b[2], b[3]);
}

// Two accumulator n-tiles (16x8 each, C layout) are one A fragment over their 16 columns.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Row r (0: this thread's first, 1: its second, 8 below) of N accumulator n-tiles, times
// scale, into the first d columns of a bf16 row.
template <int N>
__device__ __forceinline__ void store_row(bf16* row, const float (&c)[N][4], int r, int d, float scale) {
  const int quad = threadIdx.x % 4;
#pragma unroll
  for (int t = 0; t < N; ++t)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = t * 8 + 2 * quad + e;
      if (col < d) row[col] = __float2bfloat16(c[t][2 * r + e] * scale);
    }
}

// One k-step (k0..k0+15) of c += a b over N columns: a this warp's A fragment, b a tile
// stored [n][k] (K rows for Q K^T; mma_nk) or [k][n] (V rows for P V; mma_kn).
template <int S, int N>
__device__ __forceinline__ void mma_nk(float (&c)[N / 8][4], const uint32_t (&a)[4], const bf16* b, int k0) {
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    uint32_t f[4];
    load_b_nk<S>(f, b, np * 16, k0);
    mma_pair(c, 2 * np, a, f);
  }
}
template <int S, int N>
__device__ __forceinline__ void mma_kn(float (&c)[N / 8][4], const uint32_t (&a)[4], const bf16* b, int k0) {
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    uint32_t f[4];
    load_b_kn<S>(f, b, k0, np * 16);
    mma_pair(c, 2 * np, a, f);
  }
}

// c += a b^T over K: a this warp's K/16 A fragments (kept in registers), b a tile stored
// [n][k] of N rows (K or V rows for Q K^T and dout V^T).
template <int S, int K, int N>
__device__ __forceinline__ void mma_abt(float (&c)[N / 8][4], const uint32_t (&a)[K / 16][4], const bf16* b) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) mma_nk<S, N>(c, a[kk], b, kk * 16);
}

// c += p b over K: p the K/8 accumulator tiles of a product (probabilities or dS), as
// bf16 A fragments, b a tile stored [k][n] of N columns (V for P V, K for dS K).
template <int S, int K, int N>
__device__ __forceinline__ void mma_pb(float (&c)[N / 8][4], const float (&p)[K / 8][4], const bf16* b) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    c_to_a(a, p[2 * kk], p[2 * kk + 1]);
    mma_kn<S, N>(c, a, b, kk * 16);
  }
}

// Scores of this thread's rows (row0 and row0 + 8, of the block's rows [i0, i_last]; quad
// is its lane % 4) for the N keys from j0 that the rows cannot see set to `masked`. Only
// tiles on the diagonal or the window's edge need the per-element test.
template <int N>
__device__ __forceinline__ void mask_scores(float (&s)[N / 8][4], const Params& p, int i0, int i_last, int row0,
                                            int quad, int j0, float masked) {
  if (all_visible(p, i0, i_last, j0, j0 + N - 1)) return;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!visible(p, row0 + e / 2 * 8, j0 + nt * 8 + 2 * quad + e % 2)) s[nt][e] = masked;
}

// Columns D..DP-1 of a tile are zero so padded heads add nothing to the products; the
// loads below never write them, so this runs once per buffer.
template <int ROWS, int DP>
__device__ void zero_pad(bf16* tile, int d) {
  constexpr int S = DP + 8;
  const int w = DP - d;
  for (int c = threadIdx.x; c < ROWS * w; c += kThreads) tile[c / w * S + d + c % w] = __float2bfloat16(0.0f);
}

// Rows t0..t0+ROWS-1 of one head of a [B,T,H,D] tensor (head0 points at row 0 of the
// head, stride elements apart) into a [ROWS][DP+8] tile. Rows past T are zero, so masked
// scores never meet garbage (0 * NaN would poison a product).
template <int ROWS, int DP>
__device__ void load_tile(bf16* tile, const bf16* head0, long long stride, int t0, int t_end, int d, bool vec) {
  constexpr int S = DP + 8;
  if (vec) {
    const int chunks = d / 8;
    for (int c = threadIdx.x; c < ROWS * chunks; c += kThreads) {
      const int r = c / chunks, x = c % chunks, t = t0 + r;
      // A zero-filling copy reads nothing, but its address should still be a real one.
      const bf16* src = head0 + (t < t_end ? t : 0) * stride + x * 8;
      cp_async16(tile + r * S + x * 8, src, t < t_end);
    }
  } else {
    for (int c = threadIdx.x; c < ROWS * d; c += kThreads) {
      const int r = c / d, x = c % d, t = t0 + r;
      tile[r * S + x] = t < t_end ? head0[t * stride + x] : __float2bfloat16(0.0f);
    }
  }
}

template <int DQ, int DV>
constexpr int forward_smem = (2 * 64 * (DQ + 8) + 64 * (DV + 8)) * 2;

template <int DQ, int DV>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  constexpr int S = DQ + 8, SV = DV + 8, BM = 64, BN = 64;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + BM * S;
  bf16* vs = ks + BN * S;
  // Later query tiles see more keys under the causal mask: start them first.
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const long long q_stride = static_cast<long long>(p.hq) * p.d, k_stride = static_cast<long long>(p.hkv) * p.d,
                  v_stride = static_cast<long long>(p.hkv) * p.d_v;
  const bf16* qh = p.q + (static_cast<long long>(b) * p.tq * p.hq + h) * p.d;
  const bf16* kh = p.k + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d;
  const bf16* vh = p.v + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d_v;
  const int i_last = min(i0 + BM, p.tq) - 1;
  int j_lo, j_hi;
  keys_seen(p, i0, i_last, j_lo, j_hi);
  const int n_first = j_lo / BN, n_last = j_lo <= j_hi ? j_hi / BN : n_first - 1;

  zero_pad<BM, DQ>(qs, p.d);
  zero_pad<BN, DQ>(ks, p.d);
  zero_pad<BN, DV>(vs, p.d_v);
  load_tile<BM, DQ>(qs, qh, q_stride, i0, p.tq, p.d, p.vec);
  if (n_first <= n_last) load_tile<BN, DQ>(ks, kh, k_stride, n_first * BN, p.tk, p.d, p.vec);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  uint32_t qa[DQ / 16][4];
#pragma unroll
  for (int kk = 0; kk < DQ / 16; ++kk) load_a<S>(qa[kk], qs, warp * 16, kk * 16);
  float acc[DV / 8][4] = {};
  // Scores are kept in log2 units (scaled by log2 e) so exp is one ex2. The sink joins
  // the running max from the start and the denominator at the end.
  const float sink2 = p.sinks != nullptr ? p.sinks[h] * kLog2e : -INFINITY;
  float m[2] = {sink2, sink2}, l[2] = {0.0f, 0.0f};
  const int row0 = i0 + warp * 16 + grp;  // this thread's rows: row0 and row0 + 8

  for (int n = n_first; n <= n_last; ++n) {
    const int j0 = n * BN;
    load_tile<BN, DV>(vs, vh, v_stride, j0, p.tk, p.d_v, p.vec);
    cp_async_commit();

    float s[BN / 8][4] = {};
    mma_abt<S, DQ, BN>(s, qa, ks);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
    mask_scores<BN>(s, p, i0, i_last, row0, quad, j0, -INFINITY);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen nothing yet keeps max -inf; shift by 0 so exp gives 0, not NaN.
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = exp2_ftz(m[r] - base);
      m[r] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float pr = exp2_ftz(s[nt][2 * r + c] - base);
          s[nt][2 * r + c] = pr;
          sum += pr;
        }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < DV / 8; ++dt) {
        acc[dt][2 * r] *= alpha;
        acc[dt][2 * r + 1] *= alpha;
      }
    }
    cp_async_wait_all();
    __syncthreads();  // V has landed; every warp is done with K
    if (n < n_last) load_tile<BN, DQ>(ks, kh, k_stride, j0 + BN, p.tk, p.d, p.vec);
    cp_async_commit();
    mma_pb<SV, BN, DV>(acc, s, vs);
    cp_async_wait_all();
    __syncthreads();  // the next K has landed; every warp is done with V
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (p.sinks != nullptr) sum += exp2_ftz(sink2 - m[r]);
    const int row = row0 + 8 * r;
    if (row >= p.tq) continue;
    // An empty denominator (no visible key, no sink): lse -inf and output 0.
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (quad == 0)
      p.lse_out[(static_cast<long long>(b) * p.hq + h) * p.tq + row] =
          sum > 0.0f ? (m[r] + log2f(sum)) * kLn2 : -INFINITY;
    store_row(p.o + ((static_cast<long long>(b) * p.tq + row) * p.hq + h) * p.d_v, acc, r, p.d_v, inv);
  }
}

// delta[b,h,i] = dout . out over the head, the D_i of dS = P (dP - D_i). One warp a row.
__global__ void delta_kernel(Params p) {
  const long long row = static_cast<long long>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (b*Tq + i)*Hq + h
  if (row >= static_cast<long long>(p.b) * p.tq * p.hq) return;
  const int lane = threadIdx.x % 32;
  const bf16* o = p.out + row * p.d_v;
  const bf16* g = p.dout + row * p.d_v;
  float s = 0.0f;
  for (int c = lane; c < p.d_v; c += 32) s += __bfloat162float(o[c]) * __bfloat162float(g[c]);
  s = warp_sum(s);
  const int h = static_cast<int>(row % p.hq);
  const long long bi = row / p.hq;
  const int b = static_cast<int>(bi / p.tq), i = static_cast<int>(bi % p.tq);
  if (lane == 0) p.delta[(static_cast<long long>(b) * p.hq + h) * p.tq + i] = s;
}

// dsinks[h] += -sum over (b, i) of exp(sink_h - lse) * D_i. One block a head, and a fixed
// reduction order, so the sum does not depend on scheduling.
__global__ void dsinks_kernel(Params p) {
  __shared__ float part[kThreads];
  const int h = blockIdx.x;
  float s = 0.0f;
  for (int x = threadIdx.x; x < p.b * p.tq; x += kThreads) {
    const long long at = (static_cast<long long>(x / p.tq) * p.hq + h) * p.tq + x % p.tq;
    s += expf(p.sinks[h] - p.lse[at]) * p.delta[at];
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.dsinks[h] -= part[0];
}

// dK/dV: K and V, two buffers each of Q and dout, and of lse and delta; dQ: Q and dout, two
// buffers each of K and V (and 512 bytes unused).
template <int DQ, int DV>
constexpr int backward_smem = (128 * (DQ + 8) + 128 * (DV + 8)) * 2 + 4 * 32 * 4;

template <int DQ, int DV>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  constexpr int S = DQ + 8, SV = DV + 8, BN = 64, BM = 32;  // BN keys per block, BM query rows per step
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem);
  bf16* vs = ks + BN * S;
  // Two buffers each of Q and dout rows, lse (log2 units) and delta; buffer x of qs at
  // qs + x * BM * S (pointer arithmetic, not an array of pointers, keeps them in registers).
  bf16* qs = vs + BN * SV;
  bf16* gs = qs + 2 * BM * S;
  float* lse_s = reinterpret_cast<float*>(gs + 2 * BM * SV);
  float* delta_s = lse_s + 2 * BM;
  const int j0 = blockIdx.x * BN, g = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const long long q_stride = static_cast<long long>(p.hq) * p.d, k_stride = static_cast<long long>(p.hkv) * p.d;
  const long long o_stride = static_cast<long long>(p.hq) * p.d_v, v_stride = static_cast<long long>(p.hkv) * p.d_v;
  const int j_last = min(j0 + BN, p.tk) - 1;
  int i_lo, i_hi;
  queries_seeing(p, j0, j_last, i_lo, i_hi);
  const int q_tiles = i_lo <= i_hi ? i_hi / BM - i_lo / BM + 1 : 0;
  const int steps = p.group * q_tiles;  // (query head of the group, query tile) pairs

  auto load_step = [&](int st, int buf) {
    const int h = g * p.group + st / q_tiles, i0 = (i_lo / BM + st % q_tiles) * BM;
    const long long head = static_cast<long long>(b) * p.tq * p.hq + h;
    load_tile<BM, DQ>(qs + buf * BM * S, p.q + head * p.d, q_stride, i0, p.tq, p.d, p.vec);
    load_tile<BM, DV>(gs + buf * BM * SV, p.dout + head * p.d_v, o_stride, i0, p.tq, p.d_v, p.vec);
    for (int r = threadIdx.x; r < BM; r += kThreads) {
      const long long at = (static_cast<long long>(b) * p.hq + h) * p.tq + i0 + r;
      const bool in = i0 + r < p.tq;
      lse_s[buf * BM + r] = in ? p.lse[at] * kLog2e : 0.0f;
      delta_s[buf * BM + r] = in ? p.delta[at] : 0.0f;
    }
  };

  zero_pad<BN, DQ>(ks, p.d);
  zero_pad<BN, DV>(vs, p.d_v);
  zero_pad<2 * BM, DQ>(qs, p.d);
  zero_pad<2 * BM, DV>(gs, p.d_v);
  const bf16* kh = p.k + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d;
  const bf16* vh = p.v + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d_v;
  load_tile<BN, DQ>(ks, kh, k_stride, j0, p.tk, p.d, p.vec);
  load_tile<BN, DV>(vs, vh, v_stride, j0, p.tk, p.d_v, p.vec);
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[DQ / 8][4] = {}, dv[DV / 8][4] = {};
  const int key0 = j0 + warp * 16 + grp;  // this thread's keys: key0 and key0 + 8
  for (int st = 0; st < steps; ++st) {
    const int buf = st & 1;
    cp_async_wait_all();
    __syncthreads();  // step st has landed; every warp is done with the other buffer
    if (st + 1 < steps) load_step(st + 1, buf ^ 1);
    cp_async_commit();
    const int i0 = (i_lo / BM + st % q_tiles) * BM;
    const bf16* qt = qs + buf * BM * S;
    const bf16* gt = gs + buf * BM * SV;

    // S^T = K Q^T and dP^T = V dout^T for this warp's 16 keys and the BM queries.
    float s[BM / 8][4] = {}, dpt[BM / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DQ / 16; ++kk) {
      uint32_t ka[4];
      load_a<S>(ka, ks, warp * 16, kk * 16);
      mma_nk<S, BM>(s, ka, qt, kk * 16);
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      uint32_t va[4];
      load_a<SV>(va, vs, warp * 16, kk * 16);
      mma_nk<SV, BM>(dpt, va, gt, kk * 16);
    }
    // P^T = exp(S^T - lse) and dS^T = P^T (dP^T - D). Masked entries are then set to
    // exactly 0 (the exp may be inf there: a row that sees nothing has lse -inf).
    const float* lse_t = lse_s + buf * BM;
    const float* delta_t = delta_s + buf * BM;
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = exp2_ftz(s[nt][e] * p.scale_log2 - lse_t[nt * 8 + 2 * quad + e % 2]);
    if (!all_visible(p, i0, i0 + BM - 1, j0, j0 + BN - 1)) {
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!visible(p, i0 + nt * 8 + 2 * quad + e % 2, key0 + e / 2 * 8)) s[nt][e] = 0.0f;
    }
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[nt][e] = s[nt][e] * (dpt[nt][e] - delta_t[nt * 8 + 2 * quad + e % 2]);
    // dV += P^T dout and dK += dS^T Q, contracting over the BM queries.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4], da[4];
      c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
      c_to_a(da, dpt[2 * kk], dpt[2 * kk + 1]);
      mma_kn<SV, DV>(dv, pa, gt, kk * 16);
      mma_kn<S, DQ>(dk, da, qt, kk * 16);
    }
  }

  // Every key row of the tile is written, zero when no query sees it.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= p.tk) continue;
    const long long at = (static_cast<long long>(b) * p.tk + key) * p.hkv + g;
    store_row(p.dk + at * p.d, dk, r, p.d, p.scale);
    store_row(p.dv + at * p.d_v, dv, r, p.d_v, 1.0f);
  }
}

template <int DQ, int DV>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  constexpr int S = DQ + 8, SV = DV + 8, BM = 64, BN = 32;  // BM query rows per block, BN keys per step
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* gs = qs + BM * S;
  // Two buffers each of K and V rows, buffer x at ks + x * BN * S (vs + x * BN * SV).
  bf16* ks = gs + BM * SV;
  bf16* vs = ks + 2 * BN * S;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const long long q_stride = static_cast<long long>(p.hq) * p.d, k_stride = static_cast<long long>(p.hkv) * p.d;
  const long long o_stride = static_cast<long long>(p.hq) * p.d_v, v_stride = static_cast<long long>(p.hkv) * p.d_v;
  const long long head = static_cast<long long>(b) * p.tq * p.hq + h;
  const bf16* kh = p.k + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d;
  const bf16* vh = p.v + (static_cast<long long>(b) * p.tk * p.hkv + g) * p.d_v;
  const int i_last = min(i0 + BM, p.tq) - 1;
  int j_lo, j_hi;
  keys_seen(p, i0, i_last, j_lo, j_hi);
  const int n_first = j_lo / BN, n_last = j_lo <= j_hi ? j_hi / BN : n_first - 1;
  auto load_kv = [&](int n, int buf) {
    load_tile<BN, DQ>(ks + buf * BN * S, kh, k_stride, n * BN, p.tk, p.d, p.vec);
    load_tile<BN, DV>(vs + buf * BN * SV, vh, v_stride, n * BN, p.tk, p.d_v, p.vec);
  };

  zero_pad<BM, DQ>(qs, p.d);
  zero_pad<BM, DV>(gs, p.d_v);
  zero_pad<2 * BN, DQ>(ks, p.d);
  zero_pad<2 * BN, DV>(vs, p.d_v);
  load_tile<BM, DQ>(qs, p.q + head * p.d, q_stride, i0, p.tq, p.d, p.vec);
  load_tile<BM, DV>(gs, p.dout + head * p.d_v, o_stride, i0, p.tq, p.d_v, p.vec);
  if (n_first <= n_last) load_kv(n_first, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  uint32_t qa[DQ / 16][4], ga[DV / 16][4];
#pragma unroll
  for (int kk = 0; kk < DQ / 16; ++kk) load_a<S>(qa[kk], qs, warp * 16, kk * 16);
#pragma unroll
  for (int kk = 0; kk < DV / 16; ++kk) load_a<SV>(ga[kk], gs, warp * 16, kk * 16);
  const int row0 = i0 + warp * 16 + grp;  // this thread's rows: row0 and row0 + 8
  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    const long long at = (static_cast<long long>(b) * p.hq + h) * p.tq + row;
    lse2[r] = row < p.tq ? p.lse[at] * kLog2e : 0.0f;
    dlt[r] = row < p.tq ? p.delta[at] : 0.0f;
  }
  float dq[DQ / 8][4] = {};

  for (int n = n_first; n <= n_last; ++n) {
    const int buf = (n - n_first) & 1, j0 = n * BN;
    if (n > n_first) {
      cp_async_wait_all();
      __syncthreads();  // tile n has landed; every warp is done with the other buffer
    }
    if (n < n_last) load_kv(n + 1, buf ^ 1);
    cp_async_commit();
    const bf16* kt = ks + buf * BN * S;
    const bf16* vt = vs + buf * BN * SV;

    float s[BN / 8][4] = {}, dpv[BN / 8][4] = {};
    mma_abt<S, DQ, BN>(s, qa, kt);
    mma_abt<SV, DV, BN>(dpv, ga, vt);
    // P = exp(S - lse), masked entries then exactly 0 (see the dK/dV kernel).
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = exp2_ftz(s[nt][e] * p.scale_log2 - lse2[e / 2]);
    mask_scores<BN>(s, p, i0, i_last, row0, quad, j0, 0.0f);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpv[nt][e] = s[nt][e] * (dpv[nt][e] - dlt[e / 2]);
    // dQ += dS K, contracting over the BN keys.
    mma_pb<S, BN, DQ>(dq, dpv, kt);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= p.tq) continue;
    store_row(p.dq + ((static_cast<long long>(b) * p.tq + row) * p.hq + h) * p.d, dq, r, p.d, p.scale);
  }
}

// Checks the inputs and the forward's outputs and fills the parameters all kernels share.
Params make_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                   const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4)
      << "attention q should be [B,Tq,Hq,Dqk], k [B,Tk,Hkv,Dqk] and v [B,Tk,Hkv,Dv], got q " << q.str() << ", k "
      << k.str() << ", v " << v.str();
  const int64_t b = q.dim(0), tq = q.dim(1), hq = q.dim(2), d = q.dim(3), tk = k.dim(1), hkv = k.dim(2);
  const int64_t d_v = v.dim(3);
  check_arg(q, "attention q", {DType::bf16}, {b, tq, hq, d});
  check_arg(k, "attention k", {DType::bf16}, {b, tk, hkv, d});
  check_arg(v, "attention v", {DType::bf16}, {b, tk, hkv, d_v});
  MT_CHECK(hkv > 0 && hq % hkv == 0) << "attention query heads " << hq << " not a multiple of kv heads " << hkv;
  MT_CHECK(d >= 1 && d <= 256 && d_v >= 1 && d_v <= 256)
      << "cuda attention supports head dims 1..256, got q " << q.str() << ", v " << v.str();
  MT_CHECK(a.window >= 0) << "attention window must be >= 0, got " << a.window;
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  if (has_sinks) check_arg(sinks, "attention sinks", {DType::f32}, {hq});
  Params p{};
  p.q = bf16_data(q);
  p.k = bf16_data(k);
  p.v = bf16_data(v);
  p.sinks = has_sinks ? sinks.f32() : nullptr;
  p.b = static_cast<int>(b);
  p.tq = static_cast<int>(tq);
  p.tk = static_cast<int>(tk);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.d = static_cast<int>(d);
  p.d_v = static_cast<int>(d_v);
  p.group = static_cast<int>(hq / hkv);
  p.shift = a.q_offset - a.k_offset;
  p.window = a.window;
  p.scale = a.scale;
  p.scale_log2 = a.scale * kLog2e;
  p.vec = d % 8 == 0 && d_v % 8 == 0 && aligned16(q.data) && aligned16(k.data) && aligned16(v.data);
  check_arg(out, "attention out", {DType::bf16}, {b, tq, hq, d_v});
  check_arg(lse, "attention lse", {DType::f32}, {p.b, p.hq, p.tq});
  return p;
}

// Kernels above 48 KB of shared memory must ask for it once.
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int smem, const Params& p) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
}

unsigned tiles(int n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

// The sinks' gradient from delta, after either route's dq, dk, dv.
void add_dsinks(const Params& p) {
  if (p.sinks == nullptr || p.hq == 0) return;
  dsinks_kernel<<<static_cast<unsigned>(p.hq), kThreads, 0, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                       const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  Params p = make_params(q, k, v, sinks, a, out, lse);
  // cuDNN's fused kernels where they compute exactly this (attention_cudnn.h), ours otherwise.
  if (cudnn_attention_forward(q, k, v, sinks, a, out, lse)) return;
  p.o = bf16_data(out);
  p.lse_out = lse.f32();
  p.vec = p.vec && aligned16(out.data);
  const dim3 grid(tiles(p.tq, 64), p.hq, p.b);
  if (p.d <= 64 && p.d_v <= 64)
    launch(forward_kernel<64, 64>, grid, forward_smem<64, 64>, p);
  else if (p.d <= 128 && p.d_v <= 128)
    launch(forward_kernel<128, 128>, grid, forward_smem<128, 128>, p);
  else if (p.d <= 192 && p.d_v <= 128)
    launch(forward_kernel<192, 128>, grid, forward_smem<192, 128>, p);
  else
    launch(forward_kernel<256, 256>, grid, forward_smem<256, 256>, p);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                        const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks) {
  Params p = make_params(q, k, v, sinks, a, out, lse);
  check_arg(dout, "attention dout", {DType::bf16}, out.shape);
  check_arg(dq, "attention dq", {DType::bf16}, q.shape);
  check_arg(dk, "attention dk", {DType::bf16}, k.shape);
  check_arg(dv, "attention dv", {DType::bf16}, v.shape);
  if (p.sinks != nullptr) {
    check_arg(dsinks, "attention dsinks", {DType::f32}, {p.hq});
    p.dsinks = dsinks.f32();
  }
  p.out = bf16_data(out);
  p.dout = bf16_data(dout);
  p.lse = lse.f32();
  p.vec = p.vec && aligned16(dout.data);
  // cuDNN computes dq, dk and dv where it applies; delta and dsinks are always ours, so the
  // sinks' gradient sums in a fixed order on either route. (cuDNN's workspace is scratch()
  // too, so delta's is asked for after it.)
  const bool on_cudnn = cudnn_attention_backward(q, k, v, sinks, a, out, lse, dout, dq, dk, dv);
  if (on_cudnn && p.sinks == nullptr) return;
  const long long rows = static_cast<long long>(p.b) * p.tq * p.hq;
  p.delta = static_cast<float*>(scratch(sizeof(float) * static_cast<size_t>(rows)));
  if (rows > 0) {
    delta_kernel<<<blocks_for(rows, kWarps), kThreads, 0, stream()>>>(p);
    CUDA_CHECK_LAUNCH();
  }
  if (on_cudnn) return add_dsinks(p);
  p.dq = bf16_data(dq);
  p.dk = bf16_data(dk);
  p.dv = bf16_data(dv);
  const dim3 kv_grid(tiles(p.tk, 64), p.hkv, p.b), q_grid(tiles(p.tq, 64), p.hq, p.b);
  if (p.d <= 64 && p.d_v <= 64) {
    launch(dkdv_kernel<64, 64>, kv_grid, backward_smem<64, 64>, p);
    launch(dq_kernel<64, 64>, q_grid, backward_smem<64, 64>, p);
  } else if (p.d <= 128 && p.d_v <= 128) {
    launch(dkdv_kernel<128, 128>, kv_grid, backward_smem<128, 128>, p);
    launch(dq_kernel<128, 128>, q_grid, backward_smem<128, 128>, p);
  } else if (p.d <= 192 && p.d_v <= 128) {
    launch(dkdv_kernel<192, 128>, kv_grid, backward_smem<192, 128>, p);
    launch(dq_kernel<192, 128>, q_grid, backward_smem<192, 128>, p);
  } else {
    launch(dkdv_kernel<256, 256>, kv_grid, backward_smem<256, 256>, p);
    launch(dq_kernel<256, 256>, q_grid, backward_smem<256, 256>, p);
  }
  add_dsinks(p);
}

}  // namespace mt::cuda
