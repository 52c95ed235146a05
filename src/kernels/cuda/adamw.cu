// Multi-tensor AdamW on the GPU: the list of parameter blocks travels in the kernel's
// parameters and each thread block updates one chunk of one tensor: one launch per
// kTableSize blocks. Blocks that carry FP8 codes go through adamw_fp8_kernel, which
// updates them tile by tile and quantizes each tile as it goes.

#include <algorithm>
#include <cmath>

#include <cuda_fp8.h>

#include "kernels/adamw.h"
#include "kernels/cuda/common.cuh"
#include "kernels/fp8_quant.h"
#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

constexpr int kTableSize = 128;
constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

struct AdamWTable {
  float* p[kTableSize];
  const float* g[kTableSize];
  void* m[kTableSize];  // f32, or bf16 when bf16_moments
  void* v[kTableSize];
  __nv_bfloat16* c[kTableSize];          // the bf16 copy to write, or null
  int64_t n[kTableSize];
  uint64_t key[kTableSize];              // bf16 moments: the noise key of element 0
  float decay[kTableSize];               // 1 - lr * wd for this block
  int64_t first_chunk[kTableSize + 1];   // chunk index of each tensor's first chunk
  int count;
  bool bf16_moments;
  uint64_t step;
  float step_size, bias2_sqrt, w1, b2, w2, eps, grad_scale;
};

// The CPU backend's expression, operation for operation; the _rn intrinsics keep nvcc
// from fusing a multiply and an add into one rounding, so the two backends agree bit
// for bit (sqrt and division are IEEE-rounded on both). p, m, v are updated in place.
__device__ __forceinline__ void adamw_element(const AdamWTable& t, float decay, float g, float& p, float& m,
                                              float& v) {
  const float gi = __fmul_rn(g, t.grad_scale);
  const float pi = __fmul_rn(p, decay);
  m = __fadd_rn(m, __fmul_rn(t.w1, __fsub_rn(gi, m)));
  v = __fadd_rn(__fmul_rn(v, t.b2), __fmul_rn(__fmul_rn(t.w2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), t.bias2_sqrt), t.eps);
  p = __fsub_rn(pi, __fdiv_rn(__fmul_rn(t.step_size, m), denom));
}

// Four consecutive moments in registers, loaded from and stored to f32 or bf16.
struct Moments4 {
  float x[4];
};

__device__ __forceinline__ Moments4 load4(const void* base, int64_t j, bool bf16) {
  if (bf16) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + j);
    return {{__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u), __uint_as_float(raw.y << 16),
             __uint_as_float(raw.y & 0xffff0000u)}};
  }
  const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + j);
  return {{f.x, f.y, f.z, f.w}};
}

// bf16: rounded stochastically with 16 bits of each element's noise, from bit `shift`.
__device__ __forceinline__ void store4(void* base, int64_t j, const Moments4& r, bool bf16, const uint64_t* noise,
                                       int shift) {
  if (bf16) {
    uint16_t h[4];
    for (int e = 0; e < 4; ++e) h[e] = bf16_stochastic(__float_as_uint(r.x[e]), noise[e] >> shift);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + j) =
        make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16), h[2] | (static_cast<uint32_t>(h[3]) << 16));
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + j) = make_float4(r.x[0], r.x[1], r.x[2], r.x[3]);
  }
}

// Four aligned elements from j, updated in place; returns their new values.
__device__ __forceinline__ float4 update4(const AdamWTable& t, float decay, float* p, const float* g, void* m, void* v,
                                          uint64_t key, int64_t j) {
  const bool bf16 = t.bf16_moments;
  const float4 gj = *reinterpret_cast<const float4*>(g + j);
  float4 pj = *reinterpret_cast<float4*>(p + j);
  Moments4 mj = load4(m, j, bf16), vj = load4(v, j, bf16);
  adamw_element(t, decay, gj.x, pj.x, mj.x[0], vj.x[0]);
  adamw_element(t, decay, gj.y, pj.y, mj.x[1], vj.x[1]);
  adamw_element(t, decay, gj.z, pj.z, mj.x[2], vj.x[2]);
  adamw_element(t, decay, gj.w, pj.w, mj.x[3], vj.x[3]);
  *reinterpret_cast<float4*>(p + j) = pj;
  uint64_t noise[4] = {0, 0, 0, 0};
  if (bf16)
    for (int e = 0; e < 4; ++e) noise[e] = adamw_noise(key + static_cast<uint64_t>(j + e), t.step);
  store4(m, j, mj, bf16, noise, 0);
  store4(v, j, vj, bf16, noise, 16);
  return pj;
}

