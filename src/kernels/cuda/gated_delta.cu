// The gated delta rule on the GPU: the math and its chunked form are kernels/gated_delta.h's;
// this file runs it in chunks of C = 64 tokens with every state and product in f32, in
// four kernels:
//
//   chunk_prep     a CTA per (batch, head, chunk): the chunk's A and P (the header's
//                  C x C matrices) and T = (I + A)^-1, which every value tile then uses
//                  as products (U = T R, dR = T^T dU) rather than solving in its loop.
//   scan_forward   a CTA per (batch, head, value tile of 32 columns) walks the chunks in
//                  order. The state's columns evolve independently (A and the decays read
//                  only q, k, g and beta), so a value tile is a whole problem and the CTAs
//                  never talk. Writes the outputs, or, for the backward, the state entering
//                  each chunk and the delta values U.
//   scan_backward  the same CTAs walk the chunks in reverse carrying dS (the gradient of
//                  the state leaving the chunk): dU, dR = (I + A)^-T dU, dv = beta dR, and
//                  dS of the chunk's entry. Stashes dS and dR per chunk, and the tile's
//                  share of the per-token sums over value columns that dg and dbeta need.
//   chunk_grads    a CTA per (batch, head, chunk) with every value column: dq and dk, the
//                  C x C terms of dg and dbeta, the tiles' shares added in tile order, and
//                  dg as the suffix sum of dG over the chunk.
//
// Every sum runs in a fixed order (no atomics), so results repeat bit for bit. The
// workspace: T and P, 2 x C x T x H f32 (67 MB a batch row at Qwen3.5's 32 heads and
// 4096 tokens); the backward's, every batch row at once, adds the states and their
// gradients, 2 x H x chunks x Dk x Dv f32, and U and dR, 2 x T x H x Dv f32 (373 MB in
// all a row at that shape). Dk, Dv <= 128. The products over shared memory
// run on the tensor cores (tf32 operands, f32 sums: MmaAcc) or, with
// set_gated_delta_tensor_cores(false), in f32 on the SIMT cores (SimtAcc: the exact
// route, which the tests hold to float64 at 1e-4 and the tensor-core route against).
// The triangular solves run in f32 on the SIMT cores either way.
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/gated_delta.h"

namespace mt::cuda {

namespace {

constexpr int kC = 64;                      // tokens per chunk
constexpr int kTV = 32;                     // value columns per scan CTA (a warp's lanes)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDim = 128;                // Dk and Dv
constexpr int kLdc = kC + 1;                // C x C rows, padded: column reads hit distinct banks
constexpr int kLdv = kTV + 1;               // value-tile rows, padded likewise

struct Dims {
  int64_t B, T, H;
  int dk, dv, chunks, tiles;
  __device__ int64_t tok(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * H + h; }
};

// This thread's TM x TN block of an M x N product, rows m0 + i * mt and columns n0 + j * nt
// (interleaved, so a warp's threads read consecutive columns). Indices past M or N are
// clamped for the reads and skipped at the writes. The host keeps ceil(M/TM) x ceil(N/TN)
// within kThreads, so one block per thread covers the product; add() accumulates over
// calls, which is how a sum of products stays in registers.
template <int TM, int TN>
struct SimtAcc {
  int m[TM], n[TN];
  bool mv[TM], nv[TN], on;
  float v[TM][TN];

  __device__ SimtAcc(int M, int N) {
    const int mt = (M + TM - 1) / TM, nt = (N + TN - 1) / TN, t = threadIdx.x;
    on = t < mt * nt;
    const int m0 = t / nt, n0 = t % nt;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int r = m0 + i * mt;
      mv[i] = on && r < M;
      m[i] = min(r, M - 1);
    }
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int c = n0 + j * nt;
      nv[j] = on && c < N;
      n[j] = min(c, N - 1);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) v[i][j] = 0.0f;
  }

  // v += sum over k < K of a(m, k) b(k, n).
  template <class A, class B>
  __device__ void add(int K, A a, B b) {
    if (!on) return;
    for (int k = 0; k < K; ++k) {
      float av[TM], bv[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = a(m[i], k);
#pragma unroll
      for (int j = 0; j < TN; ++j) bv[j] = b(k, n[j]);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) v[i][j] = fmaf(av[i], bv[j], v[i][j]);
    }
  }

  template <class F>
  __device__ void each(F f) const {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (mv[i] && nv[j]) f(m[i], n[j], v[i][j]);
  }
};

// The same product on the tensor cores: mma.sync m16n8k8 with tf32 operands (10-bit
// mantissas, rounded to nearest from f32) and f32 accumulators. The M x N output is cut
// into 16 x 8 tiles dealt to the warps in turn, TM x TN / 4 a warp (the SIMT block's share:
// the same interface covers the same products). Rows and columns past M, N are clamped
// for the reads and skipped at the writes; k past K reads as zero.
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

template <int TM, int TN>
struct MmaAcc {
  static constexpr int kTiles = TM * TN / 4;
  int M, N, mb, nb;
  float v[kTiles][4];

