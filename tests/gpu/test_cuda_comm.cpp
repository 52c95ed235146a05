// The communicator's NCCL path on GPU buffers, as a one-rank world (run test_cuda_ops
// without a launcher on the GPU machine): every operation goes through NCCL with one
// rank, stream-ordered with the backend's kernels, and must give what the MPI path
// gives on the same call (tests/test_parallel.cpp covers that path on many ranks).
// Then the parallel layers' GPU paths on that one-rank world: expert parallelism
// (device plan, bf16 transfers) must be the single-GPU dispatch bit for bit, and ring
// attention (merge kernels, fp32 partial sums) the single attention call within bf16
// roundings. Several ranks: tests/gpu/meshes.py trains on 2..8 GPUs.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "comm/communicator.h"
#include "gpu/gpu_test.h"
#include "kernels/attention.h"
#include "kernels/dispatch.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"

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
  parallel::ep_dispatch_forward(ep, plan, x.t, xs.t);
  parallel::ep_combine_forward(ep, plan, ys.t, weight.t, back.t, y.t);
  parallel::ep_combine_backward(ep, plan, back.t, weight.t, dy.t, dys.t, dw.t);
  parallel::ep_dispatch_backward(ep, plan, dxs.t, dx.t);
  EXPECT_TRUE(near("xs", download(xs.t), download(xs_1.t), Tol()));
  EXPECT_TRUE(near("y", download(y.t), download(y_1.t), Tol()));
  EXPECT_TRUE(near("dys", download(dys.t), download(dys_1.t), Tol()));
  EXPECT_TRUE(near("dweight", download(dw.t), download(dw_1.t), Tol()));
  EXPECT_TRUE(near("dx", download(dx.t), download(dx_1.t), Tol()));
}

// Ring attention with one rank holds chunks 0 and 1 of each sequence, the whole of it in
// order, and runs blocks (0,0), (1,0) and (1,1): the merge, the lse slices and the
// fp32 sums against one attention call on the same bf16 inputs. The ring rounds each
// block's output and gradients to bf16 (2^-9 of their size, at most max|v| for an
// output) before its fp32 sums, and its result once more; the single call rounds once.
// The dsinks sums differ only in their f32 order.
// With a window some rows of block (1,0) see no key (lse -inf): the merge skips them.
TEST(CudaParallel, OneRankRingAttentionIsOneAttentionCall) {
  MT_SKIP_WITHOUT_GPU();
  comm::Communicator& cp = comm::world().comm();
  ASSERT_EQ(cp.size(), 1) << "run this test without mpirun: it checks the one-rank world";
  struct Case {
    int64_t b, chunk, hq, hkv, dh, window;
    bool sinks;
  };
  for (Case c : {Case{2, 40, 4, 2, 64, 0, false}, Case{1, 33, 2, 1, 12, 0, true}, Case{2, 24, 4, 4, 128, 20, true}}) {
    SCOPED_TRACE("chunk " + std::to_string(c.chunk) + ", head_dim " + std::to_string(c.dh) + ", window " +
                 std::to_string(c.window));
    const int64_t t = 2 * c.chunk;
    const Shape qs{c.b, t, c.hq, c.dh}, ks{c.b, t, c.hkv, c.dh}, ls{c.b, c.hq, t};
    cpu::AttentionArgs args;
    args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dh)));
    args.window = c.window;
    DeviceTensor q = upload(random_floats(qs.numel(), -2, 2, 100), DType::bf16, qs);
    DeviceTensor k = upload(random_floats(ks.numel(), -2, 2, 101), DType::bf16, ks);
    DeviceTensor v = upload(random_floats(ks.numel(), -1, 1, 102), DType::bf16, ks);
    DeviceTensor dout = upload(random_floats(qs.numel(), -1, 1, 103), DType::bf16, qs);
    DeviceTensor sinks = upload(random_floats(c.hq, -1, 2, 104), DType::f32, {c.hq});
    const Tensor sinks_t = c.sinks ? sinks.t : Tensor();

    DeviceTensor out_1 = poisoned(DType::bf16, qs), lse_1 = poisoned(DType::f32, ls);
    DeviceTensor dq_1 = poisoned(DType::bf16, qs), dk_1 = poisoned(DType::bf16, ks), dv_1 = poisoned(DType::bf16, ks);
    DeviceTensor ds_1 = upload(std::vector<float>(c.hq, 0.0f), DType::f32, {c.hq});
    mt::attention_forward(q.t, k.t, v.t, sinks_t, args, out_1.t, lse_1.t);
    mt::attention_backward(q.t, k.t, v.t, sinks_t, args, out_1.t, lse_1.t, dout.t, dq_1.t, dk_1.t, dv_1.t,
                           c.sinks ? ds_1.t : Tensor());

    DeviceTensor out = poisoned(DType::bf16, qs), lse = poisoned(DType::f32, ls);
    DeviceTensor dq = poisoned(DType::bf16, qs), dk = poisoned(DType::bf16, ks), dv = poisoned(DType::bf16, ks);
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