// One element where four at a time do not fit (tails, unaligned pieces); returns its new value.
__device__ __forceinline__ float update_one(const AdamWTable& t, float decay, float* p, const float* g, void* m,
                                            void* v, uint64_t key, int64_t j) {
  const bool bf16 = t.bf16_moments;
  float pj = p[j], mj, vj;
  if (bf16) {
    mj = __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(m)[j]) << 16);
    vj = __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(v)[j]) << 16);
  } else {
    mj = static_cast<const float*>(m)[j];
    vj = static_cast<const float*>(v)[j];
  }
  adamw_element(t, decay, g[j], pj, mj, vj);
  p[j] = pj;
  if (bf16) {
    const uint64_t noise = adamw_noise(key + static_cast<uint64_t>(j), t.step);
    static_cast<uint16_t*>(m)[j] = bf16_stochastic(__float_as_uint(mj), noise);
    static_cast<uint16_t*>(v)[j] = bf16_stochastic(__float_as_uint(vj), noise >> 16);
  } else {
    static_cast<float*>(m)[j] = mj;
    static_cast<float*>(v)[j] = vj;
  }
  return pj;
}

// The step is bound by memory traffic (6 to 8 streams of 2 or 4 bytes a parameter), so
// aligned chunks move four elements per load and store; the tail and unaligned pieces
// (shards of a sharded optimizer start anywhere) go one by one.
__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWTable t) {
  const int64_t b = blockIdx.x;
  const int lo = tensor_of_chunk(t.first_chunk, t.count, b);
  float* p = t.p[lo];
  const float* g = t.g[lo];
  void* m = t.m[lo];
  void* v = t.v[lo];
  __nv_bfloat16* c = t.c[lo];
  const float decay = t.decay[lo];
  const bool bf16 = t.bf16_moments;
  const uint64_t key = t.key[lo];
  const int64_t begin = (b - t.first_chunk[lo]) * kChunk, end = min(t.n[lo], begin + kChunk);
  const auto addr = [](const void* x) { return reinterpret_cast<uintptr_t>(x); };
  const uintptr_t moment_align = bf16 ? 8 : 16;
  const bool aligned = ((addr(p) | addr(g)) % 16 == 0) && ((addr(m) | addr(v)) % moment_align == 0) &&
                       addr(c) % 8 == 0;
  int64_t i = begin;
  if (aligned) {
    const int64_t vec_end = begin + (end - begin) / 4 * 4;
    for (int64_t j = begin + 4 * threadIdx.x; j < vec_end; j += 4 * blockDim.x) {
      const float4 pj = update4(t, decay, p, g, m, v, key, j);
      if (c != nullptr) *reinterpret_cast<uint2*>(c + j) = make_uint2(pack_bf16(pj.x, pj.y), pack_bf16(pj.z, pj.w));
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
    const float pj = update_one(t, decay, p, g, m, v, key, j);
    if (c != nullptr) c[j] = __float2bfloat16_rn(pj);
  }
}

// Blocks with FP8 codes (AdamWBlock::fp8): one thread block a 128x128 tile of a
// [E, N, K] matrix (fp8::kTile), which is also the tile of its block scale: warp w updates
// rows 16w..16w+15, lane l columns 4l..4l+3 of each (float4 where K allows), keeping only
// the running amax; after the block's barrier each thread reads back the values it wrote
// (from L1/L2) and writes their codes (4 at a time) and the transposed ones (through
// shared memory), as quantize_blocks does. (Holding the 64 values across the barrier
// instead spilled and took twice the time of a separate pass.)
constexpr int kQTile = 128, kQWarps = kThreads / 32, kQRows = kQTile / kQWarps;

struct Fp8Table {
  uint8_t* q[kTableSize];
  float* scale[kTableSize];
  uint8_t* qt[kTableSize];  // or null
  float* scale_t[kTableSize];
  int64_t experts[kTableSize], rows[kTableSize], cols[kTableSize];
  bool pow2[kTableSize];
  int64_t first_tile[kTableSize + 1];
};

__global__ void __launch_bounds__(kThreads) adamw_fp8_kernel(AdamWTable t, Fp8Table f) {
  __shared__ float smax[kQWarps];
  __shared__ __align__(16) uint8_t sq[kQTile][kQTile + 16];
  const int lo = tensor_of_chunk(f.first_tile, t.count, blockIdx.x);
  const int64_t n = f.rows[lo], k = f.cols[lo], tn = (n + kQTile - 1) / kQTile, tk = (k + kQTile - 1) / kQTile;
  const int64_t tile = blockIdx.x - f.first_tile[lo], e = tile / (tn * tk), by = tile % (tn * tk) / tk,
                bx = tile % tk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = e * n * k, r0 = by * kQTile, c0 = bx * kQTile;
  float* p = t.p[lo];
  const float* g = t.g[lo];
  void* m = t.m[lo];
  void* v = t.v[lo];
  const float decay = t.decay[lo];
  const uint64_t key = t.key[lo];
  const bool bf16 = t.bf16_moments;
  const auto addr = [](const void* x) { return reinterpret_cast<uintptr_t>(x); };
  const bool vector = k % 4 == 0 && ((addr(p) | addr(g)) % 16 == 0) && ((addr(m) | addr(v)) % (bf16 ? 8 : 16) == 0);
  float amax = 0.0f;
  for (int i = 0; i < kQRows; ++i) {
    const int64_t r = r0 + warp * kQRows + i, c = c0 + 4 * lane, j = base + r * k + c;
    if (vector && r < n && c + 4 <= k) {
      const float4 pj = update4(t, decay, p, g, m, v, key, j);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(pj.x), fabsf(pj.y)), fmaxf(fabsf(pj.z), fabsf(pj.w))));
    } else {
      for (int q = 0; q < 4; ++q) {
        const float w = r < n && c + q < k ? update_one(t, decay, p, g, m, v, key, j + q) : 0.0f;
        amax = fmaxf(amax, fabsf(w));
      }
    }
  }
  amax = warp_max(amax);
  if (lane == 0) smax[warp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kQWarps; ++i) amax = fmaxf(amax, smax[i]);
  const bool pow2 = f.pow2[lo];
  const float s = fp8::tile_scale(amax, pow2);
  // Block scales [E, tn, ld] (padding zeroed by each row's last block) and, transposed,
  // [E, tk, ldt].
  const int64_t ld = fp8::block_scale_cols(k), ldt = fp8::block_scale_cols(n);
  float* scale = f.scale[lo] + e * tn * ld;
  if (threadIdx.x == 0) scale[by * ld + bx] = s;
  if (bx == tk - 1 && threadIdx.x < ld - tk) scale[by * ld + tk + threadIdx.x] = 0.0f;
  uint8_t* q = f.q[lo] + base;
  uint8_t* qt = f.qt[lo];
  const float* pt = p + base;
  for (int i = 0; i < kQRows; ++i) {
    const int rl = warp * kQRows + i;
    const int64_t r = r0 + rl, c = c0 + 4 * lane;
    float w[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (vector && r < n && c + 4 <= k) {
      const float4 x = *reinterpret_cast<const float4*>(pt + r * k + c);
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else {
      for (int j = 0; j < 4; ++j)
        if (r < n && c + j < k) w[j] = pt[r * k + c + j];
    }
    uint8_t code[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) code[j] = __nv_cvt_float_to_fp8(fp8::scaled(w[j], s, pow2), __NV_SATFINITE, __NV_E4M3);
    if (qt != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) sq[4 * lane + j][rl] = code[j];
    }
    if (r >= n) continue;
    if (k % 4 == 0 && addr(q) % 4 == 0 && c + 4 <= k) {
      uint32_t word;
      memcpy(&word, code, 4);
      *reinterpret_cast<uint32_t*>(q + r * k + c) = word;
    } else {
      for (int j = 0; j < 4 && c + j < k; ++j) q[r * k + c + j] = code[j];
    }
  }
  if (qt == nullptr) return;
  float* scale_t = f.scale_t[lo] + e * tk * ldt;
  if (threadIdx.x == 0) scale_t[bx * ldt + by] = s;
  if (by == tn - 1 && threadIdx.x < ldt - tn) scale_t[bx * ldt + tn + threadIdx.x] = 0.0f;
  __syncthreads();
  qt += base;
  const int64_t rows = min(n - r0, int64_t{kQTile}), cols = min(k - c0, int64_t{kQTile});
  const bool qt_vector = n % 16 == 0 && addr(qt) % 16 == 0;
  for (int idx = threadIdx.x; idx < kQTile * kQTile / 16; idx += kThreads) {
    const int cl = idx / (kQTile / 16), rl = idx % (kQTile / 16) * 16;
    if (cl >= cols || rl >= rows) continue;
    uint8_t* dst = qt + (c0 + cl) * n + r0 + rl;
    if (qt_vector && rl + 16 <= rows)
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sq[cl][rl]);
    else
      for (int b = 0; b < 16 && rl + b < rows; ++b) dst[b] = sq[cl][rl + b];
  }
}

}  // namespace