  __device__ MmaAcc(int M_, int N_) : M(M_), N(N_), mb((M_ + 15) / 16), nb((N_ + 7) / 8) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.0f;
  }

  template <class A, class B>
  __device__ void add(int K, A a, B b) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    for (int k0 = 0; k0 < K; k0 += 8) {
      const int k1 = k0 + t, k2 = k0 + t + 4;
      const bool in1 = k1 < K, in2 = k2 < K;
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int tile = warp + i * kWarps, rb = tile / nb, cb = tile % nb;
        if (rb >= mb) continue;  // the same for the whole warp
        const int r1 = min(rb * 16 + g, M - 1), r2 = min(rb * 16 + g + 8, M - 1), c = min(cb * 8 + g, N - 1);
        const uint32_t a0 = tf32(in1 ? a(r1, k1) : 0.0f), a1 = tf32(in1 ? a(r2, k1) : 0.0f),
                       a2 = tf32(in2 ? a(r1, k2) : 0.0f), a3 = tf32(in2 ? a(r2, k2) : 0.0f),
                       b0 = tf32(in1 ? b(k1, c) : 0.0f), b1 = tf32(in2 ? b(k2, c) : 0.0f);
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(v[i][0]), "+f"(v[i][1]), "+f"(v[i][2]), "+f"(v[i][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
  }

  template <class F>
  __device__ void each(F f) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int tile = warp + i * kWarps, rb = tile / nb, cb = tile % nb;
      if (rb >= mb) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = rb * 16 + g + (e / 2) * 8, n = cb * 8 + 2 * t + e % 2;
        if (m < M && n < N) f(m, n, v[i][e]);
      }
    }
  }
};

// One chunk's rows in shared memory: q and k [C, Dk + 1] (zero past the chunk's L tokens),
// the cumulative log-decay G, gamma = exp(G), beta (zero past L) and e_j = exp(G_L - G_j).
struct ChunkRows {
  float *q, *k, *G, *gam, *beta, *e;
  int ldk;
};

// Dynamic shared memory handed out in order (each kernel's *_smem function counts it).
struct Carve {
  float* p;
  __device__ float* take(int n) {
    float* r = p;
    p += n;
    return r;
  }
};

// q and k first, then the caller's tiles, then scalars() for the per-token rows.
__device__ ChunkRows chunk_rows(Carve& m, int dk) {
  ChunkRows s{};
  s.ldk = dk + 1;
  s.q = m.take(kC * s.ldk);
  s.k = m.take(kC * s.ldk);
  return s;
}
__device__ void scalars(Carve& m, ChunkRows& s) {
  s.G = m.take(kC);
  s.gam = m.take(kC);
  s.beta = m.take(kC);
  s.e = m.take(kC);
}

__device__ void load_chunk(const Dims& n, In q, In k, const float* g, const float* beta, int64_t b, int64_t h,
                           int64_t t0, int L, const ChunkRows& s) {
  for (int x = threadIdx.x; x < kC * n.dk; x += kThreads) {
    const int i = x / n.dk, a = x % n.dk;
    const int64_t at = i < L ? n.tok(b, t0 + i, h) * n.dk + a : 0;
    s.q[i * s.ldk + a] = i < L ? q[at] : 0.0f;
    s.k[i * s.ldk + a] = i < L ? k[at] : 0.0f;
  }
  for (int i = threadIdx.x; i < kC; i += kThreads) {
    s.G[i] = i < L ? g[n.tok(b, t0 + i, h)] : 0.0f;
    s.beta[i] = i < L ? beta[n.tok(b, t0 + i, h)] : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // inclusive scan of g over the chunk: two per lane, then across lanes
    const int lane = threadIdx.x;
    const float x0 = s.G[2 * lane], x1 = s.G[2 * lane + 1];
    float run = x0 + x1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, run, o);
      if (lane >= o) run += y;
    }
    const float before = run - (x0 + x1);
    s.G[2 * lane] = before + x0;
    s.G[2 * lane + 1] = before + x0 + x1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kC; i += kThreads) {
    s.gam[i] = expf(s.G[i]);
    s.e[i] = expf(s.G[L - 1] - s.G[i]);  // past L, G repeats G_L: e = 1 on zero rows of k
  }
  __syncthreads();
}

// A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i) and P_ij = exp(G_i - G_j) q_i.k_j (j <= i),
// zero elsewhere, [C, C + 1].
template <template <int, int> class Acc>
__device__ void chunk_products(const ChunkRows& s, int dk, float* A, float* P) {
  Acc<4, 4> kk(kC, kC), qk(kC, kC);
  const float *q = s.q, *k = s.k;
  const int ldk = s.ldk;
  kk.add(dk, [&](int i, int a) { return k[i * ldk + a]; }, [&](int a, int j) { return k[j * ldk + a]; });
  qk.add(dk, [&](int i, int a) { return q[i * ldk + a]; }, [&](int a, int j) { return k[j * ldk + a]; });
  kk.each([&](int i, int j, float x) {
    A[i * kLdc + j] = j < i ? s.beta[i] * expf(s.G[i] - s.G[j]) * x : 0.0f;
  });
  qk.each([&](int i, int j, float x) { P[i * kLdc + j] = j <= i ? expf(s.G[i] - s.G[j]) * x : 0.0f; });
}

// X = (I + A)^-1 (unit lower triangular, [C, kLdc]) by forward substitution on the
// identity's columns: a warp owns columns, its lanes split each row's sum, the columns'
// chains interleaved.
__device__ void invert_unit_lower(const float* A, float* X) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kCols = kC / kWarps;
  for (int j = 0; j < kC; ++j) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = warp + c * kWarps;
      float s = 0.0f;
      for (int m = col + lane; m < j; m += 32) s = fmaf(A[j * kLdc + m], X[m * kLdc + col], s);
      s = warp_sum(s);
      if (lane == 0) X[j * kLdc + col] = j < col ? 0.0f : (j == col ? 1.0f : -s);
    }
    __syncwarp();
  }
}

