// Token <-> expert permutations on the GPU (contract, and when each call synchronises:
// kernels/dispatch.h; the sort's design: docs/architecture.md, src/kernels): bf16
// activations, every weighted sum in f32. The sort is a stable counting sort in three
// launches (count, scan, place) whose placement ranks equal experts with __match_any_sync,
// so the plan is the CPU's, bit for bit, with no atomics. A bad index traps the kernel
// (reported at the next synchronising CUDA call): a host-side check would synchronise.
#include <algorithm>
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/dispatch.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 512;  // slots per warp in the plan
constexpr int kThreads = 128;

struct Plan {
  const int32_t* idx;
  int32_t* hist;  // [chunks][E]: counts per chunk, then each chunk's first rank per expert
  int32_t* counts;
  int32_t* offsets;
  int32_t* order;
  int32_t* slot_row;
  long long* dropped;
  int slots, experts, chunks;
  int lowest;      // 0, or -1 where a slot may go nowhere (dispatch_sort)
  int order_size;  // entries `order` has room for
  long long capacity;
};

// Walks chunk c's slots in order; for each calls at(s, e, rank) where rank counts the
// earlier slots of expert e in the chunk (plus the starting value of cnt[e]); e is -1
// (rank 0) for a slot that goes nowhere.
template <typename At>
__device__ void walk_chunk(const Plan& p, int c, int* cnt, At at) {
  const int lane = threadIdx.x;
  const int end = min(p.slots, (c + 1) * kChunk);
  for (int base = c * kChunk; base < end; base += 32) {
    const int s = base + lane;
    const int e = s < end ? p.idx[s] : -1;
    if (s < end && (e < p.lowest || e >= p.experts)) __trap();
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = e >= 0 ? cnt[e] + __popc(peers & ((1u << lane) - 1)) : 0;
    __syncwarp();
    // The highest lane of each expert's group moves that expert's count on.
    if (e >= 0 && lane == 31 - __clz(peers)) cnt[e] += __popc(peers);
    __syncwarp();
    if (s < end) at(s, e, rank);
  }
}

__global__ void plan_count_kernel(Plan p) {
  extern __shared__ int cnt[];
  const int c = blockIdx.x;
  for (int e = threadIdx.x; e < p.experts; e += 32) cnt[e] = 0;
  __syncwarp();
  walk_chunk(p, c, cnt, [](int, int, int) {});
  __syncwarp();
  for (int e = threadIdx.x; e < p.experts; e += 32) p.hist[static_cast<long long>(c) * p.experts + e] = cnt[e];
}

// One block: per expert an exclusive scan over the chunks and the capped count, then an
// exclusive scan over the experts (a serial one: E is small) for the offsets.
__global__ void plan_scan_kernel(Plan p) {
  extern __shared__ int kept[];
  __shared__ long long dropped[kThreads];
  long long drop = 0;
  for (int e = threadIdx.x; e < p.experts; e += kThreads) {
    int run = 0;
    for (int c = 0; c < p.chunks; ++c) {
      int* h = p.hist + static_cast<long long>(c) * p.experts + e;
      const int n = *h;
      *h = run;
      run += n;
    }
    const int keep = p.capacity > 0 && run > p.capacity ? static_cast<int>(p.capacity) : run;
    kept[e] = keep;
    p.counts[e] = keep;
    drop += run - keep;
  }
  dropped[threadIdx.x] = drop;
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0;
    long long total = 0;
    for (int e = 0; e < p.experts; ++e) {
      p.offsets[e] = off;
      off += kept[e];
    }
    p.offsets[p.experts] = off;
    if (off > p.order_size) __trap();
    for (int x = 0; x < kThreads; ++x) total += dropped[x];
    *p.dropped = total;
  }
}

__global__ void plan_place_kernel(Plan p) {
  extern __shared__ int cnt[];
  const int c = blockIdx.x;
  for (int e = threadIdx.x; e < p.experts; e += 32) cnt[e] = p.hist[static_cast<long long>(c) * p.experts + e];
  __syncwarp();
  walk_chunk(p, c, cnt, [&](int s, int e, int rank) {
    if (e < 0 || (p.capacity > 0 && rank >= p.capacity)) {
      p.slot_row[s] = -1;
      return;
    }
    const int row = p.offsets[e] + rank;
    p.order[row] = s;
    p.slot_row[s] = row;
  });
}

