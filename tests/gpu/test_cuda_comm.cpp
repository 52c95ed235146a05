// The communicator's NCCL path on GPU buffers, as a one-rank world (run test_cuda_ops
// without a launcher on the GPU machine): every operation goes through NCCL with one
// rank, stream-ordered with the backend's kernels, and must give what the MPI path
// gives on the same call (tests/test_parallel.cpp covers that path on many ranks).
// Started operations run on their traffic's stream after the compute queued before
// them and are joined by the current stream (a StreamScope's, not the main one). Two
// compute streams at once, each under a StreamScope, share no buffer: every op that
// uses scratch or a workspace gives what it gives on one stream.
// Then the parallel layers' GPU paths on that one-rank world: expert parallelism
// (device plan, bf16 transfers) must be the single-GPU dispatch bit for bit, its plan
// the CPU's plan, its steps for several ranks the CPU's steps, its exchanges in two
// halves the one-call path bit for bit; and ring
// attention (merge kernels, fp32 partial sums) the single attention call within bf16
// roundings. Several ranks: tests/gpu/meshes.py trains on 2..8 GPUs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>

#include "comm/communicator.h"
#include "ep_exchange.h"
#include "gpu/gpu_test.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/rmsnorm.h"
#include "kernels/router.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/placement.h"