// Grid (chunks, H, B): each chunk's T = (I + A)^-1 and P (kernels/gated_delta.h's A and
// D o QK^T), f32 [B, H, chunks, 2, C, C], which the scans read instead of making them
// again in every value tile and solving in their sequential loop.
template <template <int, int> class Acc>
__global__ void __launch_bounds__(kThreads) chunk_prep_kernel(Dims n, In q, In k, const float* g, const float* beta,
                                                              float* tp) {
  extern __shared__ float sm[];
  const int c = blockIdx.x;
  Carve m{sm};
  ChunkRows s = chunk_rows(m, n.dk);
  float *A = m.take(kC * kLdc), *P = m.take(kC * kLdc), *X = m.take(kC * kLdc);
  scalars(m, s);
  const int64_t h = blockIdx.y, b = blockIdx.z, t0 = int64_t{c} * kC;
  const int L = static_cast<int>(min(int64_t{kC}, n.T - t0));
  load_chunk(n, q, k, g, beta, b, h, t0, L, s);
  chunk_products<Acc>(s, n.dk, A, P);
  __syncthreads();
  invert_unit_lower(A, X);
  __syncthreads();
  float* dst = tp + ((b * n.H + h) * n.chunks + c) * 2 * kC * kC;
  for (int x = threadIdx.x; x < kC * kC; x += kThreads) {
    dst[x] = X[(x / kC) * kLdc + x % kC];
    dst[kC * kC + x] = P[(x / kC) * kLdc + x % kC];
  }
}

size_t chunk_prep_smem(int dk) { return sizeof(float) * (2 * kC * (dk + 1) + 3 * kC * kLdc + 4 * kC); }

// The chunk's T and P from chunk_prep into [C, kLdc] tiles.
__device__ void load_tp(const float* tp, const Dims& n, int64_t bh, int c, float* T, float* P) {
  const float* src = tp + (bh * n.chunks + c) * 2 * kC * kC;
  for (int x = threadIdx.x; x < kC * kC; x += kThreads) {
    T[(x / kC) * kLdc + x % kC] = src[x];
    P[(x / kC) * kLdc + x % kC] = src[kC * kC + x];
  }
}

// Y = T Y (transpose: T^T Y) in place over the first L rows of a [C, kLdv] value tile.
template <template <int, int> class Acc>
__device__ void apply_t(const float* T, float* Y, int L, bool transpose) {
  Acc<2, 4> r(kC, kTV);
  if (transpose)
    r.add(L, [&](int j, int i) { return T[i * kLdc + j]; }, [&](int i, int col) { return Y[i * kLdv + col]; });
  else
    r.add(L, [&](int i, int j) { return T[i * kLdc + j]; }, [&](int j, int col) { return Y[j * kLdv + col]; });
  __syncthreads();
  r.each([&](int i, int col, float x) { Y[i * kLdv + col] = x; });
}

size_t scan_forward_smem(int dk) {
  return sizeof(float) * (2 * kC * (dk + 1) + 2 * kC * kLdc + dk * kLdv + kC * kLdv + 5 * kC);
}

