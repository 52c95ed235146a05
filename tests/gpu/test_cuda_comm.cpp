// The communicator's NCCL path on GPU buffers, as a one-rank world (run test_cuda_ops
// without a launcher on the GPU machine): every operation goes through NCCL with one
// rank, stream-ordered with the backend's kernels, and must give what the MPI path
// gives on the same call (tests/test_parallel.cpp covers that path on many ranks).
#include "comm/communicator.h"
#include "gpu/gpu_test.h"

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

}  // namespace
}  // namespace mt::gpu_test