namespace mt::gpu_test {
namespace {

TEST(CudaComm, OneRankWorldRunsEveryOperationThroughNccl) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& c = comm::world().comm();
  ASSERT_EQ(c.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  c.init_gpu();
  const std::vector<float> values = random_floats(96, -2, 2, 77);

  // Sums over one rank leave f32 and bf16 values as they are.
  for (DType t : {DType::f32, DType::bf16}) {
    DeviceTensor x = upload(values, t, {96});
    c.all_reduce(x.t);
    EXPECT_TRUE(near("all_reduce", download(x.t), t == DType::bf16 ? round_bf16(values) : values, Tol()));
  }
  DeviceTensor in = upload(values, DType::f32, {96});
  DeviceTensor out = poisoned(DType::f32, {96});
  c.reduce_scatter(in.t, out.t);
  EXPECT_TRUE(near("reduce_scatter", download(out.t), values, Tol()));
  out.poison();
  c.all_gather(in.t, out.t);
  EXPECT_TRUE(near("all_gather", download(out.t), values, Tol()));
  out.poison();
  const std::vector<int64_t> counts = {96};
  c.all_to_all_v(in.t, counts, out.t, counts);
  EXPECT_TRUE(near("all_to_all_v", download(out.t), values, Tol()));
  c.broadcast(in.t, 0);
  EXPECT_TRUE(near("broadcast", download(in.t), values, Tol()));

  // A started batch to oneself, waited for by the backend's stream: the download
  // after it (on that stream) sees the received values.
  std::vector<int32_t> ids = random_ints(40, -1000, 1000, 78);
  DeviceTensor a = upload(ids, {40});
  DeviceTensor b = upload(std::vector<int32_t>(40, 0), {40});
  comm::Request r = c.start({comm::send_to(a.t, 0), comm::recv_from(b.t, 0)});
  r.wait();
  EXPECT_EQ(download_ints(b.t), ids);
  c.barrier();
}

// A stream of a test's own, idle and destroyed at the end (runtime.h: its buffers stay
// under its handle, which CUDA may hand out again).
struct SideStream {
  SideStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~SideStream() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t s = nullptr;
};

// Milliseconds of work for the current stream: products of 4096 x 4096 bf16 matrices
// (about 0.25 ms each on an H200), so whatever does not wait for them runs long before
// they end, and a missing wait shows as poisoned or stale values.
struct Busy {
  void queue(int products) const {
    for (int i = 0; i < products; ++i) mt::gemm(a.t, a.t, c.t, false, false);
  }
  DeviceTensor a = random_device(DType::bf16, {4096, 4096}, 60);
  DeviceTensor c = DeviceTensor(DType::f32, {4096, 4096});
};

// Each started operation's input is written at the end of a long queue on the compute
// stream and more compute is queued between its start and its wait: the transfer must
// wait for the first and may overlap the second, and the wait must order the compute
// stream after it. The results equal the blocking NCCL calls' bit for bit, through NCCL
// and through host staging.
TEST(CudaComm, StartedOperationsFollowTheComputeStreamAndEqualTheBlockingOnes) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& c = comm::world().comm();
  ASSERT_EQ(c.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  const Busy busy;
  const int64_t n = 4096;
  DeviceTensor src = upload(random_floats(n, -2, 2, 61), DType::f32, {n});
  const std::vector<int64_t> counts = {n};
  // Each operation started, and blocking (the batch has no blocking form: start + wait).
  using Op = std::function<comm::Request(const Tensor& in, const Tensor& out)>;
  using Blocking = std::function<void(const Tensor& in, const Tensor& out)>;
  struct Case {
    const char* name;
    bool in_place;
    Op start;
    Blocking blocking;
  };
  const std::vector<Case> cases = {
      {"all_reduce", true,
       [&](const Tensor& in, const Tensor&) { return c.start_all_reduce(in, comm::Traffic::gradient); },
       [&](const Tensor& in, const Tensor&) { c.all_reduce(in); }},
      {"reduce_scatter", false,
       [&](const Tensor& in, const Tensor& out) { return c.start_reduce_scatter(in, out, comm::Traffic::gradient); },
       [&](const Tensor& in, const Tensor& out) { c.reduce_scatter(in, out); }},
      {"all_gather", false,
       [&](const Tensor& in, const Tensor& out) { return c.start_all_gather(in, out, comm::Traffic::gather); },
       [&](const Tensor& in, const Tensor& out) { c.all_gather(in, out); }},
      {"all_to_all_v", false,
       [&](const Tensor& in, const Tensor& out) {
         return c.start_all_to_all_v(in, counts, out, counts, comm::Traffic::expert);
       },
       [&](const Tensor& in, const Tensor& out) { c.all_to_all_v(in, counts, out, counts); }},
      {"send/recv batch", false,
       [&](const Tensor& in, const Tensor& out) {
         return c.start({comm::send_to(in, 0), comm::recv_from(out, 0)}, comm::Traffic::context);
       },
       [&](const Tensor& in, const Tensor& out) { c.start({comm::send_to(in, 0), comm::recv_from(out, 0)}).wait(); }},
  };
  // Both transports: NCCL, and the host staging of ranks that share a GPU (its start
  // must still see the compute queued before it, and its wait order the stream after).
  struct Restore {
    comm::Communicator& c;
    ~Restore() { c.set_staging(comm::Staging::none); }
  } restore{c};
  for (auto [staging, how] : {std::pair{comm::Staging::none, "NCCL"}, std::pair{comm::Staging::gpu_tensors, "staged"}})
  for (DType t : {DType::f32, DType::bf16}) {
    c.set_staging(staging);
    for (const Case& op : cases) {
      SCOPED_TRACE(std::string(op.name) + ", " + std::string(dtype_name(t)) + ", " + how);
      DeviceTensor in_b = poisoned(t, {n}), out_b = poisoned(t, {n});
      mt::cast(src.t, in_b.t);
      c.set_staging(comm::Staging::none);
      op.blocking(in_b.t, out_b.t);
      c.set_staging(staging);
      const std::vector<float> want = download((op.in_place ? in_b : out_b).t);

      DeviceTensor in = poisoned(t, {n}), out = poisoned(t, {n});
      busy.queue(20);
      mt::cast(src.t, in.t);
      comm::Request r = op.start(in.t, out.t);
      busy.queue(20);
      r.wait();
      EXPECT_EQ(download((op.in_place ? in : out).t), want);
    }
  }
}

// Request::wait under a StreamScope orders that scope's stream, not the main one: the
// side stream, idle otherwise, reads the transfer's output only once it is there.
TEST(CudaComm, WaitOrdersTheCurrentStream) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& c = comm::world().comm();
  ASSERT_EQ(c.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  const Busy busy;
  const std::vector<float> values = random_floats(4096, -2, 2, 62);
  DeviceTensor in = upload(values, DType::f32, {4096});
  DeviceTensor out = poisoned(DType::f32, {4096}), seen = poisoned(DType::f32, {4096});
  SideStream side;
  busy.queue(40);  // the transfer starts after these
  comm::Request r = c.start_all_gather(in.t, out.t, comm::Traffic::gather);
  {
    cuda::StreamScope scope(side.s);
    EXPECT_EQ(cuda::stream(), side.s);
    r.wait();
    mt::copy(seen.t, out.t);
  }
  cuda::join(cuda::main_stream(), side.s);
  EXPECT_EQ(download(seen.t), values);
}

TEST(CudaStreams, ScopesNestAndEachStreamHasItsOwnBuffers) {
  MT_SKIP_WITHOUT_GPU();
  EXPECT_EQ(cuda::stream(), cuda::main_stream());
  void* main_scratch = cuda::scratch(1024);
  void* main_blaslt = cuda::blaslt_workspace();
  SideStream a, b;
  {
    cuda::StreamScope in_a(a.s);
    EXPECT_EQ(cuda::stream(), a.s);
    void* a_scratch = cuda::scratch(1024);
    EXPECT_NE(a_scratch, main_scratch);
    EXPECT_EQ(cuda::scratch(512), a_scratch) << "a stream's scratch is reused while large enough";
    EXPECT_NE(cuda::blaslt_workspace(), main_blaslt);
    {
      cuda::StreamScope in_b(b.s);
      EXPECT_EQ(cuda::stream(), b.s);
      EXPECT_NE(cuda::scratch(1024), a_scratch);
      EXPECT_NE(cuda::scratch(1024), main_scratch);
    }
    EXPECT_EQ(cuda::stream(), a.s);
    EXPECT_EQ(cuda::scratch(1024), a_scratch);
  }
  EXPECT_EQ(cuda::stream(), cuda::main_stream());
  EXPECT_EQ(cuda::scratch(1024), main_scratch);
  EXPECT_EQ(cuda::blaslt_workspace(), main_blaslt);
}

// Ops that use the per-stream buffers: a cuBLASLt product (its workspace), RMSNorm's
// weight gradient and the router's probability sums (scratch partials), the grouped
// GEMM (its workspace), attention forward and backward (cuDNN's handle and workspace
// where it applies, else our kernel's scratch) and the cross-entropy sum (scratch, then
// a wait for the current stream). Every output is written afresh by each run().
struct ScratchWork {
  explicit ScratchWork(uint64_t seed)
      : a(upload(random_floats(1024 * 1024, -1, 1, seed), DType::bf16, {1024, 1024})),
        b(upload(random_floats(1024 * 1024, -1, 1, seed + 1), DType::bf16, {1024, 1024})),
        x(upload(random_floats(8192 * 1024, -2, 2, seed + 2), DType::bf16, {8192, 1024})),
        dy(upload(random_floats(8192 * 1024, -1, 1, seed + 3), DType::bf16, {8192, 1024})),
        w(upload(random_floats(1024, 0.5f, 1.5f, seed + 4), DType::f32, {1024})),
        probs(upload(random_floats(8192 * 64, 0, 1, seed + 5), DType::f32, {8192, 64})),
        gx(upload(random_floats(4096 * 512, -1, 1, seed + 6), DType::bf16, {4096, 512})),
        gw(upload(random_floats(8 * 512 * 512, -1, 1, seed + 7), DType::bf16, {8, 512, 512})),
        offsets(upload(std::vector<int32_t>{0, 100, 612, 612, 1500, 2048, 3000, 4000, 4096}, {9})),
        q(upload(random_floats(2 * 512 * 8 * 64, -2, 2, seed + 8), DType::bf16, {2, 512, 8, 64})),
        k(upload(random_floats(2 * 512 * 2 * 64, -2, 2, seed + 9), DType::bf16, {2, 512, 2, 64})),
        v(upload(random_floats(2 * 512 * 2 * 64, -1, 1, seed + 10), DType::bf16, {2, 512, 2, 64})),
        dout(upload(random_floats(2 * 512 * 8 * 64, -1, 1, seed + 11), DType::bf16, {2, 512, 8, 64})),
        logits(upload(random_floats(2048 * 4096, -4, 4, seed + 12), DType::bf16, {2048, 4096})),
        labels(upload(random_ints(2048, 0, 4095, seed + 13), {2048})) {
    args.scale = 0.125f;
  }