// Grid (tiles, H, B). out and state_out may be null; states and u (the backward's
// recomputation) are written when not null: the state entering chunk c at
// states[((b H + h) chunks + c) Dk Dv], U as f32 [B,T,H,Dv].
template <template <int, int> class Acc>
__global__ void __launch_bounds__(kThreads) scan_forward_kernel(Dims n, In q, In k, In v, const float* g,
                                                                const float* beta, const float* tp,
                                                                const float* state_in, Out out,
                                                                bool has_out, float* state_out, float* states,
                                                                float* u) {
  extern __shared__ float sm[];
  const int ldk = n.dk + 1;
  Carve m{sm};
  ChunkRows s = chunk_rows(m, n.dk);
  float *A = m.take(kC * kLdc), *P = m.take(kC * kLdc);
  float *S = m.take(n.dk * kLdv), *U = m.take(kC * kLdv);  // [Dk, kLdv], [C, kLdv]
  scalars(m, s);
  const int v0 = blockIdx.x * kTV, tv = min(kTV, n.dv - v0);
  const int64_t h = blockIdx.y, b = blockIdx.z, bh = b * n.H + h;
  for (int x = threadIdx.x; x < n.dk * kTV; x += kThreads) {
    const int a = x / kTV, c = x % kTV;
    S[a * kLdv + c] = state_in != nullptr && c < tv ? state_in[(bh * n.dk + a) * n.dv + v0 + c] : 0.0f;
  }
  for (int c = 0; c < n.chunks; ++c) {
    const int64_t t0 = int64_t{c} * kC;
    const int L = static_cast<int>(min(int64_t{kC}, n.T - t0));
    __syncthreads();
    for (int x = threadIdx.x; x < kC * kTV; x += kThreads) {
      const int i = x / kTV, col = x % kTV;
      U[i * kLdv + col] = i < L && col < tv ? v[n.tok(b, t0 + i, h) * n.dv + v0 + col] : 0.0f;
    }
    load_chunk(n, q, k, g, beta, b, h, t0, L, s);
    load_tp(tp, n, bh, c, A, P);  // A's tile holds T
    {  // R = beta (v - gamma S0^T k), over U's v
      Acc<2, 4> w(kC, kTV);
      w.add(n.dk, [&](int i, int a) { return s.k[i * ldk + a]; }, [&](int a, int col) { return S[a * kLdv + col]; });
      w.each([&](int i, int col, float x) { U[i * kLdv + col] = s.beta[i] * (U[i * kLdv + col] - s.gam[i] * x); });
    }
    __syncthreads();
    apply_t<Acc>(A, U, L, false);  // U = T R
    __syncthreads();
    if (states != nullptr) {
      float* dst = states + (bh * n.chunks + c) * n.dk * n.dv + v0;
      for (int x = threadIdx.x; x < n.dk * tv; x += kThreads) dst[(x / tv) * n.dv + x % tv] = S[(x / tv) * kLdv + x % tv];
      for (int x = threadIdx.x; x < L * tv; x += kThreads)
        u[n.tok(b, t0 + x / tv, h) * n.dv + v0 + x % tv] = U[(x / tv) * kLdv + x % tv];
    }
    if (has_out) {  // o_i = gamma_i S0^T q_i + sum_j P_ij u_j
      Acc<2, 4> o(kC, kTV);
      o.add(n.dk, [&](int i, int a) { return s.gam[i] * s.q[i * ldk + a]; },
            [&](int a, int col) { return S[a * kLdv + col]; });
      o.add(L, [&](int i, int j) { return P[i * kLdc + j]; }, [&](int j, int col) { return U[j * kLdv + col]; });
      o.each([&](int i, int col, float x) {
        if (i < L && col < tv) out.set(n.tok(b, t0 + i, h) * n.dv + v0 + col, x);
      });
    }
    __syncthreads();
    {  // S = gamma_L S + sum_j e_j k_j u_j^T
      Acc<4, 4> st(n.dk, kTV);
      st.add(L, [&](int a, int j) { return s.e[j] * s.k[j * ldk + a]; }, [&](int j, int col) { return U[j * kLdv + col]; });
      const float last = s.gam[L - 1];
      st.each([&](int a, int col, float x) { S[a * kLdv + col] = last * S[a * kLdv + col] + x; });
    }
  }
  __syncthreads();
  if (state_out != nullptr)
    for (int x = threadIdx.x; x < n.dk * tv; x += kThreads)
      state_out[(bh * n.dk + x / tv) * n.dv + v0 + x % tv] = S[(x / tv) * kLdv + x % tv];
}

size_t scan_backward_smem(int dk) {
  return sizeof(float) * (2 * kC * (dk + 1) + 2 * kC * kLdc + 2 * dk * kLdv + 5 * kC * kLdv + 9 * kC);
}