// W consecutive bf16 as f32 (W = 8: one 16-byte access), and back with round to nearest.
template <int W>
__device__ __forceinline__ void load(const bf16* src, float (&f)[W]) {
  if constexpr (W == 8)
    load8(src, f);
  else
    f[0] = __bfloat162float(*src);
}

template <int W>
__device__ __forceinline__ void store(bf16* dst, const float (&f)[W]) {
  if constexpr (W == 8)
    store8(dst, f);
  else
    *dst = __float2bfloat16(f[0]);
}

struct Gather {
  const bf16* src;
  bf16* dst;
  const int32_t* index;  // order (dispatch forward) or slot_row (the others)
  const float* weight;
  const bf16* aux;  // combine backward: ys
  float* dweight;
  int rows, tokens, d, k;  // rows = R, the expert-ordered rows
};

// xs[r] = x[order[r] / k]: one block per row.
template <int W>
__global__ void dispatch_forward_kernel(Gather g) {
  const int r = blockIdx.x;
  const int s = g.index[r];
  if (s < 0 || s >= g.tokens * g.k) __trap();
  const bf16* src = g.src + static_cast<long long>(s / g.k) * g.d;
  bf16* dst = g.dst + static_cast<long long>(r) * g.d;
  for (int c = threadIdx.x * W; c < g.d; c += kThreads * W) {
    float f[W];
    load<W>(src + c, f);
    store<W>(dst + c, f);
  }
}

// dx[t] = sum over kept slots of dxs[row] (no weight), or y[t] = sum of weight * ys[row]
// (with one): one block per token, the sum in f32 in slot order.
template <int W>
__global__ void gather_sum_kernel(Gather g) {
  const int t = blockIdx.x;
  const int32_t* sr = g.index + static_cast<long long>(t) * g.k;
  for (int j = threadIdx.x; j < g.k; j += kThreads)
    if (sr[j] < -1 || sr[j] >= g.rows) __trap();
  bf16* dst = g.dst + static_cast<long long>(t) * g.d;
  for (int c = threadIdx.x * W; c < g.d; c += kThreads * W) {
    float acc[W] = {};
    for (int j = 0; j < g.k; ++j) {
      const int row = sr[j];
      if (row < 0) continue;
      const float w = g.weight != nullptr ? g.weight[static_cast<long long>(t) * g.k + j] : 1.0f;
      float f[W];
      load<W>(g.src + static_cast<long long>(row) * g.d + c, f);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += w * f[i];
    }
    store<W>(dst + c, acc);
  }
}

// dys[row] = weight * dy[t] and dweight[t,j] = dy[t] . ys[row]: one block per token, each
// dot reduced in a fixed order.
template <int W>
__global__ void combine_backward_kernel(Gather g) {
  __shared__ float part[kThreads];
  const int t = blockIdx.x;
  const int32_t* sr = g.index + static_cast<long long>(t) * g.k;
  const bf16* dy = g.src + static_cast<long long>(t) * g.d;
  for (int j = 0; j < g.k; ++j) {
    const int row = sr[j];
    if (row < -1 || row >= g.rows) __trap();
    float dot = 0.0f;
    if (row >= 0) {
      const float w = g.weight[static_cast<long long>(t) * g.k + j];
      for (int c = threadIdx.x * W; c < g.d; c += kThreads * W) {
        float fy[W], fg[W], out[W];
        load<W>(dy + c, fg);
        load<W>(g.aux + static_cast<long long>(row) * g.d + c, fy);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          dot += fg[i] * fy[i];
          out[i] = w * fg[i];
        }
        store<W>(g.dst + static_cast<long long>(row) * g.d + c, out);
      }
    }
    part[threadIdx.x] = dot;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
      __syncthreads();
    }
    if (threadIdx.x == 0) g.dweight[static_cast<long long>(t) * g.k + j] = part[0];
    __syncthreads();  // part is reused for the next slot
  }
}

// The gathers: one block per expert-ordered row (dispatch forward) or per token.
void launch(void (*kernel)(Gather), int64_t blocks, const Gather& g) {
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(g);
  CUDA_CHECK_LAUNCH();
}