  // Queues everything on the current stream; the cross-entropy sum waits for it.
  cpu::CrossEntropySum run() {
    mt::gemm(a.t, b.t, c.t, false, true);
    mt::rmsnorm_forward(x.t, w.t, 1e-6f, y.t, rstd.t);
    mt::fill(dw.t, 0.0f);
    mt::rmsnorm_backward(x.t, w.t, rstd.t, dy.t, Tensor(), dw.t);
    mt::router_prob_sum(probs.t, sums.t);
    mt::grouped_gemm(gx.t, gw.t, Tensor(), offsets.t, gy.t);
    mt::attention_forward(q.t, k.t, v.t, Tensor(), args, out.t, lse.t);
    mt::attention_backward(q.t, k.t, v.t, Tensor(), args, out.t, lse.t, dout.t, dq.t, dk.t, dv.t, Tensor());
    return mt::cross_entropy_forward(logits.t, labels.t, -100, ce_lse.t);
  }

  void poison() {
    for (DeviceTensor* t : {&c, &y, &rstd, &dw, &sums, &gy, &out, &lse, &dq, &dk, &dv, &ce_lse}) t->poison();
  }

  // Outputs that repeat bit for bit, then cuDNN's attention gradients (its backward adds
  // dQ with atomics, so those may differ in the last bits).
  std::vector<std::pair<std::string, std::vector<float>>> exact() const {
    return {{"gemm", download(c.t)},     {"rmsnorm y", download(y.t)},  {"rmsnorm dw", download(dw.t)},
            {"prob sums", download(sums.t)}, {"grouped gemm", download(gy.t)}, {"attention out", download(out.t)},
            {"attention lse", download(lse.t)}, {"cross-entropy lse", download(ce_lse.t)}};
  }
  std::vector<std::pair<std::string, std::vector<float>>> gradients() const {
    return {{"dq", download(dq.t)}, {"dk", download(dk.t)}, {"dv", download(dv.t)}};
  }

  DeviceTensor a, b, x, dy, w, probs, gx, gw, offsets, q, k, v, dout, logits, labels;
  DeviceTensor c = poisoned(DType::f32, {1024, 1024});
  DeviceTensor y = poisoned(DType::bf16, {8192, 1024}), rstd = poisoned(DType::f32, {8192});
  DeviceTensor dw = poisoned(DType::f32, {1024}), sums = poisoned(DType::f32, {64});
  DeviceTensor gy = poisoned(DType::bf16, {4096, 512});
  DeviceTensor out = poisoned(DType::bf16, {2, 512, 8, 64}), lse = poisoned(DType::f32, {2, 8, 512});
  DeviceTensor dq = poisoned(DType::bf16, {2, 512, 8, 64});
  DeviceTensor dk = poisoned(DType::bf16, {2, 512, 2, 64}), dv = poisoned(DType::bf16, {2, 512, 2, 64});
  DeviceTensor ce_lse = poisoned(DType::f32, {2048});
  cpu::AttentionArgs args;
};

// Two problems queued on two streams at once, interleaved, repeatedly, give what they
// give one after the other on the main stream: no buffer is shared between the streams.
TEST(CudaStreams, TwoStreamsAtOnceGiveWhatOneStreamGives) {
  MT_SKIP_WITHOUT_GPU();
  ScratchWork one(200), two(300);
  const cpu::CrossEntropySum ce_one = one.run(), ce_two = two.run();
  const auto exact_one = one.exact(), exact_two = two.exact();
  const auto grads_one = one.gradients(), grads_two = two.gradients();
  one.poison();
  two.poison();

  SideStream s1, s2;
  cuda::join(s1.s, cuda::main_stream());
  cuda::join(s2.s, cuda::main_stream());
  cpu::CrossEntropySum got_one, got_two;
  for (int round = 0; round < 3; ++round) {
    // The first cross-entropy sum waits for its stream only, the other stream runs on.
    {
      cuda::StreamScope scope(s1.s);
      got_one = one.run();
    }
    {
      cuda::StreamScope scope(s2.s);
      got_two = two.run();
    }
  }
  cuda::join(cuda::main_stream(), s1.s);
  cuda::join(cuda::main_stream(), s2.s);
  EXPECT_EQ(got_one.loss_sum, ce_one.loss_sum);
  EXPECT_EQ(got_one.count, ce_one.count);
  EXPECT_EQ(got_two.loss_sum, ce_two.loss_sum);
  EXPECT_EQ(got_two.count, ce_two.count);
  for (auto [work, want_exact, want_grads] :
       {std::tuple{&one, &exact_one, &grads_one}, std::tuple{&two, &exact_two, &grads_two}}) {
    const auto got_exact = work->exact(), got_grads = work->gradients();
    for (size_t i = 0; i < want_exact->size(); ++i)
      EXPECT_TRUE(got_exact[i].second == (*want_exact)[i].second) << (*want_exact)[i].first << " differs";
    for (size_t i = 0; i < want_grads->size(); ++i) {
      const std::vector<float>& want = (*want_grads)[i].second;
      EXPECT_TRUE(near((*want_grads)[i].first, got_grads[i].second, want, Tol(2 * kBf16Round, 1e-3 * max_abs(want))));
    }
  }
}

// k distinct experts of E for each of n tokens, from `seed`.
std::vector<int32_t> distinct_experts(int64_t n, int64_t k, int64_t e, uint64_t seed) {
  const std::vector<int32_t> r = random_ints(n * e, 0, 1 << 20, seed);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(e));
    std::iota(perm.begin(), perm.end(), 0);
    std::sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) {
      return std::make_pair(r[t * e + a], a) < std::make_pair(r[t * e + b], b);
    });
    idx.insert(idx.end(), perm.begin(), perm.begin() + k);
  }
  return idx;
}