// Grid (tiles, H, B), chunks in reverse. states and u are scan_forward's; writes dv, dS
// leaving chunk c (ds, laid out as states), dR (dr, as u) and the tile's per-token shares
// of dG and dbeta (pg, pb: [tiles][B T H]). d_state_out and d_state_in may be null.
template <template <int, int> class Acc>
__global__ void __launch_bounds__(kThreads) scan_backward_kernel(Dims n, In q, In k, In v, const float* g,
                                                                 const float* beta, const float* tp, In dout,
                                                                 const float* d_state_out, const float* states,
                                                                 const float* u, Out dv, float* d_state_in,
                                                                 float* ds, float* dr, float* pg, float* pb) {
  extern __shared__ float sm[];
  __shared__ float red[kWarps];
  const int ldk = n.dk + 1;
  Carve m{sm};
  ChunkRows s = chunk_rows(m, n.dk);
  float *A = m.take(kC * kLdc), *P = m.take(kC * kLdc);
  float *dS = m.take(n.dk * kLdv), *S0 = m.take(n.dk * kLdv);  // [Dk, kLdv]
  float *U = m.take(kC * kLdv), *dO = m.take(kC * kLdv), *R = m.take(kC * kLdv), *V = m.take(kC * kLdv),
        *X = m.take(kC * kLdv);  // [C, kLdv]
  scalars(m, s);
  // Per-row dots (below) and the chunk's state-term total.
  float *d1 = m.take(kC), *d2 = m.take(kC), *d3 = m.take(kC), *d4 = m.take(kC), *d5 = m.take(kC);
  const int v0 = blockIdx.x * kTV, tv = min(kTV, n.dv - v0);
  const int64_t h = blockIdx.y, b = blockIdx.z, bh = b * n.H + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t part = int64_t{blockIdx.x} * n.B * n.T * n.H;
  for (int x = threadIdx.x; x < n.dk * kTV; x += kThreads) {
    const int a = x / kTV, c = x % kTV;
    dS[a * kLdv + c] = d_state_out != nullptr && c < tv ? d_state_out[(bh * n.dk + a) * n.dv + v0 + c] : 0.0f;
  }
  // Row dots over the tile's columns, a warp per row: dst[i] = sum_col x[i, col] y[i, col].
  auto rowdot = [&](const float* x, const float* y, float* dst) {
    for (int i = warp; i < kC; i += kWarps) {
      const float t = lane < tv ? x[i * kLdv + lane] * y[i * kLdv + lane] : 0.0f;
      const float total = warp_sum(t);
      if (lane == 0) dst[i] = total;
    }
  };
  for (int c = n.chunks - 1; c >= 0; --c) {
    const int64_t t0 = int64_t{c} * kC;
    const int L = static_cast<int>(min(int64_t{kC}, n.T - t0));
    const int64_t st = (bh * n.chunks + c) * n.dk * n.dv + v0;
    __syncthreads();
    for (int x = threadIdx.x; x < kC * kTV; x += kThreads) {
      const int i = x / kTV, col = x % kTV;
      const bool in = i < L && col < tv;
      const int64_t at = in ? n.tok(b, t0 + i, h) * n.dv + v0 + col : 0;
      U[i * kLdv + col] = in ? u[at] : 0.0f;
      dO[i * kLdv + col] = in ? dout[at] : 0.0f;
      V[i * kLdv + col] = in ? v[at] : 0.0f;
    }
    for (int x = threadIdx.x; x < n.dk * kTV; x += kThreads) {
      const int a = x / kTV, col = x % kTV;
      S0[a * kLdv + col] = col < tv ? states[st + a * n.dv + col] : 0.0f;
      if (col < tv) ds[st + a * n.dv + col] = dS[a * kLdv + col];
    }
    load_chunk(n, q, k, g, beta, b, h, t0, L, s);
    load_tp(tp, n, bh, c, A, P);  // A's tile holds T
    __syncthreads();
    {  // dU = e o K dS + P^T dO, into R
      Acc<2, 4> du(kC, kTV);
      du.add(n.dk, [&](int j, int a) { return s.e[j] * s.k[j * ldk + a]; },
             [&](int a, int col) { return dS[a * kLdv + col]; });
      du.add(L, [&](int j, int i) { return P[i * kLdc + j]; }, [&](int i, int col) { return dO[i * kLdv + col]; });
      du.each([&](int j, int col, float x) { R[j * kLdv + col] = x; });
    }
    __syncthreads();
    apply_t<Acc>(A, R, L, true);  // dR = T^T dU
    __syncthreads();
    for (int x = threadIdx.x; x < L * tv; x += kThreads) {
      const int i = x / tv, col = x % tv;
      const int64_t at = n.tok(b, t0 + i, h) * n.dv + v0 + col;
      dv.set(at, s.beta[i] * R[i * kLdv + col]);
      dr[at] = R[i * kLdv + col];
    }
    // The tile's shares of the sums over value columns (the header of kernels/gated_delta.h):
    //   d1_i = (S0^T q_i).do_i, d2_j = (dS^T k_j).u_j, d3_j = (S0^T k_j).dR_j, d4_j = dR_j.v_j,
    // and <dS, S0>.
    auto product = [&](const float* M, const float* rows) {  // X = rows M, rows [C, Dk] in shared
      Acc<2, 4> x(kC, kTV);
      x.add(n.dk, [&](int i, int a) { return rows[i * ldk + a]; }, [&](int a, int col) { return M[a * kLdv + col]; });
      x.each([&](int i, int col, float y) { X[i * kLdv + col] = y; });
      __syncthreads();
    };
    product(S0, s.q);
    rowdot(X, dO, d1);
    __syncthreads();
    product(dS, s.k);
    rowdot(X, U, d2);
    __syncthreads();
    product(S0, s.k);
    rowdot(X, R, d3);
    rowdot(R, V, d4);
    float sd = 0.0f;
    for (int x = threadIdx.x; x < n.dk * tv; x += kThreads) sd += dS[(x / tv) * kLdv + x % tv] * S0[(x / tv) * kLdv + x % tv];
    sd = block_sum(sd, red);  // syncs: d1..d4 are complete after it
    if (threadIdx.x == 0) {   // sum_j e_j d2_j, in order
      float se = 0.0f;
      for (int j = 0; j < L; ++j) se += s.e[j] * d2[j];
      d5[0] = se + s.gam[L - 1] * sd;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L; i += kThreads) {
      const int64_t at = part + n.tok(b, t0 + i, h);
      float dG = s.gam[i] * d1[i] - s.e[i] * d2[i] - s.beta[i] * s.gam[i] * d3[i];
      if (i == L - 1) dG += d5[0];
      pg[at] = dG;
      pb[at] = d4[i] - s.gam[i] * d3[i];
    }
    {  // dS = gamma_L dS + sum_i gamma_i q_i do_i^T - sum_j beta_j gamma_j k_j dR_j^T
      Acc<4, 4> up(n.dk, kTV);
      up.add(L, [&](int a, int i) { return s.gam[i] * s.q[i * ldk + a]; }, [&](int i, int col) { return dO[i * kLdv + col]; });
      up.add(L, [&](int a, int j) { return -s.beta[j] * s.gam[j] * s.k[j * ldk + a]; },
             [&](int j, int col) { return R[j * kLdv + col]; });
      const float last = s.gam[L - 1];
      __syncthreads();  // every thread is done reading dS (the dots above)
      up.each([&](int a, int col, float x) { dS[a * kLdv + col] = last * dS[a * kLdv + col] + x; });
    }
  }
  __syncthreads();
  if (d_state_in != nullptr)
    for (int x = threadIdx.x; x < n.dk * tv; x += kThreads)
      d_state_in[(bh * n.dk + x / tv) * n.dv + v0 + x % tv] = dS[(x / tv) * kLdv + x % tv];
}

size_t chunk_grads_smem(int dk, int dv) {
  return sizeof(float) * (2 * kC * (dk + 1) + 3 * kC * (dv + 1) + 2 * kC * kLdc + 7 * kC);
}