// [N*k] i32 slot_row for N tokens, as the CPU backend wants it; returns k.
int64_t check_slot_row(const Tensor& slot_row, int64_t tokens) {
  MT_CHECK(slot_row.dtype == DType::i32 && slot_row.ndim() == 1 &&
           (tokens == 0 ? slot_row.dim(0) == 0 : slot_row.dim(0) % tokens == 0))
      << "slot_row should be i32 [N*k] with N=" << tokens << ", got " << slot_row.str();
  MT_CHECK(slot_row.device == Device::cuda) << "slot_row " << slot_row.str() << " is not on the GPU";
  return tokens == 0 ? 0 : slot_row.dim(0) / tokens;
}

// The device buffer of a sort of `slots` slots: the count of slots the capacity dropped,
// then (from byte 256) the histogram, chunks * num_buckets counts.
size_t sort_bytes(int64_t slots, int64_t num_buckets) {
  return 256 + sizeof(int32_t) * static_cast<size_t>((slots + kChunk - 1) / kChunk * num_buckets);
}

// The sort's three launches, with `buffer` of sort_bytes.
void launch_sort(const Tensor& idx, int64_t num_buckets, int64_t capacity, int lowest, const Tensor& counts,
                 const Tensor& offsets, const Tensor& order, const Tensor& slot_row, char* buffer) {
  const int64_t slots = idx.dim(0) * idx.dim(1);
  Plan p{};
  p.idx = idx.i32();
  p.counts = counts.i32();
  p.offsets = offsets.i32();
  p.order = order.i32();
  p.slot_row = slot_row.i32();
  p.dropped = reinterpret_cast<long long*>(buffer);
  p.hist = reinterpret_cast<int32_t*>(buffer + 256);
  p.slots = static_cast<int>(slots);
  p.experts = static_cast<int>(num_buckets);
  p.chunks = static_cast<int>((slots + kChunk - 1) / kChunk);
  p.lowest = lowest;
  p.order_size = static_cast<int>(order.dim(0));
  p.capacity = capacity;
  const size_t cnt_bytes = sizeof(int) * static_cast<size_t>(p.experts);
  if (p.chunks > 0) {
    plan_count_kernel<<<p.chunks, 32, cnt_bytes, stream()>>>(p);
    CUDA_CHECK_LAUNCH();
  }
  plan_scan_kernel<<<1, kThreads, cnt_bytes, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
  if (p.chunks > 0) {
    plan_place_kernel<<<p.chunks, 32, cnt_bytes, stream()>>>(p);
    CUDA_CHECK_LAUNCH();
  }
}

void check_sort_args(const Tensor& idx, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                     const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2) << "dispatch idx should be i32 [N,k], got " << idx.str();
  MT_CHECK(num_buckets > 0 && capacity >= 0) << "dispatch wants at least one expert and capacity >= 0, got "
                                             << num_buckets << " experts, capacity " << capacity;
  const int64_t slots = idx.dim(0) * idx.dim(1);
  MT_CHECK(slots < (int64_t{1} << 31)) << "dispatch: " << slots << " slots do not fit the plan's i32 indices";
  check_arg(idx, "dispatch idx", {DType::i32}, idx.shape);
  check_arg(counts, "dispatch counts", {DType::i32}, {num_buckets});
  check_arg(offsets, "dispatch offsets", {DType::i32}, {num_buckets + 1});
  MT_CHECK(order.ndim() == 1) << "dispatch order should be i32 [R], got " << order.str();
  check_arg(order, "dispatch order", {DType::i32}, order.shape);
  check_arg(slot_row, "dispatch slot_row", {DType::i32}, {slots});
}

}  // namespace

int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  check_sort_args(idx, num_experts, capacity, counts, offsets, order, slot_row);
  const int64_t slots = idx.dim(0) * idx.dim(1);
  MT_CHECK(order.dim(0) >= slots)
      << "dispatch order should be i32 with at least " << slots << " entries, got " << order.str();
  // The sort's buffer is the backend's scratch.
  char* buffer = static_cast<char*>(scratch(sort_bytes(slots, num_experts)));
  launch_sort(idx, num_experts, capacity, 0, counts, offsets, order, slot_row, buffer);
  long long dropped = 0;  // the buffer's first bytes (sort_bytes)
  if (capacity > 0) {
    CUDA_CHECK(cudaMemcpyAsync(&dropped, buffer, sizeof(dropped), cudaMemcpyDeviceToHost, stream()));
    synchronize();
  }
  return dropped;
}