// With one rank the exchange moves every row to itself and the experts see the rows in
// the single-GPU order, so every output equals the single-GPU dispatch's bit for bit:
// the same bf16 copies and the same fp32 sums in the same slot order.
TEST(CudaParallel, OneRankExpertParallelIsTheSingleGpuDispatch) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& ep = comm::world().comm();
  ASSERT_EQ(ep.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  const int64_t n = 37, k = 2, e = 8, d = 24, r = n * k;
  DeviceTensor idx = upload(distinct_experts(n, k, e, 90), {n, k});
  DeviceTensor x = upload(random_floats(n * d, -2, 2, 91), DType::bf16, {n, d});
  DeviceTensor weight = upload(random_floats(n * k, 0.1f, 1, 92), DType::f32, {n, k});
  DeviceTensor ys = upload(random_floats(r * d, -2, 2, 93), DType::bf16, {r, d});
  DeviceTensor dy = upload(random_floats(n * d, -1, 1, 94), DType::bf16, {n, d});
  DeviceTensor dxs = upload(random_floats(r * d, -1, 1, 95), DType::bf16, {r, d});

  // The single-GPU path.
  DeviceTensor counts = poisoned(DType::i32, {e}), offsets = poisoned(DType::i32, {e + 1});
  DeviceTensor order = poisoned(DType::i32, {r}), slot_row = poisoned(DType::i32, {r});
  DeviceTensor xs_1 = poisoned(DType::bf16, {r, d}), y_1 = poisoned(DType::bf16, {n, d});
  DeviceTensor dys_1 = poisoned(DType::bf16, {r, d}), dw_1 = poisoned(DType::f32, {n, k});
  DeviceTensor dx_1 = poisoned(DType::bf16, {n, d});
  mt::dispatch_plan(idx.t, e, 0, counts.t, offsets.t, order.t, slot_row.t);
  mt::dispatch_forward(x.t, order.t, k, xs_1.t);
  mt::combine_forward(ys.t, weight.t, slot_row.t, y_1.t);
  mt::combine_backward(ys.t, weight.t, slot_row.t, dy.t, dys_1.t, dw_1.t);
  mt::dispatch_backward(dxs.t, slot_row.t, dx_1.t);

  // Expert parallelism over the one-rank world.
  parallel::EpPlan plan = parallel::ep_plan(ep, idx.t, e);
  ASSERT_EQ(plan.local_rows(), r);
  EXPECT_EQ(plan.device, Device::cuda);
  EXPECT_EQ(plan.offsets.device, Device::cuda);
  EXPECT_EQ(download_ints(plan.offsets), download_ints(offsets.t));
  EXPECT_EQ(download_ints(plan.expert_counts), download_ints(counts.t));
  DeviceTensor xs = poisoned(DType::bf16, {r, d}), y = poisoned(DType::bf16, {n, d});
  DeviceTensor back = poisoned(DType::bf16, {r, d}), dys = poisoned(DType::bf16, {r, d});
  DeviceTensor dw = poisoned(DType::f32, {n, k}), dx = poisoned(DType::bf16, {n, d});
  test::ep_dispatch_forward(ep, plan, x.t, xs.t);
  test::ep_combine_forward(ep, plan, ys.t, weight.t, back.t, y.t);
  test::ep_combine_backward(ep, plan, back.t, weight.t, dy.t, dys.t, dw.t);
  test::ep_dispatch_backward(ep, plan, dxs.t, dx.t);
  EXPECT_TRUE(near("xs", download(xs.t), download(xs_1.t), Tol()));
  EXPECT_TRUE(near("y", download(y.t), download(y_1.t), Tol()));
  EXPECT_TRUE(near("dys", download(dys.t), download(dys_1.t), Tol()));
  EXPECT_TRUE(near("dweight", download(dw.t), download(dw_1.t), Tol()));
  EXPECT_TRUE(near("dx", download(dx.t), download(dx_1.t), Tol()));
}