void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s) {
  MT_CHECK(s.step >= 1) << "adamw step is 1-based, got " << s.step;
  const bool bf16 = !blocks.empty() && blocks.front().m.dtype == DType::bf16;
  for (const AdamWBlock& b : blocks) {
    check_arg(b.param, "adamw param", {DType::f32}, b.param.shape);
    MT_CHECK(b.grad.dtype == DType::f32 && b.grad.device == Device::cuda && b.grad.numel() == b.param.numel())
        << "adamw wants an f32 GPU gradient of " << b.param.numel() << " elements (param " << b.param.str()
        << "), got " << b.grad.str();
    for (const Tensor* t : {&b.m, &b.v})
      MT_CHECK(t->dtype == (bf16 ? DType::bf16 : DType::f32) && t->device == Device::cuda &&
               t->numel() == b.param.numel())
          << "adamw wants " << (bf16 ? "bf16" : "f32") << " GPU moments of " << b.param.numel()
          << " elements, as the step's first block has (param " << b.param.str() << "), got " << t->str();
    if (b.compute.data != nullptr)
      MT_CHECK(b.compute.dtype == DType::bf16 && b.compute.device == Device::cuda &&
               b.compute.numel() == b.param.numel())
          << "adamw's compute copy should be a bf16 GPU tensor of " << b.param.numel() << " elements, got "
          << b.compute.str();
  }
  // Scalars as the CPU backend derives them: in double, then rounded to float.
  const double step = static_cast<double>(s.step);
  AdamWTable t{};
  t.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, step)));
  t.step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.beta1, step)));
  t.w1 = static_cast<float>(1.0 - s.beta1);
  t.b2 = static_cast<float>(s.beta2);
  t.w2 = static_cast<float>(1.0 - s.beta2);
  t.eps = static_cast<float>(s.eps);
  t.grad_scale = s.grad_scale;
  t.bf16_moments = bf16;
  t.step = static_cast<uint64_t>(s.step);
  // Without decay the factor is exactly 1, as the CPU's 1 - lr * 0 rounds.
  const float with_decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  // Entry j of a launch's table: the block's tensors and decay.
  auto set_block = [&](int j, const AdamWBlock& b) {
    t.p[j] = b.param.f32();
    t.g[j] = b.grad.f32();
    t.m[j] = b.m.data;
    t.v[j] = b.v.data;
    t.key[j] = b.key;
    t.c[j] = bf16_data(b.compute);  // null without a compute copy
    t.n[j] = b.param.numel();
    t.decay[j] = b.decay ? with_decay : 1.0f;
  };
  std::vector<const AdamWBlock*> plain, quantized;
  for (const AdamWBlock& b : blocks) (b.fp8.q.data != nullptr ? quantized : plain).push_back(&b);
  for (size_t first = 0; first < quantized.size(); first += kTableSize) {
    t.count = static_cast<int>(std::min<size_t>(kTableSize, quantized.size() - first));
    Fp8Table f{};
    int64_t tiles = 0;
    for (int j = 0; j < t.count; ++j) {
      const AdamWBlock& b = *quantized[first + j];
      const Shape& sh = b.param.shape;
      MT_CHECK((sh.n == 2 || sh.n == 3) && b.compute.data == nullptr)
          << "adamw with FP8 codes wants a [N, K] or [E, N, K] param without a bf16 copy, got " << b.param.str();
      f.experts[j] = sh.n == 3 ? sh.d[0] : 1;
      f.rows[j] = sh.d[sh.n - 2];
      f.cols[j] = sh.d[sh.n - 1];
      const Shape per = sh.n == 3 ? Shape{f.experts[j], f.rows[j], f.cols[j]} : Shape{f.rows[j], f.cols[j]};
      check_arg(b.fp8.q, "adamw fp8 q", {DType::f8e4m3}, per);
      f.q[j] = static_cast<uint8_t*>(b.fp8.q.data);
      f.scale[j] = b.fp8.scale.f32();
      f.qt[j] = static_cast<uint8_t*>(b.fp8.qt.data);
      f.scale_t[j] = b.fp8.qt.data != nullptr ? b.fp8.scale_t.f32() : nullptr;
      f.pow2[j] = b.fp8.pow2;
      set_block(j, b);
      f.first_tile[j] = tiles;
      tiles += f.experts[j] * fp8::tiles(f.rows[j]) * fp8::tiles(f.cols[j]);
    }
    f.first_tile[t.count] = tiles;
    if (tiles == 0) continue;
    adamw_fp8_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream()>>>(t, f);
    CUDA_CHECK_LAUNCH();
  }
  for (size_t first = 0; first < plain.size(); first += kTableSize) {
    t.count = static_cast<int>(std::min<size_t>(kTableSize, plain.size() - first));
    int64_t chunks = 0;
    for (int j = 0; j < t.count; ++j) {
      set_block(j, *plain[first + j]);
      t.first_chunk[j] = chunks;
      chunks += (t.n[j] + kChunk - 1) / kChunk;
    }
    t.first_chunk[t.count] = chunks;
    if (chunks == 0) continue;
    adamw_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(t);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace mt::cuda