void dispatch_sort(const Tensor& buckets, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                   const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  check_sort_args(buckets, num_buckets, capacity, counts, offsets, order, slot_row);
  // Its own stream-ordered buffer rather than the shared scratch(), whose growth
  // would synchronise, and which the plan may one day use from another stream.
  char* buffer = static_cast<char*>(stream_alloc(sort_bytes(buckets.numel(), num_buckets)));
  launch_sort(buckets, num_buckets, capacity, -1, counts, offsets, order, slot_row, buffer);
  stream_free(buffer);
}

void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs) {
  MT_CHECK(x.ndim() == 2 && xs.ndim() == 2 && k >= 1)
      << "dispatch wants x [N,D], xs [R,D] and k >= 1, got x " << x.str() << ", xs " << xs.str() << ", k " << k;
  const int64_t n = x.dim(0), d = x.dim(1), rows = xs.dim(0);
  check_arg(x, "dispatch x", {DType::bf16}, {n, d});
  check_arg(xs, "dispatch xs", {DType::bf16}, {rows, d});
  MT_CHECK(order.ndim() == 1 && order.dim(0) >= rows)
      << "dispatch order should be i32 with at least " << rows << " entries, got " << order.str();
  check_arg(order, "dispatch order", {DType::i32}, order.shape);
  if (rows == 0 || d == 0) return;
  Gather g{bf16_data(x), bf16_data(xs), order.i32(), nullptr, nullptr, nullptr, static_cast<int>(rows),
           static_cast<int>(n), static_cast<int>(d), static_cast<int>(k)};
  launch(x8(d, {&x, &xs}) ? dispatch_forward_kernel<8> : dispatch_forward_kernel<1>, rows, g);
}

void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx) {
  MT_CHECK(dxs.ndim() == 2 && dx.ndim() == 2)
      << "dispatch backward wants dxs [R,D] and dx [N,D], got dxs " << dxs.str() << ", dx " << dx.str();
  const int64_t rows = dxs.dim(0), d = dxs.dim(1), n = dx.dim(0);
  check_arg(dxs, "dispatch dxs", {DType::bf16}, {rows, d});
  check_arg(dx, "dispatch dx", {DType::bf16}, {n, d});
  const int64_t k = check_slot_row(slot_row, n);
  if (n == 0 || d == 0) return;
  Gather g{bf16_data(dxs), bf16_data(dx), slot_row.i32(), nullptr, nullptr, nullptr, static_cast<int>(rows),
           static_cast<int>(n), static_cast<int>(d), static_cast<int>(k)};
  launch(x8(d, {&dxs, &dx}) ? gather_sum_kernel<8> : gather_sum_kernel<1>, n, g);
}

void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && y.ndim() == 2)
      << "combine wants ys [R,D], weight [N,k], y [N,D], got ys " << ys.str() << ", weight " << weight.str() << ", y "
      << y.str();
  const int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_arg(ys, "combine ys", {DType::bf16}, {rows, d});
  check_arg(weight, "combine weight", {DType::f32}, {n, k});
  check_arg(y, "combine y", {DType::bf16}, {n, d});
  check_arg(slot_row, "combine slot_row", {DType::i32}, {n * k});
  if (n == 0 || d == 0) return;
  Gather g{bf16_data(ys), bf16_data(y), slot_row.i32(), weight.f32(), nullptr, nullptr, static_cast<int>(rows),
           static_cast<int>(n), static_cast<int>(d), static_cast<int>(k)};
  launch(x8(d, {&ys, &y}) ? gather_sum_kernel<8> : gather_sum_kernel<1>, n, g);
}