// Routings for the plan tests: k distinct experts of E per token by random keys;
// skewed: three tokens in four prefer the first quarter of the experts; sparse: experts
// 1, 4, 7, ... are never chosen.
enum class Routing { random, skewed, sparse };

std::vector<int32_t> routing(int64_t n, int64_t k, int64_t e, Routing kind, uint64_t seed) {
  const std::vector<int32_t> keys = random_ints(n * e, 0, 1 << 20, seed);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> allowed;
    for (int32_t x = 0; x < e; ++x)
      if (kind != Routing::sparse || x % 3 != 1) allowed.push_back(x);
    auto key = [&](int32_t x) {
      const bool favoured = kind == Routing::skewed && t % 4 != 0 && x < e / 4;
      return std::make_pair(favoured ? 0 : 1, keys[t * e + x]);
    };
    std::sort(allowed.begin(), allowed.end(), [&](int32_t a, int32_t b) { return key(a) < key(b); });
    idx.insert(idx.end(), allowed.begin(), allowed.begin() + k);
  }
  return idx;
}

std::vector<int32_t> host_ints(const Tensor& t) { return std::vector<int32_t>(t.i32(), t.i32() + t.numel()); }

// The plan built on the GPU is the plan built on the CPU from the same idx (one rank:
// the whole plan runs, every array and count compared), with and without a capacity.
TEST(CudaParallel, DevicePlanIsTheCpuPlan) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& ep = comm::world().comm();
  ASSERT_EQ(ep.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  struct Case {
    const char* name;
    int64_t n, k, e;
    Routing kind;
  };
  for (Case c : {Case{"random top-2 of 8", 37, 2, 8, Routing::random},
                 Case{"skewed, several chunks", 300, 4, 16, Routing::skewed},
                 Case{"empty experts", 40, 3, 12, Routing::sparse}, Case{"no tokens", 0, 2, 8, Routing::random},
                 Case{"k = E", 20, 4, 4, Routing::random}}) {
    for (int64_t capacity : {0, 1, 5}) {
      SCOPED_TRACE(std::string(c.name) + ", capacity " + std::to_string(capacity));
      std::vector<int32_t> idx = routing(c.n, c.k, c.e, c.kind, 96 + c.n);
      DeviceTensor idx_d = upload(idx, {c.n, c.k});
      const parallel::EpPlan want = parallel::ep_plan(ep, host(idx, {c.n, c.k}), c.e, capacity);
      // The host waits only for the counts: once, and once more with a capacity.
      const int64_t waits = cuda::host_waits();
      const parallel::EpPlan got = parallel::ep_plan(ep, idx_d.t, c.e, capacity, parallel::mark_routed(idx_d.t));
      EXPECT_EQ(cuda::host_waits() - waits, capacity > 0 ? 2 : 1);
      EXPECT_EQ(got.device, Device::cuda);
      EXPECT_EQ(got.sent_rows_to, want.sent_rows_to);
      EXPECT_EQ(got.slots_to, want.slots_to);
      EXPECT_EQ(got.recv_rows_from, want.recv_rows_from);
      EXPECT_EQ(got.slots_from, want.slots_from);
      EXPECT_EQ(got.dropped, want.dropped);
      if (capacity == 1 && c.n > 0) {
        EXPECT_GT(want.dropped, 0) << "a capacity of 1 should drop slots here";
      }
      for (auto [name, g, w] : {std::tuple{"sent_slot", &got.sent_slot, &want.sent_slot},
                                std::tuple{"token_rows", &got.token_rows, &want.token_rows},
                                std::tuple{"slot_row", &got.slot_row, &want.slot_row},
                                std::tuple{"expert_counts", &got.expert_counts, &want.expert_counts},
                                std::tuple{"order", &got.order, &want.order},
                                std::tuple{"local_slot_row", &got.local_slot_row, &want.local_slot_row},
                                std::tuple{"return_row", &got.return_row, &want.return_row},
                                std::tuple{"return_pos", &got.return_pos, &want.return_pos},
                                std::tuple{"offsets", &got.offsets, &want.offsets}})
        EXPECT_EQ(download_ints(*g), host_ints(*w)) << name;
    }
  }
}

// Expert replicas' routing (parallel/placement.h): on skewed loads over 4 ranks with 2
// replica slots each, every sender's table routes skewed choices on the GPU to the slots
// the CPU's kernel gives.
TEST(CudaParallel, ReplicaRoutingIsTheCpuRouting) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 300, k = 4, e = 16, ranks = 4;
  std::vector<double> load(static_cast<size_t>(e), 1.0);
  load[3] = 9;
  load[10] = 5;
  const parallel::Placement p = parallel::plan_placement(load, ranks, 2);
  std::vector<int32_t> idx = routing(n, k, e, Routing::skewed, 122);
  DeviceTensor idx_d = upload(idx, {n, k});
  for (int64_t sender = 0; sender < ranks; ++sender) {
    parallel::RouteTable t = parallel::route_table(p, sender);
    const int64_t c = static_cast<int64_t>(t.slot.size());
    std::vector<int32_t> want(static_cast<size_t>(n * k));
    cpu::ep_route_slots(host(idx, {n, k}), host(t.mine, {e}), host(t.first, {e + 1}), host(t.slot, {c}),
                        Tensor(t.bound.data(), {c}, DType::i64), host(want, {n, k}));
    // The bounds travel as pairs of i32 words.
    std::vector<int32_t> words(static_cast<size_t>(2 * c));
    std::memcpy(words.data(), t.bound.data(), t.bound.size() * sizeof(int64_t));
    DeviceTensor mine = upload(t.mine, {e}), first = upload(t.first, {e + 1}), slot = upload(t.slot, {c});
    DeviceTensor bound = upload(words, {2 * c}), out = poisoned(DType::i32, {n, k});
    mt::ep_route_slots(idx_d.t, mine.t, first.t, slot.t, Tensor(bound.t.data, {c}, DType::i64, Device::cuda), out.t);
    EXPECT_EQ(download_ints(out.t), want) << "sender " << sender;
    EXPECT_TRUE(std::all_of(want.begin(), want.end(), [&](int32_t g) { return g >= 0 && g < ranks * p.slots_per_rank(); }));
  }
}