// Grid (chunks, H, B), every value column: dq, dk, dg, dbeta of one chunk from the scans'
// stashes (states, ds, u, dr, pg, pb).
template <template <int, int> class Acc>
__global__ void __launch_bounds__(kThreads) chunk_grads_kernel(Dims n, In q, In k, const float* g,
                                                               const float* beta, In dout, const float* states,
                                                               const float* ds, const float* u, const float* dr,
                                                               const float* pg, const float* pb, Out dq, Out dk,
                                                               Out dg, Out dbeta) {
  extern __shared__ float sm[];
  const int ldk = n.dk + 1, ldv = n.dv + 1, c = blockIdx.x;
  Carve m{sm};
  ChunkRows s = chunk_rows(m, n.dk);
  float *U = m.take(kC * ldv), *R = m.take(kC * ldv), *dO = m.take(kC * ldv);  // [C, Dv + 1]
  float *M1 = m.take(kC * kLdc), *M2 = m.take(kC * kLdc);
  scalars(m, s);
  float *sg = m.take(kC), *sb = m.take(kC), *acc = m.take(kC);  // dG's and dbeta's C x C terms, dG
  const int64_t h = blockIdx.y, b = blockIdx.z, bh = b * n.H + h, t0 = int64_t{c} * kC;
  const int L = static_cast<int>(min(int64_t{kC}, n.T - t0));
  const float* S0 = states + (bh * n.chunks + c) * n.dk * n.dv;  // [Dk, Dv], read through the caches
  const float* dS = ds + (bh * n.chunks + c) * n.dk * n.dv;
  for (int x = threadIdx.x; x < kC * n.dv; x += kThreads) {
    const int i = x / n.dv, col = x % n.dv;
    const bool in = i < L;
    const int64_t at = in ? n.tok(b, t0 + i, h) * n.dv + col : 0;
    U[i * ldv + col] = in ? u[at] : 0.0f;
    R[i * ldv + col] = in ? dr[at] : 0.0f;
    dO[i * ldv + col] = in ? dout[at] : 0.0f;
  }
  load_chunk(n, q, k, g, beta, b, h, t0, L, s);
  {  // M1 = q_i.k_j, M2 = dP = do_i.u_j
    Acc<4, 4> qk(kC, kC), dp(kC, kC);
    qk.add(n.dk, [&](int i, int a) { return s.q[i * ldk + a]; }, [&](int a, int j) { return s.k[j * ldk + a]; });
    dp.add(n.dv, [&](int i, int x) { return dO[i * ldv + x]; }, [&](int x, int j) { return U[j * ldv + x]; });
    qk.each([&](int i, int j, float x) { M1[i * kLdc + j] = x; });
    dp.each([&](int i, int j, float x) { M2[i * kLdc + j] = x; });
  }
  __syncthreads();
  for (int x = threadIdx.x; x < kC * kC; x += kThreads) {  // M1 = dP o P (for dG), M2 = dP o D
    const int i = x / kC, j = x % kC;
    const bool in = j <= i && i < L;
    const float D = in ? expf(s.G[i] - s.G[j]) : 0.0f, dP = M2[i * kLdc + j];
    M1[i * kLdc + j] = in ? dP * D * M1[i * kLdc + j] : 0.0f;
    M2[i * kLdc + j] = in ? dP * D : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kC; i += kThreads) {
    float row = 0.0f, col = 0.0f;
    for (int j = 0; j < kC; ++j) row += M1[i * kLdc + j], col += M1[j * kLdc + i];
    sg[i] = row - col;
  }
  // dq = diag(gamma) dO S0^T + M2 K;  dk = M2^T Q + ...
  Acc<4, 8> gq(kC, n.dk), gk(kC, n.dk);
  gq.add(L, [&](int i, int j) { return M2[i * kLdc + j]; }, [&](int j, int a) { return s.k[j * ldk + a]; });
  gq.add(n.dv, [&](int i, int x) { return s.gam[i] * dO[i * ldv + x]; }, [&](int x, int a) { return S0[a * n.dv + x]; });
  gk.add(L, [&](int j, int i) { return M2[i * kLdc + j]; }, [&](int i, int a) { return s.q[i * ldk + a]; });
  __syncthreads();
  {  // M1 = k_i.k_j, M2 = dA = -dR_i.u_j
    Acc<4, 4> kk(kC, kC), da(kC, kC);
    kk.add(n.dk, [&](int i, int a) { return s.k[i * ldk + a]; }, [&](int a, int j) { return s.k[j * ldk + a]; });
    da.add(n.dv, [&](int i, int x) { return -R[i * ldv + x]; }, [&](int x, int j) { return U[j * ldv + x]; });
    kk.each([&](int i, int j, float x) { M1[i * kLdc + j] = x; });
    da.each([&](int i, int j, float x) { M2[i * kLdc + j] = x; });
  }
  __syncthreads();
  for (int x = threadIdx.x; x < kC * kC; x += kThreads) {  // M1 = dA D kk (dbeta), M2 = F = dA beta_i D
    const int i = x / kC, j = x % kC;
    const bool in = j < i && i < L;
    const float D = in ? expf(s.G[i] - s.G[j]) : 0.0f, dA = M2[i * kLdc + j];
    M1[i * kLdc + j] = in ? dA * D * M1[i * kLdc + j] : 0.0f;
    M2[i * kLdc + j] = in ? dA * s.beta[i] * D : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kC; i += kThreads) {
    float row = 0.0f, col = 0.0f;
    for (int j = 0; j < kC; ++j) row += M1[i * kLdc + j], col += s.beta[j] * M1[j * kLdc + i];
    sb[i] = row;
    sg[i] += s.beta[i] * row - col;
  }
  // dk += (F + F^T) K + diag(e) U dS^T - diag(beta gamma) dR S0^T
  gk.add(L, [&](int i, int j) { return M2[i * kLdc + j] + M2[j * kLdc + i]; },
         [&](int j, int a) { return s.k[j * ldk + a]; });
  gk.add(n.dv, [&](int j, int x) { return s.e[j] * U[j * ldv + x]; }, [&](int x, int a) { return dS[a * n.dv + x]; });
  gk.add(n.dv, [&](int j, int x) { return -s.beta[j] * s.gam[j] * R[j * ldv + x]; },
         [&](int x, int a) { return S0[a * n.dv + x]; });
  gq.each([&](int i, int a, float x) {
    if (i < L) dq.set(n.tok(b, t0 + i, h) * n.dk + a, x);
  });
  gk.each([&](int i, int a, float x) {
    if (i < L) dk.set(n.tok(b, t0 + i, h) * n.dk + a, x);
  });
  __syncthreads();
  for (int i = threadIdx.x; i < L; i += kThreads) {  // the tiles' shares, in tile order
    const int64_t at = n.tok(b, t0 + i, h), stride = n.B * n.T * n.H;
    float G = sg[i], B = sb[i];
    for (int t = 0; t < n.tiles; ++t) G += pg[t * stride + at], B += pb[t * stride + at];
    acc[i] = G;
    dbeta.set(at, B);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // G is a cumulative sum within the chunk: dg_i = sum_{m >= i} dG_m
    float run = 0.0f;
    for (int i = L - 1; i >= 0; --i) {
      run += acc[i];
      dg.set(n.tok(b, t0 + i, h), run);
    }
  }
}