void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && dy.ndim() == 2)
      << "combine backward wants ys [R,D], weight [N,k], dy [N,D], got ys " << ys.str() << ", weight " << weight.str()
      << ", dy " << dy.str();
  const int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_arg(ys, "combine ys", {DType::bf16}, {rows, d});
  check_arg(weight, "combine weight", {DType::f32}, {n, k});
  check_arg(dy, "combine dy", {DType::bf16}, {n, d});
  check_arg(dys, "combine dys", {DType::bf16}, {rows, d});
  check_arg(dweight, "combine dweight", {DType::f32}, {n, k});
  check_arg(slot_row, "combine slot_row", {DType::i32}, {n * k});
  if (n == 0) return;
  Gather g{bf16_data(dy), bf16_data(dys), slot_row.i32(), weight.f32(), bf16_data(ys), dweight.f32(),
           static_cast<int>(rows), static_cast<int>(n), static_cast<int>(d), static_cast<int>(k)};
  launch(x8(d, {&ys, &dy, &dys}) ? combine_backward_kernel<8> : combine_backward_kernel<1>, n, g);
}

namespace {

constexpr int kIndexThreads = 256;

// The index kernels: a thread an index of [0, n), no launch for n = 0.
template <typename... Params, typename... Args>
void launch_index(void (*kernel)(Params...), int64_t n, Args... args) {
  if (n == 0) return;
  kernel<<<blocks_for(n, kIndexThreads), kIndexThreads, 0, stream()>>>(args...);
  CUDA_CHECK_LAUNCH();
}

__global__ void ep_row_buckets_kernel(const int32_t* idx, int32_t* buckets, int slots, int k, int per, int experts) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const int t = s / k, j = s % k, e = idx[s];
  if (e < 0 || e >= experts) __trap();
  const int r = e / per;
  bool first = true;
  for (int i = 0; i < j && first; ++i) first = idx[t * k + i] / per != r;
  buckets[s] = first ? r : -1;
}

__global__ void ep_route_slots_kernel(const int32_t* idx, const int32_t* mine, const int32_t* first,
                                      const int32_t* slot, const int64_t* bound, int32_t* out, int slots, int k,
                                      int experts) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const int e = idx[s];
  if (e < 0 || e >= experts) __trap();
  const long long u = static_cast<uint32_t>(static_cast<unsigned long long>(s / k) * 2654435769u);
  int to = mine[e];
  for (int i = first[e]; to < 0 && i < first[e + 1]; ++i)
    if (u < bound[i] || i + 1 == first[e + 1]) to = slot[i];
  out[s] = to;
}

__global__ void ep_send_buckets_kernel(const int32_t* idx, const int32_t* sent_slot, int32_t* buckets, int rows,
                                       int slots, int k, int per) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= rows * k) return;
  const int i = x / k, j = x % k, slot = sent_slot[i];
  if (slot < 0 || slot >= slots) __trap();
  const int t = slot / k, r = idx[slot] / per, e = idx[t * k + j];
  buckets[x] = e / per == r ? e - r * per : -1;
}

__global__ void ep_pack_counts_kernel(const int32_t* row_counts, const int32_t* offsets, int32_t* out, int ranks,
                                      int per) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= ranks) return;
  out[2 * r] = row_counts[r];
  out[2 * r + 1] = offsets[(r + 1) * per] - offsets[r * per];
}

// The rows arrive in source rank order: a row's source is the first rank whose running
// row count passes it (ranks are few, so a linear walk).
__global__ void ep_return_buckets_kernel(const int32_t* order, const int32_t* placed, const int32_t* recv_counts,
                                         int32_t* buckets, int m, int ranks, int k) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= m) return;
  if (*placed > m) __trap();
  if (r >= *placed) {
    buckets[r] = -1;
    return;
  }
  if (order[r] < 0) __trap();
  const int u = order[r] / k;
  int p = 0, end = recv_counts[0];
  while (u >= end) {
    if (++p >= ranks) __trap();
    end += recv_counts[2 * p];
  }
  buckets[r] = p;
}

// The token's row for a slot's rank is numbered at its first slot to that rank.
__global__ void ep_kept_buckets_kernel(const int32_t* idx, const int32_t* token_rows, const int32_t* kept_rows,
                                       int32_t* buckets, int slots, int k, int per, int kept_slots) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const int t = s / k, j = s % k, e = idx[s], r = e / per;
  int first = 0;
  while (idx[t * k + first] / per != r) ++first;
  const int row = token_rows[t * k + first];
  if (row < 0 || (row + 1) * k > kept_slots) __trap();
  buckets[s] = kept_rows[row * k + j] >= 0 ? e : -1;
}