// The plan's steps for several ranks (which the one-rank world cannot exercise): E = 16
// experts over 4 ranks, each step on the GPU from the inputs the CPU's steps made.
TEST(CudaParallel, PlanStepsForFourRanksMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 150, k = 5, e = 16, ranks = 4, per = e / ranks, slots = n * k;
  std::vector<int32_t> idx = routing(n, k, e, Routing::skewed, 120);
  DeviceTensor idx_d = upload(idx, {n, k});

  // Rows by (rank, token): the first slot of each token to a rank, and their sort.
  std::vector<int32_t> buckets(slots);
  cpu::ep_row_buckets(host(idx, {n, k}), per, e, host(buckets, {n, k}));
  DeviceTensor buckets_d = poisoned(DType::i32, {n, k});
  mt::ep_row_buckets(idx_d.t, per, e, buckets_d.t);
  EXPECT_EQ(download_ints(buckets_d.t), buckets);
  for (int64_t capacity : {0, 7}) {
    SCOPED_TRACE("dispatch_sort with capacity " + std::to_string(capacity));
    std::vector<int32_t> counts(ranks), offsets(ranks + 1), order(slots), slot_row(slots);
    cpu::dispatch_sort(host(buckets, {n, k}), ranks, capacity, host(counts, {ranks}), host(offsets, {ranks + 1}),
                       host(order, {slots}), host(slot_row, {slots}));
    DeviceTensor counts_d = poisoned(DType::i32, {ranks}), offsets_d = poisoned(DType::i32, {ranks + 1});
    DeviceTensor order_d = poisoned(DType::i32, {offsets[ranks]}), slot_row_d = poisoned(DType::i32, {slots});
    mt::dispatch_sort(buckets_d.t, ranks, capacity, counts_d.t, offsets_d.t, order_d.t, slot_row_d.t);
    EXPECT_EQ(download_ints(counts_d.t), counts);
    EXPECT_EQ(download_ints(offsets_d.t), offsets);
    EXPECT_EQ(download_ints(order_d.t), std::vector<int32_t>(order.begin(), order.begin() + offsets[ranks]));
    EXPECT_EQ(download_ints(slot_row_d.t), slot_row);
  }
  std::vector<int32_t> row_counts(ranks), row_offsets(ranks + 1), sent_slot(slots), token_rows(slots);
  cpu::dispatch_sort(host(buckets, {n, k}), ranks, 0, host(row_counts, {ranks}), host(row_offsets, {ranks + 1}),
                     host(sent_slot, {slots}), host(token_rows, {slots}));
  const int64_t sent = row_offsets[ranks];
  sent_slot.resize(static_cast<size_t>(sent));

  // What each row tells its rank, and the counts per rank.
  std::vector<int32_t> send(sent * k);
  cpu::ep_send_buckets(host(idx, {n, k}), host(sent_slot, {sent}), per, host(send, {sent, k}));
  DeviceTensor sent_slot_d = upload(sent_slot, {sent}), send_d = poisoned(DType::i32, {sent, k});
  mt::ep_send_buckets(idx_d.t, sent_slot_d.t, per, send_d.t);
  EXPECT_EQ(download_ints(send_d.t), send);
  std::vector<int32_t> expert_counts(e), expert_offsets(e + 1), expert_order(slots), back_row(slots), packed(2 * ranks);
  cpu::dispatch_plan(host(idx, {n, k}), e, 0, host(expert_counts, {e}), host(expert_offsets, {e + 1}),
                     host(expert_order, {slots}), host(back_row, {slots}));
  cpu::ep_pack_counts(host(row_counts, {ranks}), host(expert_offsets, {e + 1}), per, host(packed, {ranks, 2}));
  DeviceTensor row_counts_d = upload(row_counts, {ranks}), expert_offsets_d = upload(expert_offsets, {e + 1});
  DeviceTensor packed_d = poisoned(DType::i32, {ranks, 2});
  mt::ep_pack_counts(row_counts_d.t, expert_offsets_d.t, per, packed_d.t);
  EXPECT_EQ(download_ints(packed_d.t), packed);

  // A receiver (rank 1) gets this batch's rows for it, as if from four sources (the
  // counts split its rows), sorts their copies with a capacity and buckets the xs rows
  // by source rank.
  const int64_t first = row_offsets[1], received = row_offsets[2] - first, capacity = 6;
  std::vector<int32_t> recv(send.begin() + first * k, send.begin() + (first + received) * k);
  std::vector<int32_t> recv_counts = {static_cast<int32_t>(received / 3), 0, static_cast<int32_t>(received / 3), 0,
                                      0, 0, static_cast<int32_t>(received - 2 * (received / 3)), 0};
  std::vector<int32_t> local_counts(per), local_offsets(per + 1), order(received * k), local_slot_row(received * k);
  cpu::dispatch_sort(host(recv, {received, k}), per, capacity, host(local_counts, {per}),
                     host(local_offsets, {per + 1}), host(order, {received * k}),
                     host(local_slot_row, {received * k}));
  std::vector<int32_t> source(received * k);
  cpu::ep_return_buckets(host(order, {received * k}), host(local_offsets, {per + 1}), host(recv_counts, {ranks, 2}),
                         k, host(source, {received * k}));
  DeviceTensor order_d = upload(order, {received * k}), local_offsets_d = upload(local_offsets, {per + 1});
  DeviceTensor recv_counts_d = upload(recv_counts, {ranks, 2}), source_d = poisoned(DType::i32, {received * k});
  mt::ep_return_buckets(order_d.t, local_offsets_d.t, recv_counts_d.t, k, source_d.t);
  EXPECT_EQ(download_ints(source_d.t), source);

  // The sender learns which slots were kept (random rows here, -1 for dropped ones).
  std::vector<int32_t> kept_rows = random_ints(sent * k, -1, 3, 121), kept(slots);
  cpu::ep_kept_buckets(host(idx, {n, k}), host(token_rows, {slots}), host(kept_rows, {sent * k}), per,
                       host(kept, {n, k}));
  DeviceTensor token_rows_d = upload(token_rows, {slots}), kept_rows_d = upload(kept_rows, {sent * k});
  DeviceTensor kept_d = poisoned(DType::i32, {n, k});
  mt::ep_kept_buckets(idx_d.t, token_rows_d.t, kept_rows_d.t, per, kept_d.t);
  EXPECT_EQ(download_ints(kept_d.t), kept);
}