// An optional tensor (a state) is given: an empty Tensor is 0-dimensional, numel 1.
bool present(const Tensor& t) { return t.data != nullptr && t.numel() > 0; }

// The checks both directions share; returns the dimensions.
Dims check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                  const Tensor& state_in) {
  MT_CHECK(q.ndim() == 4 && v.ndim() == 4)
      << "gated_delta q should be [B,T,H,Dk] and v [B,T,H,Dv], got q " << q.str() << ", v " << v.str();
  Dims n{q.dim(0), q.dim(1), q.dim(2), static_cast<int>(q.dim(3)), static_cast<int>(v.dim(3)), 0, 0};
  check_arg(q, "gated_delta q", {DType::bf16, DType::f32}, q.shape);
  check_arg(k, "gated_delta k", {DType::bf16, DType::f32}, q.shape);
  check_arg(v, "gated_delta v", {DType::bf16, DType::f32}, {n.B, n.T, n.H, n.dv});
  check_arg(g, "gated_delta g", {DType::f32}, {n.B, n.T, n.H});
  check_arg(beta, "gated_delta beta", {DType::f32}, {n.B, n.T, n.H});
  if (present(state_in)) check_arg(state_in, "gated_delta state_in", {DType::f32}, {n.B, n.H, n.dk, n.dv});
  MT_CHECK(q.dim(3) >= 1 && q.dim(3) <= kMaxDim && v.dim(3) >= 1 && v.dim(3) <= kMaxDim)
      << "gated_delta on the GPU takes head dims of 1 to " << kMaxDim << ", got Dk " << q.dim(3) << ", Dv "
      << v.dim(3);
  n.chunks = static_cast<int>((n.T + kC - 1) / kC);
  n.tiles = (n.dv + kTV - 1) / kTV;
  return n;
}

const float* maybe(const Tensor& t) { return present(t) ? t.f32() : nullptr; }
float* maybe_out(const Tensor& t) { return present(t) ? t.f32() : nullptr; }

bool g_tensor_cores = true;

template <typename K>
void allow_smem(K kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

void set_gated_delta_tensor_cores(bool enabled) { g_tensor_cores = enabled; }
bool gated_delta_tensor_cores() { return g_tensor_cores; }

void gated_delta_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         const Tensor& state_in, const Tensor& out, const Tensor& state_out) {
  const Dims n = check_inputs(q, k, v, g, beta, state_in);
  check_arg(out, "gated_delta out", {DType::bf16, DType::f32}, v.shape);
  if (present(state_out)) check_arg(state_out, "gated_delta state_out", {DType::f32}, {n.B, n.H, n.dk, n.dv});
  if (n.B * n.H == 0) return;
  if (n.T == 0) {  // no tokens: the state passes through
    if (present(state_out)) {
      if (present(state_in))
        CUDA_CHECK(cudaMemcpyAsync(state_out.data, state_in.data, state_out.nbytes(), cudaMemcpyDeviceToDevice, stream()));
      else
        CUDA_CHECK(cudaMemsetAsync(state_out.data, 0, state_out.nbytes(), stream()));
    }
    return;
  }
  auto* tp = static_cast<float*>(stream_alloc(sizeof(float) * static_cast<size_t>(n.B * n.H * n.chunks * 2 * kC * kC)));
  const size_t ps = chunk_prep_smem(n.dk), smem = scan_forward_smem(n.dk);
  auto* prep = g_tensor_cores ? chunk_prep_kernel<MmaAcc> : chunk_prep_kernel<SimtAcc>;
  auto* fwd = g_tensor_cores ? scan_forward_kernel<MmaAcc> : scan_forward_kernel<SimtAcc>;
  allow_smem(prep, ps);
  allow_smem(fwd, smem);
  prep<<<dim3(n.chunks, n.H, n.B), kThreads, ps, stream()>>>(n, as_in(q), as_in(k), g.f32(), beta.f32(), tp);
  CUDA_CHECK_LAUNCH();
  fwd<<<dim3(n.tiles, n.H, n.B), kThreads, smem, stream()>>>(n, as_in(q), as_in(k), as_in(v), g.f32(), beta.f32(), tp,
                                                             maybe(state_in), as_out(out), true, maybe_out(state_out),
                                                             nullptr, nullptr);
  CUDA_CHECK_LAUNCH();
  stream_free(tp);
}