// A pinned host buffer, allocated at the first read and reused (grown rarely), and the
// event the host waits on. Per host thread, so two threads never share it.
struct PinnedCounts {
  int32_t* host = nullptr;
  size_t capacity = 0;  // entries
  cudaEvent_t done = nullptr;
  ~PinnedCounts() {
    // At exit the runtime may be gone already: nothing to report then.
    if (host != nullptr) cudaFreeHost(host);
    if (done != nullptr) cudaEventDestroy(done);
  }
};

}  // namespace

void ep_row_buckets(const Tensor& idx, int64_t per, int64_t num_experts, const Tensor& buckets) {
  MT_CHECK(idx.ndim() == 2 && per >= 1 && num_experts % per == 0)
      << "ep_row_buckets wants idx [N,k] and the experts split evenly, got " << idx.str() << ", " << num_experts
      << " experts, " << per << " per rank";
  const int64_t n = idx.dim(0), k = idx.dim(1);
  check_arg(idx, "ep_row_buckets idx", {DType::i32}, {n, k});
  check_arg(buckets, "ep_row_buckets buckets", {DType::i32}, {n, k});
  launch_index(ep_row_buckets_kernel, n * k, idx.i32(), buckets.i32(), static_cast<int>(n * k), static_cast<int>(k),
               static_cast<int>(per), static_cast<int>(num_experts));
}

void ep_route_slots(const Tensor& idx, const Tensor& mine, const Tensor& first, const Tensor& slot,
                    const Tensor& bound, const Tensor& slots) {
  MT_CHECK(idx.ndim() == 2 && mine.ndim() == 1 && first.numel() == mine.numel() + 1 && slot.numel() == bound.numel())
      << "ep_route_slots wants idx [N,k], mine [E], first [E+1], slot and bound [C], got " << idx.str() << ", "
      << mine.str() << ", " << first.str() << ", " << slot.str() << ", " << bound.str();
  const int64_t n = idx.dim(0), k = idx.dim(1);
  check_arg(idx, "ep_route_slots idx", {DType::i32}, {n, k});
  check_arg(slots, "ep_route_slots slots", {DType::i32}, {n, k});
  check_arg(bound, "ep_route_slots bound", {DType::i64}, {slot.numel()});
  launch_index(ep_route_slots_kernel, n * k, idx.i32(), mine.i32(), first.i32(), slot.i32(),
               static_cast<const int64_t*>(bound.data), slots.i32(), static_cast<int>(n * k), static_cast<int>(k),
               static_cast<int>(mine.numel()));
}

void ep_send_buckets(const Tensor& idx, const Tensor& sent_slot, int64_t per, const Tensor& buckets) {
  MT_CHECK(idx.ndim() == 2 && sent_slot.ndim() == 1 && per >= 1)
      << "ep_send_buckets wants idx [N,k] and sent_slot [S], got " << idx.str() << ", " << sent_slot.str() << " ("
      << per << " experts per rank)";
  const int64_t n = idx.dim(0), k = idx.dim(1), rows = sent_slot.dim(0);
  check_arg(idx, "ep_send_buckets idx", {DType::i32}, {n, k});
  check_arg(sent_slot, "ep_send_buckets sent_slot", {DType::i32}, {rows});
  check_arg(buckets, "ep_send_buckets buckets", {DType::i32}, {rows, k});
  launch_index(ep_send_buckets_kernel, rows * k, idx.i32(), sent_slot.i32(), buckets.i32(), static_cast<int>(rows),
               static_cast<int>(n * k), static_cast<int>(k), static_cast<int>(per));
}

void ep_pack_counts(const Tensor& row_counts, const Tensor& expert_offsets, int64_t per, const Tensor& out) {
  MT_CHECK(row_counts.ndim() == 1 && per >= 1)
      << "ep_pack_counts wants row_counts [ranks], got " << row_counts.str() << " (" << per << " experts per rank)";
  const int64_t ranks = row_counts.dim(0);
  check_arg(row_counts, "ep_pack_counts row_counts", {DType::i32}, {ranks});
  check_arg(expert_offsets, "ep_pack_counts expert_offsets", {DType::i32}, {ranks * per + 1});
  check_arg(out, "ep_pack_counts out", {DType::i32}, {ranks, 2});
  launch_index(ep_pack_counts_kernel, ranks, row_counts.i32(), expert_offsets.i32(), out.i32(), static_cast<int>(ranks),
               static_cast<int>(per));
}