// The exchanges in two halves, started together and finished after other work (a
// collective and a product on the same stream), give the one-call results bit for bit.
TEST(CudaParallel, ExchangeHalvesAreTheOneCallPath) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& ep = comm::world().comm();
  ASSERT_EQ(ep.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  const int64_t n = 45, k = 3, e = 8, d = 32;
  for (int64_t capacity : {0, 4}) {
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    DeviceTensor idx = upload(routing(n, k, e, Routing::skewed, 130), {n, k});
    const parallel::EpPlan plan = parallel::ep_plan(ep, idx.t, e, capacity);
    const int64_t r = plan.local_rows(), b = plan.returned_rows();
    DeviceTensor x = upload(random_floats(n * d, -2, 2, 131), DType::bf16, {n, d});
    DeviceTensor weight = upload(random_floats(n * k, 0.1f, 1, 132), DType::f32, {n, k});
    DeviceTensor ys = upload(random_floats(r * d, -2, 2, 133), DType::bf16, {r, d});
    DeviceTensor dy = upload(random_floats(n * d, -1, 1, 134), DType::bf16, {n, d});
    DeviceTensor dxs = upload(random_floats(r * d, -1, 1, 135), DType::bf16, {r, d});
    DeviceTensor other = upload(random_floats(4096, -1, 1, 136), DType::f32, {4096});

    DeviceTensor xs_1 = poisoned(DType::bf16, {r, d}), back_1 = poisoned(DType::bf16, {b, d});
    DeviceTensor y_1 = poisoned(DType::bf16, {n, d}), dys_1 = poisoned(DType::bf16, {r, d});
    DeviceTensor dw_1 = poisoned(DType::f32, {n, k}), dx_1 = poisoned(DType::bf16, {n, d});
    test::ep_dispatch_forward(ep, plan, x.t, xs_1.t);
    test::ep_combine_forward(ep, plan, ys.t, weight.t, back_1.t, y_1.t);
    test::ep_combine_backward(ep, plan, back_1.t, weight.t, dy.t, dys_1.t, dw_1.t);
    test::ep_dispatch_backward(ep, plan, dxs.t, dx_1.t);

    DeviceTensor xs = poisoned(DType::bf16, {r, d}), back = poisoned(DType::bf16, {b, d});
    DeviceTensor y = poisoned(DType::bf16, {n, d}), dys = poisoned(DType::bf16, {r, d});
    DeviceTensor dw = poisoned(DType::f32, {n, k}), dx = poisoned(DType::bf16, {n, d});
    auto other_work = [&] {
      ep.all_reduce(other.t);
      mt::dispatch_forward(x.t, plan.sent_slot, k, poisoned(DType::bf16, {plan.sent_rows(), d}).t);
    };
    parallel::EpExchange a = parallel::ep_dispatch_forward_start(ep, plan, x.t);
    parallel::EpExchange c = parallel::ep_combine_forward_start(ep, plan, ys.t, back.t);
    other_work();
    parallel::ep_combine_forward_finish(c, plan, weight.t, y.t);
    parallel::ep_dispatch_forward_finish(a, plan, xs.t);
    c = parallel::ep_combine_backward_start(ep, plan, back.t, weight.t, dy.t, dw.t);
    a = parallel::ep_dispatch_backward_start(ep, plan, dxs.t);
    other_work();
    parallel::ep_dispatch_backward_finish(a, plan, dx.t);
    parallel::ep_combine_backward_finish(c, plan, dys.t);

    for (auto [name, got, want] : {std::tuple{"xs", &xs, &xs_1}, std::tuple{"back", &back, &back_1},
                                   std::tuple{"y", &y, &y_1}, std::tuple{"dys", &dys, &dys_1},
                                   std::tuple{"dweight", &dw, &dw_1}, std::tuple{"dx", &dx, &dx_1}}) {
      const std::vector<float> g = download(got->t), w = download(want->t);
      ASSERT_EQ(g.size(), w.size()) << name;
      EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(float)), 0) << name << " differs";
    }
  }
}