void gated_delta_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state_in, const Tensor& dout, const Tensor& d_state_out, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_state_in) {
  const Dims all = check_inputs(q, k, v, g, beta, state_in);
  const Shape state{all.B, all.H, all.dk, all.dv};
  check_arg(dout, "gated_delta dout", {DType::bf16, DType::f32}, v.shape);
  if (present(d_state_out)) check_arg(d_state_out, "gated_delta d_state_out", {DType::f32}, state);
  check_arg(dq, "gated_delta dq", {DType::bf16, DType::f32}, q.shape);
  check_arg(dk, "gated_delta dk", {DType::bf16, DType::f32}, q.shape);
  check_arg(dv, "gated_delta dv", {DType::bf16, DType::f32}, v.shape);
  check_arg(dg, "gated_delta dg", {DType::f32}, g.shape);
  check_arg(dbeta, "gated_delta dbeta", {DType::f32}, g.shape);
  if (present(d_state_in)) check_arg(d_state_in, "gated_delta d_state_in", {DType::f32}, state);
  if (all.B * all.H == 0) return;
  if (all.T == 0) {
    if (present(d_state_in)) {
      if (present(d_state_out))
        CUDA_CHECK(cudaMemcpyAsync(d_state_in.data, d_state_out.data, d_state_in.nbytes(), cudaMemcpyDeviceToDevice,
                                   stream()));
      else
        CUDA_CHECK(cudaMemsetAsync(d_state_in.data, 0, d_state_in.nbytes(), stream()));
    }
    return;
  }
  // Every batch row at once: a grid of (tiles, H, B) for the scans fills the GPU where a
  // row's alone (4 x 32 CTAs at Qwen3.5's shape) would not.
  const Dims n = all;
  const int64_t state_elems = n.B * n.H * int64_t{n.chunks} * n.dk * n.dv, all_v = n.B * n.T * n.H * n.dv,
                all_s = n.B * n.T * n.H, all_tp = n.B * n.H * int64_t{n.chunks} * 2 * kC * kC;
  const size_t bytes = sizeof(float) * static_cast<size_t>(2 * state_elems + 2 * all_v + 2 * n.tiles * all_s + all_tp);
  auto* ws = static_cast<float*>(stream_alloc(bytes));
  float *states = ws, *ds = states + state_elems, *u = ds + state_elems, *dr = u + all_v, *pg = dr + all_v,
        *pb = pg + n.tiles * all_s, *tp = pb + n.tiles * all_s;
  const size_t ps = chunk_prep_smem(n.dk), fs = scan_forward_smem(n.dk), bs = scan_backward_smem(n.dk),
               gs = chunk_grads_smem(n.dk, n.dv);
  auto* prep = g_tensor_cores ? chunk_prep_kernel<MmaAcc> : chunk_prep_kernel<SimtAcc>;
  allow_smem(prep, ps);
  auto* fwd = g_tensor_cores ? scan_forward_kernel<MmaAcc> : scan_forward_kernel<SimtAcc>;
  auto* bwd = g_tensor_cores ? scan_backward_kernel<MmaAcc> : scan_backward_kernel<SimtAcc>;
  auto* grads = g_tensor_cores ? chunk_grads_kernel<MmaAcc> : chunk_grads_kernel<SimtAcc>;
  allow_smem(fwd, fs);
  allow_smem(bwd, bs);
  allow_smem(grads, gs);
  const In qi = as_in(q), ki = as_in(k), vi = as_in(v), doi = as_in(dout);
  prep<<<dim3(n.chunks, n.H, n.B), kThreads, ps, stream()>>>(n, qi, ki, g.f32(), beta.f32(), tp);
  CUDA_CHECK_LAUNCH();
  fwd<<<dim3(n.tiles, n.H, n.B), kThreads, fs, stream()>>>(n, qi, ki, vi, g.f32(), beta.f32(), tp, maybe(state_in),
                                                           Out{nullptr, false}, false, nullptr, states, u);
  CUDA_CHECK_LAUNCH();
  bwd<<<dim3(n.tiles, n.H, n.B), kThreads, bs, stream()>>>(n, qi, ki, vi, g.f32(), beta.f32(), tp, doi,
                                                           maybe(d_state_out), states, u, as_out(dv),
                                                           maybe_out(d_state_in), ds, dr, pg, pb);
  CUDA_CHECK_LAUNCH();
  grads<<<dim3(n.chunks, n.H, n.B), kThreads, gs, stream()>>>(n, qi, ki, g.f32(), beta.f32(), doi, states, ds, u, dr,
                                                              pg, pb, as_out(dq), as_out(dk), as_out(dg),
                                                              as_out(dbeta));
  CUDA_CHECK_LAUNCH();
  stream_free(ws);
}

}  // namespace mt::cuda