void ep_return_buckets(const Tensor& order, const Tensor& local_offsets, const Tensor& recv_counts, int64_t k,
                       const Tensor& buckets) {
  MT_CHECK(order.ndim() == 1 && local_offsets.ndim() == 1 && local_offsets.dim(0) >= 1 &&
           recv_counts.ndim() == 2 && recv_counts.dim(0) >= 1 && k >= 1)
      << "ep_return_buckets wants order [M], local_offsets [E+1], recv_counts [ranks,2] and k >= 1, got "
      << order.str() << ", " << local_offsets.str() << ", " << recv_counts.str() << ", k " << k;
  const int64_t m = order.dim(0), ranks = recv_counts.dim(0);
  check_arg(order, "ep_return_buckets order", {DType::i32}, {m});
  check_arg(local_offsets, "ep_return_buckets local_offsets", {DType::i32}, local_offsets.shape);
  check_arg(recv_counts, "ep_return_buckets recv_counts", {DType::i32}, {ranks, 2});
  check_arg(buckets, "ep_return_buckets buckets", {DType::i32}, {m});
  launch_index(ep_return_buckets_kernel, m, order.i32(), local_offsets.i32() + local_offsets.dim(0) - 1,
               recv_counts.i32(), buckets.i32(), static_cast<int>(m), static_cast<int>(ranks), static_cast<int>(k));
}

void ep_kept_buckets(const Tensor& idx, const Tensor& token_rows, const Tensor& kept_rows, int64_t per,
                     const Tensor& buckets) {
  MT_CHECK(idx.ndim() == 2 && kept_rows.ndim() == 1 && per >= 1)
      << "ep_kept_buckets wants idx [N,k] and kept_rows [S*k], got " << idx.str() << ", " << kept_rows.str() << " ("
      << per << " experts per rank)";
  const int64_t n = idx.dim(0), k = idx.dim(1);
  check_arg(idx, "ep_kept_buckets idx", {DType::i32}, {n, k});
  check_arg(token_rows, "ep_kept_buckets token_rows", {DType::i32}, {n * k});
  check_arg(kept_rows, "ep_kept_buckets kept_rows", {DType::i32}, kept_rows.shape);
  check_arg(buckets, "ep_kept_buckets buckets", {DType::i32}, {n, k});
  launch_index(ep_kept_buckets_kernel, n * k, idx.i32(), token_rows.i32(), kept_rows.i32(), buckets.i32(),
               static_cast<int>(n * k), static_cast<int>(k), static_cast<int>(per), static_cast<int>(kept_rows.dim(0)));
}

void read_counts(std::initializer_list<Tensor> arrays, int32_t* out) {
  static thread_local PinnedCounts pinned;
  size_t total = 0;
  for (const Tensor& a : arrays) {
    MT_CHECK(a.dtype == DType::i32 && a.device == Device::cuda && a.defined())
        << "read_counts wants i32 arrays with storage, all on the GPU, got " << a.str();
    total += static_cast<size_t>(a.numel());
  }
  if (total == 0) return;
  if (total > pinned.capacity) {
    // Rare (the first read, or more ranks or experts than before): freeing pinned
    // memory synchronises the device.
    if (pinned.host != nullptr) CUDA_CHECK(cudaFreeHost(pinned.host));
    pinned.host = nullptr;
    pinned.capacity = std::max<size_t>(total, 4096);
    CUDA_CHECK(cudaMallocHost(&pinned.host, pinned.capacity * sizeof(int32_t)));
  }
  if (pinned.done == nullptr) CUDA_CHECK(cudaEventCreateWithFlags(&pinned.done, cudaEventDisableTiming));
  size_t at = 0;
  for (const Tensor& a : arrays) {
    if (a.numel() == 0) continue;
    CUDA_CHECK(cudaMemcpyAsync(pinned.host + at, a.data, a.nbytes(), cudaMemcpyDeviceToHost, stream()));
    at += static_cast<size_t>(a.numel());
  }
  CUDA_CHECK(cudaEventRecord(pinned.done, stream()));
  count_host_wait();
  CUDA_CHECK(cudaEventSynchronize(pinned.done));
  std::memcpy(out, pinned.host, total * sizeof(int32_t));
}

}  // namespace mt::cuda