// Ring attention with one rank holds chunks 0 and 1 of each sequence, the whole of it in
// order, and runs blocks (0,0), (1,0) and (1,1): the merge, the lse slices and the
// fp32 sums against one attention call on the same bf16 inputs. The ring rounds each
// block's output and gradients to bf16 (2^-9 of their size, at most max|v| for an
// output) before its fp32 sums, and its result once more; the single call rounds once.
// The dsinks sums differ only in their f32 order.
// With a window some rows of block (1,0) see no key (lse -inf): the merge skips them.
// MLA's head dims (192/128 on cuDNN, 24/16 with sinks on our kernel) put v's in the merge.
TEST(CudaParallel, OneRankRingAttentionIsOneAttentionCall) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& cp = comm::world().comm();
  ASSERT_EQ(cp.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  struct Case {
    int64_t b, chunk, hq, hkv, dh, dv, window;  // dv: v's head dim (MLA's differs from q's)
    bool sinks;
  };
  for (Case c : {Case{2, 40, 4, 2, 64, 64, 0, false}, Case{1, 33, 2, 1, 12, 12, 0, true},
                 Case{2, 24, 4, 4, 128, 128, 20, true}, Case{1, 64, 4, 4, 192, 128, 0, false},
                 Case{2, 24, 4, 2, 24, 16, 20, true}}) {
    SCOPED_TRACE("chunk " + std::to_string(c.chunk) + ", head dims " + std::to_string(c.dh) + "/" +
                 std::to_string(c.dv) + ", window " + std::to_string(c.window));
    const int64_t t = 2 * c.chunk;
    const Shape qs{c.b, t, c.hq, c.dh}, ks{c.b, t, c.hkv, c.dh}, ls{c.b, c.hq, t};
    const Shape vs{c.b, t, c.hkv, c.dv}, os{c.b, t, c.hq, c.dv};
    cpu::AttentionArgs args;
    args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dh)));
    args.window = c.window;
    DeviceTensor q = upload(random_floats(qs.numel(), -2, 2, 100), DType::bf16, qs);
    DeviceTensor k = upload(random_floats(ks.numel(), -2, 2, 101), DType::bf16, ks);
    DeviceTensor v = upload(random_floats(vs.numel(), -1, 1, 102), DType::bf16, vs);
    DeviceTensor dout = upload(random_floats(os.numel(), -1, 1, 103), DType::bf16, os);
    DeviceTensor sinks = upload(random_floats(c.hq, -1, 2, 104), DType::f32, {c.hq});
    const Tensor sinks_t = c.sinks ? sinks.t : Tensor();

    DeviceTensor out_1 = poisoned(DType::bf16, os), lse_1 = poisoned(DType::f32, ls);
    DeviceTensor dq_1 = poisoned(DType::bf16, qs), dk_1 = poisoned(DType::bf16, ks), dv_1 = poisoned(DType::bf16, vs);
    DeviceTensor ds_1 = upload(std::vector<float>(c.hq, 0.0f), DType::f32, {c.hq});
    mt::attention_forward(q.t, k.t, v.t, sinks_t, args, out_1.t, lse_1.t);
    mt::attention_backward(q.t, k.t, v.t, sinks_t, args, out_1.t, lse_1.t, dout.t, dq_1.t, dk_1.t, dv_1.t,
                           c.sinks ? ds_1.t : Tensor());

    DeviceTensor out = poisoned(DType::bf16, os), lse = poisoned(DType::f32, ls);
    DeviceTensor dq = poisoned(DType::bf16, qs), dk = poisoned(DType::bf16, ks), dv = poisoned(DType::bf16, vs);
    DeviceTensor ds = upload(std::vector<float>(c.hq, 0.0f), DType::f32, {c.hq});
    parallel::ring_attention_forward(cp, q.t, k.t, v.t, sinks_t, args, out.t, lse.t);
    // The backward from the single call's out and lse, so that only its own roundings differ.
    parallel::ring_attention_backward(cp, q.t, k.t, v.t, sinks_t, args, out_1.t, lse_1.t, dout.t, dq.t, dk.t, dv.t,
                                      c.sinks ? ds.t : Tensor());

    EXPECT_TRUE(near("out", download(out.t), download(out_1.t), Tol(2 * kBf16Round, kBf16Round)));
    EXPECT_TRUE(near("lse", download(lse.t), download(lse_1.t), Tol(1e-5, 1e-5)));
    for (auto [name, got, want] : {std::tuple{"dq", &dq, &dq_1}, std::tuple{"dk", &dk, &dk_1},
                                   std::tuple{"dv", &dv, &dv_1}}) {
      const std::vector<float> w = download(want->t);
      EXPECT_TRUE(near(name, download(got->t), w, Tol(2 * kBf16Round, 4 * kBf16Round * max_abs(w))));
    }
    if (c.sinks) {
      const std::vector<float> w = download(ds_1.t);
      EXPECT_TRUE(near("dsinks", download(ds.t), w, Tol(1e-3, 1e-3 * max_abs(w))));
    }
  }
}

}  // namespace
}  // namespace mt::gpu_test
