// src/comm and src/parallel on several CPU ranks: ctest runs this program alone (a
// world of one, no launcher) and under mpirun with 2 and 4 ranks. Every parallel
// result is compared with the single-rank kernels run on the whole problem, which
// every rank computes for itself from the same seeded inputs.
//
// Under mpirun only rank 0 prints gtest's report; the other ranks print their failed
// assertions prefixed with their rank. A failure on any rank fails the test on all of
// them (the fixture's TearDown), and the exit code is the same everywhere. An
// exception ends its rank at once (and mpirun the job) rather than hang the others.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/dispatch.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "models/expert_replicas.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/placement.h"
#include "parallel/sharding.h"
#include "ep_exchange.h"

namespace mt {
namespace {

comm::Communicator& world_comm() { return comm::world().comm(); }

// Propagates failures: every rank learns which ranks failed and fails too.
class Parallel : public ::testing::Test {
 protected:
  void TearDown() override {
    comm::Communicator& c = world_comm();
    int32_t mine = HasFailure() ? 1 : 0;
    std::vector<int32_t> all(static_cast<size_t>(c.size()));
    c.all_gather(Tensor(&mine, {1}, DType::i32), Tensor(all.data(), {c.size()}, DType::i32));
    std::string ranks;
    for (int p = 0; p < c.size(); ++p)
      if (all[p] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
    if (mine == 0 && !ranks.empty()) ADD_FAILURE() << "failed on rank(s) " << ranks;
  }
};
class Launch : public Parallel {};
class Comm : public Parallel {};
class Mesh : public Parallel {};
class ExpertParallel : public Parallel {};
class ContextParallel : public Parallel {};
class Sharding : public Parallel {};
class ExpertPlacement : public Parallel {};

// The message of the mt::Error that f throws, or "" when it throws none.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<float> uniform(int64_t n, uint64_t stream, float lo, float hi, uint64_t seed = 8) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_uniform(v.data(), n, seed, stream, lo, hi);
  return v;
}

Tensor f32(std::vector<float>& v, Shape s) { return Tensor(v.data(), s, DType::f32); }

// max |got - want| <= tol * max |want|: fp32 rounding relative to the tensor's scale.
void expect_close(const float* got, const float* want, int64_t n, double tol, const std::string& what) {
  double scale = 0, worst = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, tol * std::max(scale, 1e-30))
      << what << ": element " << at << " is " << got[at] << ", expected " << want[at] << " (scale " << scale << ")";
}

// ---- launch -------------------------------------------------------------------------

comm::Launch launch_from(const std::map<std::string, std::string>& env) {
  return comm::detect_launch([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST_F(Launch, ReadsEveryLauncher) {
  comm::Launch none = launch_from({});
  EXPECT_EQ(none.launcher, "none");
  EXPECT_EQ(none.size, 1);
  EXPECT_EQ(none.rank, 0);
  EXPECT_EQ(none.local_rank, 0);

  comm::Launch ompi = launch_from({{"OMPI_COMM_WORLD_RANK", "3"},
                                   {"OMPI_COMM_WORLD_SIZE", "8"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"RANK", "0"},
                                   {"WORLD_SIZE", "2"}});
  EXPECT_EQ(ompi.launcher, "Open MPI");  // the MPI launcher's variables win
  EXPECT_EQ(ompi.rank, 3);
  EXPECT_EQ(ompi.size, 8);
  EXPECT_EQ(ompi.local_rank, 1);

  comm::Launch pmi = launch_from({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}});
  EXPECT_EQ(pmi.launcher, "PMI");
  EXPECT_EQ(pmi.rank, 2);
  EXPECT_EQ(pmi.local_rank, -1);  // unknown: MPI finds it

  // srun inside a batch job: the step's task count, not the job's.
  comm::Launch slurm = launch_from(
      {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(slurm.launcher, "SLURM");
  EXPECT_EQ(slurm.rank, 5);
  EXPECT_EQ(slurm.size, 8);
  EXPECT_EQ(slurm.local_rank, 1);

  comm::Launch torchrun = launch_from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(torchrun.launcher, "torchrun");
  EXPECT_EQ(torchrun.rank, 1);
  EXPECT_EQ(torchrun.size, 2);

  EXPECT_EQ(launch_from({{"RANK", "1"}}).launcher, "none");  // a rank without a size is no launch

  std::string e = error_of([] { launch_from({{"RANK", "4"}, {"WORLD_SIZE", "4"}}); });
  EXPECT_NE(e.find("rank RANK=4 of WORLD_SIZE=4"), std::string::npos) << e;
  e = error_of([] { launch_from({{"PMI_RANK", "one"}, {"PMI_SIZE", "2"}}); });
  EXPECT_NE(e.find("PMI_RANK=one"), std::string::npos) << e;
}

TEST_F(Launch, WorldMatchesTheLauncher) {
  const comm::World& w = comm::world();
  comm::Launch l = comm::detect_launch([](const char* n) -> const char* { return std::getenv(n); });
  EXPECT_EQ(w.size(), l.size);
  EXPECT_EQ(w.rank(), l.rank);
  EXPECT_GE(w.local_rank(), 0);
  EXPECT_EQ(world_comm().size(), w.size());
  EXPECT_EQ(world_comm().rank(), w.rank());
}

TEST_F(Launch, RanksThatShareAGpuAreFoundByBusId) {
  using comm::RankGpu;
  auto decide = [](std::vector<RankGpu> gpus) { return comm::share_gpus(gpus); };
  // One GPU a rank: NCCL, nothing to say.
  comm::GpuSharing g = decide({{"a", 0, "0000:19:00.0"}, {"a", 1, "0000:3b:00.0"}});
  EXPECT_FALSE(g.staged);
  EXPECT_EQ(g.ranks_on_gpu, (std::vector<int>{1, 1}));
  EXPECT_EQ(g.text, "");
  // Four ranks on one GPU.
  g = decide({{"a", 0, "0000:19:00.0"}, {"a", 0, "0000:19:00.0"}, {"a", 0, "0000:19:00.0"}, {"a", 0, "0000:19:00.0"}});
  EXPECT_TRUE(g.staged);
  EXPECT_EQ(g.ranks_on_gpu, (std::vector<int>{4, 4, 4, 4}));
  EXPECT_EQ(g.text, "ranks 0-3 share GPU 0: GPU messages go through host memory and MPI (for testing a mesh; not fast)");
  // Mixed: ranks 0 and 2 share GPU 0, rank 1 is alone on GPU 1; every rank stages.
  g = decide({{"a", 0, "0000:19:00.0"}, {"a", 1, "0000:3b:00.0"}, {"a", 0, "0000:19:00.0"}});
  EXPECT_TRUE(g.staged);
  EXPECT_EQ(g.ranks_on_gpu, (std::vector<int>{2, 1, 2}));
  EXPECT_EQ(g.text, "ranks 0, 2 share GPU 0 (rank 1 alone on a GPU, staged the same way): GPU messages go through "
                    "host memory and MPI (for testing a mesh; not fast)");
  // The same bus id on two hosts is two GPUs; hosts are named once there are several.
  g = decide({{"a", 0, "0000:19:00.0"}, {"b", 0, "0000:19:00.0"}});
  EXPECT_FALSE(g.staged);
  g = decide({{"a", 0, "0000:19:00.0"}, {"a", 0, "0000:19:00.0"}, {"b", 0, "0000:19:00.0"}, {"b", 0, "0000:19:00.0"}});
  EXPECT_EQ(g.ranks_on_gpu, (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(g.text.substr(0, 50), "ranks 0-1 share GPU 0 of a, ranks 2-3 share GPU 0 ");
  // Ranks without a GPU (an empty bus id) share nothing.
  g = decide({{"a", -1, ""}, {"a", -1, ""}});
  EXPECT_FALSE(g.staged);
  EXPECT_EQ(g.ranks_on_gpu, (std::vector<int>{0, 0}));
}

// ---- communicator -------------------------------------------------------------------

TEST_F(Comm, AllReduceSumsEachDtype) {
  comm::Communicator& c = world_comm();
  const int n = c.size(), r = c.rank();
  const int64_t len = 37;
  std::vector<float> xf(len);
  std::vector<uint16_t> xb(len);
  std::vector<int32_t> xi(len);
  std::vector<int64_t> xl(len);
  for (int64_t i = 0; i < len; ++i) {
    xf[i] = 0.25f * static_cast<float>((r + 1) * (i + 1));
    xb[i] = bf16_from_f32(static_cast<float>((r + 1) * (i % 4 + 1)));
    xi[i] = static_cast<int32_t>(1000 * r + i);
    xl[i] = (int64_t{1} << 40) * (r + 1) + i;
  }
  c.all_reduce(Tensor(xf.data(), {len}, DType::f32));
  c.all_reduce(Tensor(xb.data(), {len}, DType::bf16));
  c.all_reduce(Tensor(xi.data(), {len}, DType::i32));
  c.all_reduce(Tensor(xl.data(), {len}, DType::i64));
  const int64_t ranks_sum = int64_t{n} * (n + 1) / 2;  // sum of r + 1
  for (int64_t i = 0; i < len; ++i) {
    EXPECT_EQ(xf[i], 0.25f * static_cast<float>(ranks_sum * (i + 1))) << i;
    EXPECT_EQ(f32_from_bf16(xb[i]), static_cast<float>(ranks_sum * (i % 4 + 1))) << i;
    EXPECT_EQ(xi[i], 1000 * (ranks_sum - n) + n * i) << i;
    EXPECT_EQ(xl[i], (int64_t{1} << 40) * ranks_sum + n * i) << i;
  }
}

TEST_F(Comm, ReduceScatterAndAllGather) {
  comm::Communicator& c = world_comm();
  const int n = c.size(), r = c.rank();
  const int64_t block = 3;
  std::vector<float> in(static_cast<size_t>(n * block)), out(block);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < block; ++i) in[p * block + i] = static_cast<float>(10 * r + p + i);
  c.reduce_scatter(f32(in, {n * block}), f32(out, {block}));
  for (int64_t i = 0; i < block; ++i) EXPECT_EQ(out[i], static_cast<float>(10 * n * (n - 1) / 2 + n * (r + i))) << i;

  std::vector<int64_t> mine = {r, -r}, all(static_cast<size_t>(2 * n));
  c.all_gather(Tensor(mine.data(), {2}, DType::i64), Tensor(all.data(), {2 * n}, DType::i64));
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(all[2 * p], p);
    EXPECT_EQ(all[2 * p + 1], -p);
  }
}

TEST_F(Comm, AllToAllVWithUnevenAndEmptyCounts) {
  comm::Communicator& c = world_comm();
  const int n = c.size(), r = c.rank();
  // Rank a sends (a + b) % 3 elements to rank b (none when that is 0), valued by (a, b, i).
  std::vector<int64_t> send_counts(n), recv_counts(n);
  std::vector<int32_t> in, want;
  for (int p = 0; p < n; ++p) {
    send_counts[p] = (r + p) % 3;
    recv_counts[p] = (p + r) % 3;
    for (int64_t i = 0; i < send_counts[p]; ++i) in.push_back(static_cast<int32_t>(10000 * r + 100 * p + i));
    for (int64_t i = 0; i < recv_counts[p]; ++i) want.push_back(static_cast<int32_t>(10000 * p + 100 * r + i));
  }
  std::vector<int32_t> out(want.size(), -1);
  c.all_to_all_v(Tensor(in.data(), {static_cast<int64_t>(in.size())}, DType::i32), send_counts,
                 Tensor(out.data(), {static_cast<int64_t>(out.size())}, DType::i32), recv_counts);
  EXPECT_EQ(out, want);
}

TEST_F(Comm, PointToPointBlockingAndStarted) {
  comm::Communicator& c = world_comm();
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  // A started ring exchange: two messages each way, matched in posting order.
  std::vector<float> a = {static_cast<float>(r), 0.5f}, b = {static_cast<float>(-r)}, ra(2), rb(1);
  comm::Request req = c.start({comm::send_to(f32(a, {2}), next), comm::send_to(f32(b, {1}), next),
                               comm::recv_from(f32(ra, {2}), prev), comm::recv_from(f32(rb, {1}), prev)});
  req.wait();
  EXPECT_EQ(ra[0], static_cast<float>(prev));
  EXPECT_EQ(ra[1], 0.5f);
  EXPECT_EQ(rb[0], static_cast<float>(-prev));

  // Blocking: a token passed along a chain, each rank adding its number.
  if (n > 1) {
    std::vector<int64_t> token = {0};
    Tensor t(token.data(), {1}, DType::i64);
    if (r > 0) c.recv(t, r - 1);
    token[0] += r;
    if (r + 1 < n) c.send(t, r + 1);
    if (r == n - 1) {
      EXPECT_EQ(token[0], int64_t{n} * (n - 1) / 2);
    }
  }
}

TEST_F(Comm, BroadcastAndBarrier) {
  comm::Communicator& c = world_comm();
  const int root = c.size() - 1;
  std::vector<float> x = {c.rank() == root ? 42.0f : 0.0f, static_cast<float>(c.rank() == root)};
  c.broadcast(f32(x, {2}), root);
  EXPECT_EQ(x[0], 42.0f);
  EXPECT_EQ(x[1], 1.0f);
  c.barrier();
}

TEST_F(Comm, ErrorsNameTheRankTheOperationAndTheSizes) {
  // Every rank makes the same bad call; the argument checks run before any message.
  comm::Communicator& c = world_comm();
  const std::string who = "communicator 'world' (rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size());
  std::vector<uint8_t> bytes(4);
  std::string e = error_of([&] { c.all_reduce(Tensor(bytes.data(), {4}, DType::u8)); });
  EXPECT_NE(e.find("all_reduce on " + who), std::string::npos) << e;
  EXPECT_NE(e.find("u8[4]"), std::string::npos) << e;

  std::vector<float> in(5), out(2);
  e = error_of([&] { c.reduce_scatter(f32(in, {5}), f32(out, {2})); });
  EXPECT_NE(e.find("reduce_scatter on " + who), std::string::npos) << e;
  EXPECT_NE(e.find("f32[5]@cpu into f32[2]@cpu"), std::string::npos) << e;

  std::vector<int64_t> counts(static_cast<size_t>(c.size()), 1);
  e = error_of([&] { c.all_to_all_v(f32(in, {5}), counts, f32(in, {5}), counts); });
  EXPECT_NE(e.find("all_to_all_v on " + who), std::string::npos) << e;
  EXPECT_NE(e.find("add up to " + std::to_string(c.size())), std::string::npos) << e;

  e = error_of([&] { c.start({comm::send_to(f32(in, {5}), c.size())}); });
  EXPECT_NE(e.find("peer " + std::to_string(c.size()) + " is not a rank"), std::string::npos) << e;
  if (c.size() > 1) {
    EXPECT_NE(e.find("on rank " + std::to_string(c.rank())), std::string::npos) << e;
  }
}

// ---- started collectives ---------------------------------------------------------------

// Element i of rank `rank`'s input `salt`: sums of these over up to four ranks are exact
// in every summable dtype (multiples of 1/4 within [-16, 16] for f32 and bf16, integers
// for i32 and i64, beyond 2^32 for i64), so any reduction order gives the same bits and
// the expected results can be computed here.
double exact_value(DType t, int rank, int64_t i, int salt) {
  if (t == DType::i32) return 100000.0 * rank + 7.0 * static_cast<double>(i) - 50 + salt;
  if (t == DType::i64) return std::ldexp(1.0, 40) * (rank + 1) + static_cast<double>(i) + salt;
  return 0.25 * static_cast<double>((rank * 7 + i * 3 + salt) % 9 - 4);
}

// The bytes of a tensor of dtype t holding `values`.
std::vector<uint8_t> encode(DType t, const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(t));
  for (size_t i = 0; i < values.size(); ++i) {
    uint8_t* at = bytes.data() + i * dtype_size(t);
    if (t == DType::f32) {
      const float v = static_cast<float>(values[i]);
      std::memcpy(at, &v, sizeof v);
    } else if (t == DType::bf16) {
      const uint16_t v = bf16_from_f32(static_cast<float>(values[i]));
      std::memcpy(at, &v, sizeof v);
    } else if (t == DType::i32) {
      const int32_t v = static_cast<int32_t>(values[i]);
      std::memcpy(at, &v, sizeof v);
    } else {
      const int64_t v = static_cast<int64_t>(values[i]);
      std::memcpy(at, &v, sizeof v);
    }
  }
  return bytes;
}

Tensor bytes_tensor(std::vector<uint8_t>& b, DType t) {
  return Tensor(b.data(), {static_cast<int64_t>(b.size() / dtype_size(t))}, t);
}

// Every collective of one dtype on one communicator: inputs, the expected outputs, and
// outputs to fill, one set for the blocking calls and one for the started ones.
struct Collectives {
  DType t;
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<uint8_t> reduce, scatter_in, gather_in, a2a_in;  // inputs (reduce: in place)
  std::vector<uint8_t> want_reduce, want_scatter, want_gather, want_a2a;
  std::vector<uint8_t> scatter_out, gather_out, a2a_out;

  Collectives(DType dtype, const comm::Communicator& c) : t(dtype) {
    const int n = c.size(), r = c.rank();
    const int64_t len = 37;
    std::vector<double> in, want;
    auto take = [&](std::vector<uint8_t>& into, std::vector<double>& from) {
      into = encode(t, from);
      from.clear();
    };
    for (int64_t i = 0; i < len; ++i) {
      in.push_back(exact_value(t, r, i, 0));
      double sum = 0;
      for (int p = 0; p < n; ++p) sum += exact_value(t, p, i, 0);
      want.push_back(sum);
    }
    take(reduce, in);
    take(want_reduce, want);
    for (int64_t i = 0; i < n * len; ++i) in.push_back(exact_value(t, r, i, 1));
    for (int64_t i = 0; i < len; ++i) {
      double sum = 0;
      for (int p = 0; p < n; ++p) sum += exact_value(t, p, r * len + i, 1);
      want.push_back(sum);
    }
    take(scatter_in, in);
    take(want_scatter, want);
    for (int64_t i = 0; i < len; ++i) in.push_back(exact_value(t, r, i, 2));
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < len; ++i) want.push_back(exact_value(t, p, i, 2));
    take(gather_in, in);
    take(want_gather, want);
    // Rank a sends (a + b) % 3 elements to rank b (none when that is 0).
    for (int p = 0; p < n; ++p) {
      send_counts.push_back((r + p) % 3);
      recv_counts.push_back((p + r) % 3);
      for (int64_t i = 0; i < send_counts.back(); ++i) in.push_back(exact_value(t, r, 100 * p + i, 3));
      for (int64_t i = 0; i < recv_counts.back(); ++i) want.push_back(exact_value(t, p, 100 * r + i, 3));
    }
    take(a2a_in, in);
    take(want_a2a, want);
  }

  void poison_outputs() {
    scatter_out.assign(want_scatter.size(), 0xa5);
    gather_out.assign(want_gather.size(), 0xa5);
    a2a_out.assign(want_a2a.size(), 0xa5);
  }

  void run_blocking(comm::Communicator& c) {
    poison_outputs();
    c.all_reduce(bytes_tensor(reduce, t));
    c.reduce_scatter(bytes_tensor(scatter_in, t), bytes_tensor(scatter_out, t));
    c.all_gather(bytes_tensor(gather_in, t), bytes_tensor(gather_out, t));
    c.all_to_all_v(bytes_tensor(a2a_in, t), send_counts, bytes_tensor(a2a_out, t), recv_counts);
  }

  // The outputs, in the order of run_blocking.
  std::vector<std::vector<uint8_t>> outputs() const { return {reduce, scatter_out, gather_out, a2a_out}; }
  std::vector<std::vector<uint8_t>> wanted() const { return {want_reduce, want_scatter, want_gather, want_a2a}; }
};

TEST_F(Comm, StartedCollectivesEqualTheBlockingOnesWhileOtherWorkRuns) {
  comm::Communicator& c = world_comm();
  comm::Communicator parity = c.split(c.rank() % 2, c.rank(), "parity");
  const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all_v"};
  for (DType t : {DType::f32, DType::bf16, DType::i32, DType::i64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Collectives blocking(t, c);
    blocking.run_blocking(c);
    const std::vector<std::vector<uint8_t>> want = blocking.wanted(), got_blocking = blocking.outputs();
    for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(got_blocking[k], want[k]) << names[k] << ", blocking";

    // The same calls started, all in flight at once together with a collective started
    // on another communicator, while this rank computes and runs a blocking collective
    // on that other communicator; the same order of starts on every rank, the waits in
    // a different order on odd and even ranks.
    Collectives started(t, c), aside(t, parity);
    started.poison_outputs();
    aside.poison_outputs();
    std::vector<comm::Request> requests;
    requests.push_back(c.start_all_reduce(bytes_tensor(started.reduce, t), comm::Traffic::gradient));
    requests.push_back(parity.start_all_gather(bytes_tensor(aside.gather_in, t), bytes_tensor(aside.gather_out, t),
                                               comm::Traffic::gather));
    double host_work = 0;
    for (int i = 1; i < 200000; ++i) host_work += 1.0 / i;
    EXPECT_GT(host_work, 12.0);
    parity.all_reduce(bytes_tensor(aside.reduce, t));
    requests.push_back(c.start_reduce_scatter(bytes_tensor(started.scatter_in, t), bytes_tensor(started.scatter_out, t),
                                              comm::Traffic::gradient));
    requests.push_back(c.start_all_gather(bytes_tensor(started.gather_in, t), bytes_tensor(started.gather_out, t),
                                          comm::Traffic::gather));
    {
      // The Request keeps its own counts: these are spoiled and gone before it completes.
      std::vector<int64_t> send_counts = started.send_counts, recv_counts = started.recv_counts;
      requests.push_back(c.start_all_to_all_v(bytes_tensor(started.a2a_in, t), send_counts,
                                              bytes_tensor(started.a2a_out, t), recv_counts, comm::Traffic::expert));
      std::fill(send_counts.begin(), send_counts.end(), -7);
      std::fill(recv_counts.begin(), recv_counts.end(), -7);
    }
    if (c.rank() % 2 == 1) std::reverse(requests.begin(), requests.end());
    for (comm::Request& r : requests) r.wait();

    const std::vector<std::vector<uint8_t>> got = started.outputs();
    for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(got[k], got_blocking[k]) << names[k] << ", started";
    EXPECT_EQ(aside.reduce, aside.want_reduce) << "all_reduce on the other communicator";
    EXPECT_EQ(aside.gather_out, aside.want_gather) << "all_gather started on the other communicator";
  }
}

TEST_F(Comm, HostStagingGivesTheDirectPathsResults) {
  // What ranks that share a GPU do with GPU tensors (comm/communicator.h), here with host
  // tensors (Staging::every_tensor): copied into a staging block at the start, moved by
  // MPI there, copied back at the wait. Split communicators stage as their parent does.
  comm::Communicator& c = world_comm();
  comm::Communicator staged = c.split(0, c.rank(), "staged");
  staged.set_staging(comm::Staging::every_tensor);
  comm::Communicator parity = staged.split(c.rank() % 2, c.rank(), "staged_parity");
  EXPECT_EQ(parity.staging(), comm::Staging::every_tensor);
  EXPECT_EQ(c.staging(), comm::Staging::none);
  for (DType t : {DType::f32, DType::bf16, DType::i32, DType::i64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Collectives blocking(t, staged);
    blocking.run_blocking(staged);
    EXPECT_EQ(blocking.outputs(), blocking.wanted());

    // Started together with one on another staged communicator, waited in another order
    // on odd ranks. Outputs stay as they were until the waits copy the results back.
    Collectives started(t, staged), aside(t, parity);
    started.poison_outputs();
    aside.poison_outputs();
    const std::vector<uint8_t> poisoned = started.gather_out, reduce_before = started.reduce;
    std::vector<comm::Request> requests;
    requests.push_back(staged.start_all_reduce(bytes_tensor(started.reduce, t), comm::Traffic::gradient));
    requests.push_back(parity.start_all_gather(bytes_tensor(aside.gather_in, t), bytes_tensor(aside.gather_out, t),
                                               comm::Traffic::gather));
    requests.push_back(staged.start_reduce_scatter(bytes_tensor(started.scatter_in, t),
                                                   bytes_tensor(started.scatter_out, t), comm::Traffic::gradient));
    requests.push_back(staged.start_all_gather(bytes_tensor(started.gather_in, t),
                                               bytes_tensor(started.gather_out, t), comm::Traffic::gather));
    requests.push_back(staged.start_all_to_all_v(bytes_tensor(started.a2a_in, t), started.send_counts,
                                                 bytes_tensor(started.a2a_out, t), started.recv_counts,
                                                 comm::Traffic::expert));
    EXPECT_EQ(started.gather_out, poisoned) << "written before its wait";
    EXPECT_EQ(started.reduce, reduce_before) << "summed in place before its wait";
    if (c.rank() % 2 == 1) std::reverse(requests.begin(), requests.end());
    for (comm::Request& r : requests) r.wait();
    EXPECT_EQ(started.outputs(), started.wanted());
    EXPECT_EQ(aside.gather_out, aside.want_gather);
  }

  // A batch's messages keep their order through the staging: two each way round a ring,
  // sends and receives interleaved, one of them empty.
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> a = {static_cast<float>(r), 0.5f, 2.0f}, b = {static_cast<float>(-r)}, none;
  std::vector<float> ra(3, -1.0f), rb(1, -1.0f), rnone;
  staged
      .start({comm::send_to(f32(a, {3}), next), comm::recv_from(f32(ra, {3}), prev),
              comm::send_to(f32(none, {0}), next), comm::send_to(f32(b, {1}), next),
              comm::recv_from(f32(rnone, {0}), prev), comm::recv_from(f32(rb, {1}), prev)})
      .wait();
  EXPECT_EQ(ra, (std::vector<float>{static_cast<float>(prev), 0.5f, 2.0f}));
  EXPECT_EQ(rb[0], static_cast<float>(-prev));

  const int root = n - 1;
  std::vector<int64_t> x = {r == root ? 42 : 0, r};
  staged.broadcast(Tensor(x.data(), {2}, DType::i64), root);
  EXPECT_EQ(x, (std::vector<int64_t>{42, root}));
  EXPECT_EQ(comm::broadcast_text(staged, r == 0 ? "from rank 0" : "", 0), "from rank 0");
}

TEST_F(Comm, StartedCollectivesCheckTheirArgumentsBeforeStarting) {
  // Every rank makes the same bad calls; each fails at its start, and since none of them
  // started anything, a collective after them pairs up as usual.
  comm::Communicator& c = world_comm();
  const int n = c.size();
  const std::string who = "communicator 'world' (rank " + std::to_string(c.rank()) + " of " + std::to_string(n) + ")";
  std::vector<uint8_t> bytes(4);
  std::string e = error_of([&] { c.start_all_reduce(Tensor(bytes.data(), {4}, DType::u8), comm::Traffic::gradient); });
  EXPECT_NE(e.find("all_reduce on " + who + " of u8[4]@cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("sums are for f32, bf16, i32 and i64"), std::string::npos) << e;

  std::vector<float> in(5), out(2);
  e = error_of([&] { c.start_reduce_scatter(f32(in, {5}), f32(out, {2}), comm::Traffic::gradient); });
  EXPECT_NE(e.find("reduce_scatter on " + who + " of f32[5]@cpu into f32[2]@cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("should hold " + std::to_string(n) + " blocks"), std::string::npos) << e;

  e = error_of([&] { c.start_all_gather(f32(out, {2}), f32(in, {5}), comm::Traffic::gather); });
  EXPECT_NE(e.find("all_gather on " + who + " of f32[2]@cpu into f32[5]@cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("should hold " + std::to_string(n) + " blocks"), std::string::npos) << e;

  std::vector<int64_t> too_many(static_cast<size_t>(n) + 1, 0), ones(static_cast<size_t>(n), 1);
  e = error_of([&] { c.start_all_to_all_v(f32(in, {5}), too_many, f32(in, {5}), too_many, comm::Traffic::expert); });
  EXPECT_NE(e.find("all_to_all_v on " + who), std::string::npos) << e;
  EXPECT_NE(e.find("one send and one receive count per rank (" + std::to_string(n) + "), got " +
                   std::to_string(n + 1) + " and " + std::to_string(n + 1)),
            std::string::npos)
      << e;
  std::vector<int32_t> ints(static_cast<size_t>(n));
  e = error_of([&] {
    c.start_all_to_all_v(f32(in, {n}), ones, Tensor(ints.data(), {n}, DType::i32), ones, comm::Traffic::expert);
  });
  EXPECT_NE(e.find("differ in dtype or device"), std::string::npos) << e;
  if (n == 1) {
    std::vector<int64_t> two = {2}, three = {3};
    std::vector<float> a(2), b(3);
    e = error_of([&] { c.start_all_to_all_v(f32(a, {2}), two, f32(b, {3}), three, comm::Traffic::expert); });
    EXPECT_NE(e.find("sends 2 elements to itself but expects 3"), std::string::npos) << e;
  }

  std::vector<int32_t> rank = {c.rank()};
  c.start_all_reduce(Tensor(rank.data(), {1}, DType::i32), comm::Traffic::gradient).wait();
  EXPECT_EQ(rank[0], n * (n - 1) / 2);
}

// ---- mesh ---------------------------------------------------------------------------

// The world rank of a mesh coordinate: the layout formula, pp outermost and ep innermost.
int mesh_rank(const comm::MeshShape& s, const comm::MeshCoord& c) {
  return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.ep + c.ep;
}

// The world ranks of the group of `axes` (bits pp=8, dp=4, cp=2, ep=1) that `rank` is
// in, in the group's rank order, enumerated from the layout formula.
std::vector<int64_t> group_members(const comm::MeshShape& s, int rank, int axes) {
  const comm::MeshCoord me = comm::mesh_coord(s, rank);
  std::vector<int64_t> m;
  for (int pp = 0; pp < s.pp; ++pp)
    for (int dp = 0; dp < s.dp; ++dp)
      for (int cp = 0; cp < s.cp; ++cp)
        for (int ep = 0; ep < s.ep; ++ep) {
          comm::MeshCoord c{pp, dp, cp, ep};
          if ((!(axes & 8) && c.pp != me.pp) || (!(axes & 4) && c.dp != me.dp) || (!(axes & 2) && c.cp != me.cp) ||
              (!(axes & 1) && c.ep != me.ep))
            continue;
          m.push_back(mesh_rank(s, c));
        }
  return m;
}

TEST_F(Mesh, EveryShapeLaysRanksOutAndGroupsThem) {
  comm::Communicator& w = world_comm();
  const int n = w.size();
  int meshes = 0;
  for (int pp = 1; pp <= n; ++pp)
    for (int cp = 1; cp <= n; ++cp)
      for (int ep = 1; ep <= n; ++ep) {
        if (n % (pp * cp * ep) != 0) continue;
        comm::DeviceMesh mesh(w, pp, cp, ep);
        ++meshes;
        const comm::MeshShape& s = mesh.shape();
        const std::string name = mesh.str();
        EXPECT_EQ(s.dp, n / (pp * cp * ep)) << name;
        const comm::MeshCoord& c = mesh.coord();
        EXPECT_EQ(((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.ep + c.ep, w.rank()) << name;
        const std::pair<comm::Communicator*, int> groups[] = {
            {&mesh.pp(), 8},    {&mesh.dp(), 4},        {&mesh.cp(), 2},       {&mesh.ep(), 1},
            {&mesh.dp_cp(), 6}, {&mesh.dp_cp_ep(), 7}, {&mesh.pp_ep(), 9}};
        for (const auto& [g, axes] : groups) {
          std::vector<int64_t> want = group_members(s, w.rank(), axes);
          std::vector<int64_t> got(static_cast<size_t>(g->size()));
          int64_t me = w.rank();
          g->all_gather(Tensor(&me, {1}, DType::i64), Tensor(got.data(), {g->size()}, DType::i64));
          EXPECT_EQ(got, want) << name << ", group '" << g->name() << "'";
        }
        EXPECT_EQ(mesh.ep().rank(), c.ep) << name;
        EXPECT_EQ(mesh.cp().rank(), c.cp) << name;
        EXPECT_EQ(mesh.dp_cp().rank(), c.dp * s.cp + c.cp) << name;
      }
  EXPECT_EQ(meshes, n == 4 ? 10 : n == 2 ? 4 : 1);
}

TEST_F(Mesh, AWorldThatDoesNotDivideIsAnErrorNamingTheNumbers) {
  std::string e = error_of([] { comm::mesh_shape(4, 1, 3, 1); });
  EXPECT_NE(e.find("world of 4 ranks does not divide into pp 1 x cp 3 x ep 1 = 3"), std::string::npos) << e;
  e = error_of([] { comm::mesh_shape(8, 1, 0, 2); });
  EXPECT_NE(e.find("cp 0"), std::string::npos) << e;
  // Degrees whose product overflows int (it divided by zero), and an empty world.
  e = error_of([] { comm::mesh_shape(8, 65536, 65536, 1); });
  EXPECT_NE(e.find("= 4294967296 (dp"), std::string::npos) << e;
  e = error_of([] { comm::mesh_shape(0, 1, 1, 1); });
  EXPECT_NE(e.find("at least one rank, got 0"), std::string::npos) << e;
  comm::MeshShape s = comm::mesh_shape(24, 2, 3, 2);
  EXPECT_EQ(s.dp, 2);
  EXPECT_EQ(mesh_rank(s, comm::mesh_coord(s, 17)), 17);
  // A mesh larger than the world fails on every rank alike, before any split.
  const int n = world_comm().size();
  e = error_of([&] { comm::DeviceMesh m(world_comm(), 1, 1, 2 * n); });
  EXPECT_NE(e.find("does not divide"), std::string::npos) << e;
}

// ---- expert parallelism -------------------------------------------------------------

enum class Routing { random, skewed, skip_experts, all_to_rank0 };

struct EpCase {
  const char* name;
  int64_t experts, top_k, d, d_out;
  Routing routing;
  bool empty_rank1;  // rank 1 routes no tokens at all
};

// Tokens of ep rank r: N_r of them, rank after rank, so the global batch is ranks'
// tokens in rank order.
int64_t tokens_of(const EpCase& c, int r) { return c.empty_rank1 && r == 1 ? 0 : 5 + 3 * r; }

// k distinct experts per token, in a random order: the best k of random keys over the
// allowed experts. Skewed: four tokens in five prefer the last rank's experts.
std::vector<int32_t> route(const EpCase& c, int64_t tokens, int ep, uint64_t seed) {
  const int64_t e_count = c.experts, k = c.top_k, per = e_count / ep;
  std::vector<float> keys = uniform(tokens * e_count, 1, 0.0f, 1.0f, seed);
  std::vector<float> bias = uniform(tokens, 6, 0.0f, 1.0f, seed);
  std::vector<int32_t> idx(static_cast<size_t>(tokens * k));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> allowed;
    for (int32_t e = 0; e < e_count; ++e) {
      if (c.routing == Routing::skip_experts && e % 3 == 1) continue;
      if (c.routing == Routing::all_to_rank0 && e >= per) continue;
      if (c.routing == Routing::skewed && bias[t] < 0.8f && e >= (ep - 1) * per) keys[t * e_count + e] += 1.0f;
      allowed.push_back(e);
    }
    std::sort(allowed.begin(), allowed.end(),
              [&](int32_t a, int32_t b) { return keys[t * e_count + a] > keys[t * e_count + b]; });
    for (int64_t j = 0; j < k; ++j) idx[t * k + j] = allowed[j];
  }
  return idx;
}

const EpCase kEpCases[] = {
    {"random top-2 of 8", 8, 2, 6, 5, Routing::random, false},
    {"skewed to the last rank", 8, 3, 5, 4, Routing::skewed, false},
    {"empty experts", 12, 3, 4, 4, Routing::skip_experts, false},
    {"all tokens to rank 0's experts", 8, 2, 5, 3, Routing::all_to_rank0, false},
    {"a rank with no tokens", 8, 2, 4, 6, Routing::random, true},
    {"k = E", 4, 4, 3, 5, Routing::random, false},
    {"k > experts per rank", 8, 5, 4, 4, Routing::random, false},
};

// Capacities that drop slots in these cases (and none).
const int64_t kEpCapacities[] = {0, 1, 3};

std::vector<int32_t> ints(const Tensor& t) {
  EXPECT_EQ(t.dtype, DType::i32) << t.str();
  return std::vector<int32_t>(t.i32(), t.i32() + t.numel());
}

// What the plan should hold, from plain loops over every rank's routing (idx_of[q] is
// rank q's [N_q, k]), written for this test independently of the kernels.
struct RefPlan {
  std::vector<int64_t> sent_rows_to, slots_to, recv_rows_from, slots_from;
  int64_t dropped = 0;
  std::vector<int32_t> sent_slot, token_rows, slot_row, expert_counts, order, local_slot_row, return_row,
      return_pos, offsets;
};

RefPlan reference_ep_plan(const std::vector<std::vector<int32_t>>& idx_of, int64_t k, int64_t experts, int me,
                          int64_t capacity) {
  const int ranks = static_cast<int>(idx_of.size());
  const int64_t per = experts / ranks;
  // Each expert keeps the first `capacity` slots in (rank, token, slot) order.
  std::vector<std::vector<bool>> kept(ranks);
  std::vector<int64_t> taken(static_cast<size_t>(experts), 0);
  for (int q = 0; q < ranks; ++q)
    for (int32_t e : idx_of[q]) kept[q].push_back(capacity == 0 || taken[e]++ < capacity);
  // Rank q's rows (destination, token, the token's first slot to it), by destination.
  auto rows_of = [&](int q) {
    std::vector<std::array<int64_t, 3>> rows;
    const int64_t n = static_cast<int64_t>(idx_of[q].size()) / k;
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < k; ++j)
          if (idx_of[q][t * k + j] / per == r) {
            rows.push_back({r, t, j});
            break;
          }
    return rows;
  };

  RefPlan p;
  const std::vector<int32_t>& mine = idx_of[me];
  const int64_t slots = static_cast<int64_t>(mine.size());
  p.sent_rows_to.assign(ranks, 0);
  p.slots_to.assign(ranks, 0);
  p.token_rows.assign(slots, -1);
  for (const auto& [r, t, j] : rows_of(me)) {
    ++p.sent_rows_to[r];
    p.token_rows[t * k + j] = static_cast<int32_t>(p.sent_slot.size());
    p.sent_slot.push_back(static_cast<int32_t>(t * k + j));
  }
  // `back`: the kept slots by expert, then token and slot.
  p.slot_row.assign(slots, -1);
  p.expert_counts.assign(experts, 0);
  int32_t next = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t s = 0; s < slots; ++s)
      if (mine[s] == e && kept[me][s]) {
        p.slot_row[s] = next++;
        ++p.expert_counts[e];
        ++p.slots_to[e / per];
      }
  p.dropped = slots - next;

  // Received rows in source rank order: their slots as (source, local expert or -1, kept).
  struct Slot {
    int q;
    int64_t local;
    bool kept;
  };
  std::vector<Slot> recv;
  p.recv_rows_from.assign(ranks, 0);
  for (int q = 0; q < ranks; ++q)
    for (const auto& [r, t, j0] : rows_of(q)) {
      if (r != me) continue;
      ++p.recv_rows_from[q];
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = idx_of[q][t * k + j];
        recv.push_back({q, e / per == me ? e - me * per : -1, kept[q][t * k + j]});
      }
    }
  p.local_slot_row.assign(recv.size(), -1);
  p.offsets = {0};
  for (int64_t e = 0; e < per; ++e) {
    for (size_t s = 0; s < recv.size(); ++s)
      if (recv[s].local == e && recv[s].kept) {
        p.local_slot_row[s] = static_cast<int32_t>(p.order.size());
        p.order.push_back(static_cast<int32_t>(s));
      }
    p.offsets.push_back(static_cast<int32_t>(p.order.size()));
  }
  // The outputs go back by source rank, each source's in xs order.
  p.slots_from.assign(ranks, 0);
  p.return_pos.assign(p.order.size(), -1);
  for (int q = 0; q < ranks; ++q)
    for (size_t r = 0; r < p.order.size(); ++r)
      if (recv[p.order[r]].q == q) {
        p.return_pos[r] = static_cast<int32_t>(p.return_row.size());
        p.return_row.push_back(static_cast<int32_t>(r));
        ++p.slots_from[q];
      }
  return p;
}

void expect_plan_is(const parallel::EpPlan& got, const RefPlan& want) {
  EXPECT_EQ(got.sent_rows_to, want.sent_rows_to);
  EXPECT_EQ(got.slots_to, want.slots_to);
  EXPECT_EQ(got.recv_rows_from, want.recv_rows_from);
  EXPECT_EQ(got.slots_from, want.slots_from);
  EXPECT_EQ(got.dropped, want.dropped);
  EXPECT_EQ(ints(got.sent_slot), want.sent_slot);
  EXPECT_EQ(ints(got.token_rows), want.token_rows);
  EXPECT_EQ(ints(got.slot_row), want.slot_row);
  EXPECT_EQ(ints(got.expert_counts), want.expert_counts);
  EXPECT_EQ(ints(got.order), want.order);
  EXPECT_EQ(ints(got.local_slot_row), want.local_slot_row);
  EXPECT_EQ(ints(got.return_row), want.return_row);
  EXPECT_EQ(ints(got.return_pos), want.return_pos);
  EXPECT_EQ(ints(got.offsets), want.offsets);
}

void run_ep_plan_case(const EpCase& c, int64_t capacity, comm::Communicator& ep, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + ", capacity " + std::to_string(capacity) + " on '" + ep.name() + "' of " +
               std::to_string(ep.size()));
  std::vector<std::vector<int32_t>> idx_of;
  for (int r = 0; r < ep.size(); ++r) idx_of.push_back(route(c, tokens_of(c, r), ep.size(), seed + r));
  std::vector<int32_t>& mine = idx_of[ep.rank()];
  const int64_t n = tokens_of(c, ep.rank());
  parallel::EpPlan plan = parallel::ep_plan(ep, Tensor(mine.data(), {n, c.top_k}, DType::i32), c.experts, capacity);
  EXPECT_EQ(plan.device, Device::cpu);
  expect_plan_is(plan, reference_ep_plan(idx_of, c.top_k, c.experts, ep.rank(), capacity));
}

void run_ep_case(const EpCase& c, int64_t capacity, comm::Communicator& ep, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + ", capacity " + std::to_string(capacity) + " on '" + ep.name() + "' of " +
               std::to_string(ep.size()));
  const int n_ranks = ep.size(), me = ep.rank();
  const int64_t E = c.experts, k = c.top_k, D = c.d, Do = c.d_out, per = E / n_ranks;
  int64_t G = 0, first_token = 0;
  for (int r = 0; r < n_ranks; ++r) {
    if (r == me) first_token = G;
    G += tokens_of(c, r);
  }
  const int64_t N = tokens_of(c, me);

  // The whole problem, identical on every rank.
  std::vector<float> x = uniform(G * D, 2, -1, 1, seed), weight = uniform(G * k, 3, 0.1f, 1, seed);
  std::vector<float> w = uniform(E * Do * D, 4, -0.5f, 0.5f, seed), dy = uniform(G * Do, 5, -1, 1, seed);
  std::vector<int32_t> idx = route(c, G, n_ranks, seed);

  // Single rank: dispatch (with the same capacity over the whole batch), one grouped
  // GEMM, combine, and their backwards.
  std::vector<int32_t> counts(E), offsets(E + 1), order(G * k), slot_row(G * k);
  cpu::dispatch_plan(Tensor(idx.data(), {G, k}, DType::i32), E, capacity, Tensor(counts.data(), {E}, DType::i32),
                     Tensor(offsets.data(), {E + 1}, DType::i32), Tensor(order.data(), {G * k}, DType::i32),
                     Tensor(slot_row.data(), {G * k}, DType::i32));
  const int64_t Rg = offsets[E];
  const Tensor off_g(offsets.data(), {E + 1}, DType::i32), sr_g(slot_row.data(), {G * k}, DType::i32);
  std::vector<float> xs_g(Rg * D), ys_g(Rg * Do), y_g(G * Do), dys_g(Rg * Do), dweight_g(G * k);
  std::vector<float> dxs_g(Rg * D), dx_g(G * D), dw_g(E * Do * D);
  cpu::dispatch_forward(f32(x, {G, D}), Tensor(order.data(), {Rg}, DType::i32), k, f32(xs_g, {Rg, D}));
  cpu::grouped_gemm(f32(xs_g, {Rg, D}), f32(w, {E, Do, D}), Tensor(), off_g, f32(ys_g, {Rg, Do}));
  cpu::combine_forward(f32(ys_g, {Rg, Do}), f32(weight, {G, k}), sr_g, f32(y_g, {G, Do}));
  cpu::combine_backward(f32(ys_g, {Rg, Do}), f32(weight, {G, k}), sr_g, f32(dy, {G, Do}), f32(dys_g, {Rg, Do}),
                        f32(dweight_g, {G, k}));
  cpu::grouped_gemm_backward_input(f32(dys_g, {Rg, Do}), f32(w, {E, Do, D}), off_g, f32(dxs_g, {Rg, D}));
  cpu::grouped_gemm_backward_weight(f32(xs_g, {Rg, D}), f32(dys_g, {Rg, Do}), off_g, f32(dw_g, {E, Do, D}),
                                    Tensor(), false);
  cpu::dispatch_backward(f32(dxs_g, {Rg, D}), sr_g, f32(dx_g, {G, D}));

  // This rank: its tokens, its experts' weights.
  const Tensor x_r(x.data() + first_token * D, {N, D}, DType::f32);
  const Tensor idx_r(idx.data() + first_token * k, {N, k}, DType::i32);
  const Tensor weight_r(weight.data() + first_token * k, {N, k}, DType::f32);
  const Tensor dy_r(dy.data() + first_token * Do, {N, Do}, DType::f32);
  const Tensor w_r(w.data() + me * per * Do * D, {per, Do, D}, DType::f32);
  parallel::EpPlan plan = parallel::ep_plan(ep, idx_r, E, capacity);
  const int64_t R = plan.local_rows(), B = plan.returned_rows();
  std::vector<float> xs(R * D), ys(R * Do), back(B * Do), y(N * Do), dys(R * Do), dweight(N * k), dxs(R * D);
  std::vector<float> dx(N * D), dw(per * Do * D);
  const Tensor off = plan.offsets;
  test::ep_dispatch_forward(ep, plan, x_r, f32(xs, {R, D}));
  cpu::grouped_gemm(f32(xs, {R, D}), w_r, Tensor(), off, f32(ys, {R, Do}));
  test::ep_combine_forward(ep, plan, f32(ys, {R, Do}), weight_r, f32(back, {B, Do}), f32(y, {N, Do}));
  test::ep_combine_backward(ep, plan, f32(back, {B, Do}), weight_r, dy_r, f32(dys, {R, Do}),
                                f32(dweight, {N, k}));
  cpu::grouped_gemm_backward_input(f32(dys, {R, Do}), w_r, off, f32(dxs, {R, D}));
  cpu::grouped_gemm_backward_weight(f32(xs, {R, D}), f32(dys, {R, Do}), off, f32(dw, {per, Do, D}), Tensor(), false);
  test::ep_dispatch_backward(ep, plan, f32(dxs, {R, D}), f32(dx, {N, D}));

  const double tol = 1e-6;
  expect_close(y.data(), y_g.data() + first_token * Do, N * Do, tol, "y");
  expect_close(dx.data(), dx_g.data() + first_token * D, N * D, tol, "dx");
  expect_close(dweight.data(), dweight_g.data() + first_token * k, N * k, tol, "dweight");
  expect_close(dw.data(), dw_g.data() + me * per * Do * D, per * Do * D, tol, "dW of the local experts");

  // Rows per local expert are the single-rank ones, and each token went once to each
  // rank owning any of its experts.
  const std::vector<int32_t> local_offsets = ints(plan.offsets);
  for (int64_t e = 0; e < per; ++e)
    EXPECT_EQ(local_offsets[e + 1] - local_offsets[e], counts[me * per + e]) << "expert " << e;
  int64_t pairs = 0;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<bool> hit(static_cast<size_t>(n_ranks), false);
    for (int64_t j = 0; j < k; ++j) hit[idx_r.i32()[t * k + j] / per] = true;
    pairs += std::count(hit.begin(), hit.end(), true);
  }
  EXPECT_EQ(plan.sent_rows(), pairs);
  // The slots of this rank's tokens each expert kept (the metrics' expert_counts), and
  // the dropped ones, are the single-rank plan's for these tokens.
  std::vector<int32_t> mine(static_cast<size_t>(E), 0);
  int64_t dropped = 0;
  for (int64_t s = first_token * k; s < (first_token + N) * k; ++s) {
    if (slot_row[s] >= 0) ++mine[idx[s]];
    dropped += slot_row[s] < 0 ? 1 : 0;
  }
  EXPECT_EQ(ints(plan.expert_counts), mine);
  EXPECT_EQ(plan.dropped, dropped);
}

TEST_F(ExpertParallel, MatchesSingleRankForwardAndBackward) {
  for (const EpCase& c : kEpCases)
    for (int64_t capacity : kEpCapacities) run_ep_case(c, capacity, world_comm(), 11);
  // On four ranks, also two ep groups of two (dp 2) working on different batches.
  if (world_comm().size() == 4) {
    comm::DeviceMesh mesh(world_comm(), 1, 1, 2);
    for (const EpCase& c : kEpCases)
      for (int64_t capacity : kEpCapacities) run_ep_case(c, capacity, mesh.ep(), 20 + mesh.coord().dp);
  }
}

TEST_F(ExpertParallel, PlanMatchesTheHostReference) {
  for (const EpCase& c : kEpCases)
    for (int64_t capacity : kEpCapacities) run_ep_plan_case(c, capacity, world_comm(), 31);
  if (world_comm().size() == 4) {
    comm::DeviceMesh mesh(world_comm(), 1, 1, 2);
    for (const EpCase& c : kEpCases)
      for (int64_t capacity : kEpCapacities) run_ep_plan_case(c, capacity, mesh.ep(), 40 + mesh.coord().dp);
  }
}

// Two micro-batches' exchanges started, then other collectives and compute, then
// finished (in the other order): every result bit for bit the one-call functions'.
TEST_F(ExpertParallel, HalvesSeparatedByOtherWorkMatchOneCall) {
  comm::Communicator& ep = world_comm();
  const int me = ep.rank();
  struct Batch {
    EpCase c;
    int64_t capacity;
    std::vector<int32_t> idx;
    std::vector<float> x, ys, weight, dy, dxs;
    parallel::EpPlan plan;
    int64_t n = 0, r = 0, b = 0;
    std::vector<float> want;  // the one-call functions' outputs, end to end
  };
  std::vector<Batch> batches(2);
  batches[0].c = kEpCases[0];
  batches[1].c = kEpCases[1];
  batches[1].capacity = 1;
  for (size_t i = 0; i < batches.size(); ++i) {
    Batch& m = batches[i];
    const uint64_t seed = 50 + i + 10 * me;
    m.n = tokens_of(m.c, me);
    m.idx = route(m.c, m.n, ep.size(), seed);
    m.plan = parallel::ep_plan(ep, Tensor(m.idx.data(), {m.n, m.c.top_k}, DType::i32), m.c.experts, m.capacity);
    m.r = m.plan.local_rows();
    m.b = m.plan.returned_rows();
    const int64_t d = m.c.d, k = m.c.top_k;
    m.x = uniform(m.n * d, 2, -1, 1, seed);
    m.ys = uniform(m.r * d, 3, -1, 1, seed);
    m.weight = uniform(m.n * k, 4, 0.1f, 1, seed);
    m.dy = uniform(m.n * d, 5, -1, 1, seed);
    m.dxs = uniform(m.r * d, 6, -1, 1, seed);
  }
  // Work between the halves: a collective on the same communicator and a product.
  auto other_work = [&] {
    std::vector<float> v = uniform(64, 7, -1, 1, 3), a = uniform(48, 8, -1, 1, 3), out(36);
    ep.all_reduce(f32(v, {64}));
    cpu::gemm(f32(a, {6, 8}), f32(a, {6, 8}), f32(out, {6, 6}), false, true);
  };
  for (Batch& m : batches) {
    const int64_t d = m.c.d, n = m.n, r = m.r, bk = m.b, k = m.c.top_k;
    std::vector<float> xs(r * d), back(bk * d), y(n * d), dys(r * d), dw(n * k), dx(n * d);
    test::ep_dispatch_forward(ep, m.plan, f32(m.x, {n, d}), f32(xs, {r, d}));
    test::ep_combine_forward(ep, m.plan, f32(m.ys, {r, d}), f32(m.weight, {n, k}), f32(back, {bk, d}),
                                 f32(y, {n, d}));
    test::ep_combine_backward(ep, m.plan, f32(back, {bk, d}), f32(m.weight, {n, k}), f32(m.dy, {n, d}),
                                  f32(dys, {r, d}), f32(dw, {n, k}));
    test::ep_dispatch_backward(ep, m.plan, f32(m.dxs, {r, d}), f32(dx, {n, d}));
    for (const auto* v : {&xs, &back, &y, &dys, &dw, &dx}) m.want.insert(m.want.end(), v->begin(), v->end());
  }
  struct Out {
    std::vector<float> xs, back, y, dys, dw, dx;
  };
  std::vector<Out> outs(batches.size());
  std::vector<parallel::EpExchange> ex(batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    Batch& m = batches[i];
    Out& o = outs[i];
    o.xs.resize(m.r * m.c.d);
    o.back.resize(m.b * m.c.d);
    o.y.resize(m.n * m.c.d);
    o.dys.resize(m.r * m.c.d);
    o.dw.resize(m.n * m.c.top_k);
    o.dx.resize(m.n * m.c.d);
  }
  auto each = [&](const std::function<void(Batch&, Out&, parallel::EpExchange&)>& f, bool reverse) {
    for (size_t j = 0; j < batches.size(); ++j) {
      const size_t i = reverse ? batches.size() - 1 - j : j;
      f(batches[i], outs[i], ex[i]);
    }
  };
  each([&](Batch& m, Out&, parallel::EpExchange& e) {
    e = parallel::ep_dispatch_forward_start(ep, m.plan, f32(m.x, {m.n, m.c.d}));
  }, false);
  other_work();
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    EXPECT_TRUE(e.in_flight());
    parallel::ep_dispatch_forward_finish(e, m.plan, f32(o.xs, {m.r, m.c.d}));
    EXPECT_FALSE(e.in_flight());
  }, true);
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    e = parallel::ep_combine_forward_start(ep, m.plan, f32(m.ys, {m.r, m.c.d}), f32(o.back, {m.b, m.c.d}));
  }, false);
  other_work();
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    parallel::ep_combine_forward_finish(e, m.plan, f32(m.weight, {m.n, m.c.top_k}), f32(o.y, {m.n, m.c.d}));
  }, true);
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    e = parallel::ep_combine_backward_start(ep, m.plan, f32(o.back, {m.b, m.c.d}), f32(m.weight, {m.n, m.c.top_k}),
                                            f32(m.dy, {m.n, m.c.d}), f32(o.dw, {m.n, m.c.top_k}));
  }, false);
  other_work();
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    parallel::ep_combine_backward_finish(e, m.plan, f32(o.dys, {m.r, m.c.d}));
  }, true);
  each([&](Batch& m, Out&, parallel::EpExchange& e) {
    e = parallel::ep_dispatch_backward_start(ep, m.plan, f32(m.dxs, {m.r, m.c.d}));
  }, false);
  other_work();
  each([&](Batch& m, Out& o, parallel::EpExchange& e) {
    parallel::ep_dispatch_backward_finish(e, m.plan, f32(o.dx, {m.n, m.c.d}));
  }, true);

  for (size_t i = 0; i < batches.size(); ++i) {
    SCOPED_TRACE(batches[i].c.name);
    const Batch& m = batches[i];
    const Out& o = outs[i];
    std::vector<float> got;
    for (const auto* v : {&o.xs, &o.back, &o.y, &o.dys, &o.dw, &o.dx}) got.insert(got.end(), v->begin(), v->end());
    ASSERT_EQ(got.size(), m.want.size());
    EXPECT_EQ(std::memcmp(got.data(), m.want.data(), got.size() * sizeof(float)), 0)
        << "the halves' results differ from the one-call functions'";
  }
}

TEST_F(ExpertParallel, AFinishOfAnotherKindIsAnError) {
  comm::Communicator& ep = world_comm();
  std::vector<int32_t> idx = {0, 1};
  parallel::EpPlan plan = parallel::ep_plan(ep, Tensor(idx.data(), {1, 2}, DType::i32), 2 * ep.size());
  std::vector<float> x(4, 1.0f), dx(4);
  parallel::EpExchange e = parallel::ep_dispatch_forward_start(ep, plan, f32(x, {1, 4}));
  std::string err = error_of([&] { parallel::ep_dispatch_backward_finish(e, plan, f32(dx, {1, 4})); });
  EXPECT_NE(err.find("ep_dispatch_backward_finish: the exchange given is ep_dispatch_forward_start's, not "
                     "ep_dispatch_backward_start's"),
            std::string::npos)
      << err;
  std::vector<float> xs(static_cast<size_t>(plan.local_rows() * 4));
  parallel::ep_dispatch_forward_finish(e, plan, f32(xs, {plan.local_rows(), 4}));
}

TEST_F(ExpertParallel, UnevenExpertSplitIsAnError) {
  comm::Communicator& c = world_comm();
  std::vector<int32_t> idx = {0};
  const int64_t experts = 2 * c.size() + 1;
  std::string e = error_of([&] { parallel::ep_plan(c, Tensor(idx.data(), {1, 1}, DType::i32), experts); });
  if (c.size() == 1) {
    EXPECT_EQ(e, "");  // one rank owns every expert
    return;
  }
  EXPECT_NE(e.find(std::to_string(experts) + " experts do not split evenly over " + std::to_string(c.size())),
            std::string::npos)
      << e;
}

// ---- context parallelism ------------------------------------------------------------

struct CpCase {
  const char* name;
  int64_t b, chunk, hq, hkv, dh, window;
  bool sinks;
  int64_t dv = 0;  // v's head dim (MLA's differs from q's); 0: dh
};

// This cp rank's rows of a [B,T,H,Dh] tensor: chunks r and 2cp-1-r of each row.
std::vector<float> zigzag_rows(const std::vector<float>& full, int64_t b, int64_t t, int64_t row, int r, int cp) {
  const int64_t c = t / (2 * cp);
  std::vector<float> out;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t chunk : {int64_t{r}, int64_t{2 * cp - 1 - r}}) {
      auto first = full.begin() + (i * t + chunk * c) * row;
      out.insert(out.end(), first, first + c * row);
    }
  return out;
}

void run_cp_case(const CpCase& c, comm::Communicator& cp, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + " on '" + cp.name() + "' of " + std::to_string(cp.size()));
  const int n = cp.size(), r = cp.rank();
  const int64_t B = c.b, C = c.chunk, T = 2 * n * C, Hq = c.hq, Hkv = c.hkv, Dh = c.dh, Dv = c.dv > 0 ? c.dv : Dh;
  cpu::AttentionArgs args;
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));
  args.window = c.window;
  std::vector<float> q = uniform(B * T * Hq * Dh, 6, -2, 2, seed), k = uniform(B * T * Hkv * Dh, 7, -2, 2, seed);
  std::vector<float> v = uniform(B * T * Hkv * Dv, 8, -1, 1, seed), dout = uniform(B * T * Hq * Dv, 9, -1, 1, seed);
  std::vector<float> sinks = c.sinks ? uniform(Hq, 10, -1, 2, seed) : std::vector<float>();
  const Tensor sinks_t = c.sinks ? f32(sinks, {Hq}) : Tensor();

  // Single rank, the whole sequences.
  std::vector<float> out_g(dout.size()), lse_g(B * Hq * T), dq_g(q.size()), dk_g(k.size()), dv_g(v.size()), ds_g(Hq);
  cpu::attention_forward(f32(q, {B, T, Hq, Dh}), f32(k, {B, T, Hkv, Dh}), f32(v, {B, T, Hkv, Dv}), sinks_t, args,
                         f32(out_g, {B, T, Hq, Dv}), f32(lse_g, {B, Hq, T}));
  cpu::attention_backward(f32(q, {B, T, Hq, Dh}), f32(k, {B, T, Hkv, Dh}), f32(v, {B, T, Hkv, Dv}), sinks_t, args,
                          f32(out_g, {B, T, Hq, Dv}), f32(lse_g, {B, Hq, T}), f32(dout, {B, T, Hq, Dv}),
                          f32(dq_g, {B, T, Hq, Dh}), f32(dk_g, {B, T, Hkv, Dh}), f32(dv_g, {B, T, Hkv, Dv}),
                          c.sinks ? f32(ds_g, {Hq}) : Tensor());

  // The ring on this rank's zigzag rows.
  std::vector<float> q_r = zigzag_rows(q, B, T, Hq * Dh, r, n), k_r = zigzag_rows(k, B, T, Hkv * Dh, r, n);
  std::vector<float> v_r = zigzag_rows(v, B, T, Hkv * Dv, r, n), dout_r = zigzag_rows(dout, B, T, Hq * Dv, r, n);
  std::vector<float> out(dout_r.size()), lse(B * Hq * 2 * C), dq(q_r.size()), dk(k_r.size()), dv(v_r.size()), ds(Hq);
  const Shape qs{B, 2 * C, Hq, Dh}, ks{B, 2 * C, Hkv, Dh}, vs{B, 2 * C, Hkv, Dv}, os{B, 2 * C, Hq, Dv};
  parallel::ring_attention_forward(cp, f32(q_r, qs), f32(k_r, ks), f32(v_r, vs), sinks_t, args, f32(out, os),
                                   f32(lse, {B, Hq, 2 * C}));
  parallel::ring_attention_backward(cp, f32(q_r, qs), f32(k_r, ks), f32(v_r, vs), sinks_t, args, f32(out, os),
                                    f32(lse, {B, Hq, 2 * C}), f32(dout_r, os), f32(dq, qs), f32(dk, ks), f32(dv, vs),
                                    c.sinks ? f32(ds, {Hq}) : Tensor());
  if (c.sinks) cp.all_reduce(f32(ds, {Hq}));  // each rank has its query rows' share

  const double tol = 1e-5;
  const std::vector<float> out_want = zigzag_rows(out_g, B, T, Hq * Dv, r, n);
  expect_close(out.data(), out_want.data(), static_cast<int64_t>(out.size()), tol, "out");
  // lse [B,Hq,T] is zigzagged along its last axis: one "row" per (batch, head).
  const std::vector<float> lse_want = zigzag_rows(lse_g, B * Hq, T, 1, r, n);
  for (size_t i = 0; i < lse.size(); ++i)
    EXPECT_NEAR(lse[i], lse_want[i], tol * std::max(1.0f, std::fabs(lse_want[i]))) << "lse " << i;
  expect_close(dq.data(), zigzag_rows(dq_g, B, T, Hq * Dh, r, n).data(), static_cast<int64_t>(dq.size()), tol, "dq");
  expect_close(dk.data(), zigzag_rows(dk_g, B, T, Hkv * Dh, r, n).data(), static_cast<int64_t>(dk.size()), tol, "dk");
  expect_close(dv.data(), zigzag_rows(dv_g, B, T, Hkv * Dv, r, n).data(), static_cast<int64_t>(dv.size()), tol, "dv");
  if (c.sinks) expect_close(ds.data(), ds_g.data(), Hq, tol, "dsinks");
}

const CpCase kCpCases[] = {
    {"causal GQA", 2, 3, 4, 2, 8, 0, false},
    {"causal with sinks", 2, 3, 4, 2, 8, 0, true},
    {"window inside a chunk, sinks", 1, 4, 2, 1, 6, 3, true},
    {"window across chunks", 2, 3, 4, 4, 5, 7, false},
    {"MLA head dims (Dv 8 < Dqk 12), window across chunks, sinks", 2, 3, 4, 2, 12, 7, true, 8},
};

TEST_F(ContextParallel, RingAttentionMatchesFullSequence) {
  for (const CpCase& c : kCpCases) run_cp_case(c, world_comm(), 31);
  // On four ranks, also cp 2 inside a mesh (two cp groups side by side, ep 2).
  if (world_comm().size() == 4) {
    comm::DeviceMesh mesh(world_comm(), 1, 2, 2);
    for (const CpCase& c : kCpCases) run_cp_case(c, mesh.cp(), 40 + mesh.coord().ep);
  }
}

// Under mpirun, gtest's report from rank 0 only; the others name their failures.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::printf("[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

// ---- sharding -------------------------------------------------------------------------

// Blocks of awkward sizes in four units (the embedding, layer 0's dense blocks and its
// experts, layer 1), so shards pad and pieces cross block ends. Dense units shard over
// the world, expert units over pairs of ranks (groups of one on a lone rank: no
// gradient shard, their sums are the blocks' own gradients).
TEST_F(Sharding, ReduceScatterAllGatherAndStateRoundTrip) {
  comm::Communicator& w = world_comm();
  comm::Communicator pairs = w.split(w.rank() / 2, w.rank(), "pairs");
  struct Block {
    int64_t layer, n;
    bool expert;
  };
  const std::vector<Block> blocks = {{-1, 5, false}, {0, 3, false}, {0, 7, true}, {0, 4, false},
                                     {0, 2, true},   {1, 1, false}, {1, 9, false}};
  std::vector<std::vector<float>> values, grads;
  std::vector<Param> params;
  for (size_t i = 0; i < blocks.size(); ++i) {
    // Every rank's gradients differ; the weights start as rank-specific garbage.
    grads.push_back(uniform(blocks[i].n, 100 + i, -1, 1, 50 + w.rank()));
    values.push_back(uniform(blocks[i].n, 200 + i, -9, 9, 70 + w.rank()));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    Param p;
    p.name = "block" + std::to_string(i);
    p.value = f32(values[i], {blocks[i].n});
    p.grad = f32(grads[i], {blocks[i].n});
    p.expert = blocks[i].expert;
    p.layer = blocks[i].layer;
    params.push_back(p);
  }
  parallel::ShardLayout layout(params, &w, &pairs);
  ASSERT_EQ(layout.units().size(), 4u);
  int64_t shared = 0;  // elements of the units whose group is more than one rank
  for (const parallel::ShardUnit& u : layout.units()) {
    EXPECT_EQ(u.grad_at < 0, u.group_size == 1) << "unit of layer " << u.layer;
    if (u.group_size > 1) shared += u.shard;
  }
  EXPECT_EQ(layout.grad_elements(), shared);
  std::vector<float> grad(static_cast<size_t>(layout.grad_elements()), -1.0f);
  std::vector<float> shard(static_cast<size_t>(layout.shard_elements()), -1.0f);
  std::vector<float> scratch(static_cast<size_t>(layout.scratch_elements()));
  Tensor grad_t = f32(grad, {layout.grad_elements()}), shard_t = f32(shard, {layout.shard_elements()});
  Tensor scratch_t = f32(scratch, {layout.scratch_elements()});

  // The reference sum of a block over a group: every rank's gradients, drawn again.
  auto group_sum = [&](size_t i, comm::Communicator& g) {
    std::vector<float> sum(static_cast<size_t>(blocks[i].n), 0.0f);
    for (int r = 0; r < g.size(); ++r) {
      const int world_rank = &g == &w ? r : (w.rank() / 2) * 2 + r;
      std::vector<float> gr = uniform(blocks[i].n, 100 + i, -1, 1, 50 + world_rank);
      for (int64_t e = 0; e < blocks[i].n; ++e) sum[e] += gr[e];
    }
    return sum;
  };
  // Every part started before any is waited for, as the schedule overlaps them.
  std::vector<parallel::ShardLayout::Reduction> started;
  for (int64_t part : {-1, 0, 1}) started.push_back(layout.reduce_start(params, part, grad_t));
  for (parallel::ShardLayout::Reduction& r : started) r.wait();
  int64_t covered = 0;
  for (const parallel::ShardUnit& u : layout.units()) {
    EXPECT_TRUE(u.group_size * u.shard >= u.length && u.shard <= u.length / u.group_size + 1);
    for (const parallel::ShardPiece& p : u.pieces) {
      std::vector<float> want = group_sum(p.param, blocks[p.param].expert ? pairs : w);
      Tensor got = parallel::ShardLayout::grad_of(params, grad_t, u, p);
      expect_close(got.f32(), want.data() + p.offset, p.count, 1e-6, "reduced block " + std::to_string(p.param));
      covered += p.count;
    }
  }
  // Every element of every unit is on exactly one rank of its group.
  int64_t dense = 0, expert = 0;
  for (const Block& b : blocks) (b.expert ? expert : dense) += b.n;
  std::vector<int64_t> mine(2, 0);
  for (const parallel::ShardUnit& u : layout.units())
    for (const parallel::ShardPiece& p : u.pieces) mine[blocks[p.param].expert ? 1 : 0] += p.count;
  std::vector<int64_t> dense_sum = {mine[0]}, expert_sum = {mine[1]};
  w.all_reduce(Tensor(dense_sum.data(), {1}, DType::i64));
  pairs.all_reduce(Tensor(expert_sum.data(), {1}, DType::i64));
  EXPECT_EQ(dense_sum[0], dense);
  EXPECT_EQ(expert_sum[0], expert);
  EXPECT_EQ(covered, mine[0] + mine[1]);

  // all_gather: each rank writes the true weights only where its shard is; afterwards
  // every rank holds them all.
  for (const parallel::ShardUnit& u : layout.units())
    for (const parallel::ShardPiece& p : u.pieces) {
      std::vector<float> truth = uniform(blocks[p.param].n, 300 + p.param, -2, 2);
      std::copy_n(truth.begin() + p.offset, p.count, values[p.param].begin() + p.offset);
    }
  layout.all_gather(params, scratch_t);
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<float> truth = uniform(blocks[i].n, 300 + i, -2, 2);
    expect_close(values[i].data(), truth.data(), blocks[i].n, 0, "gathered block " + std::to_string(i));
  }

  // scatter then gather gives back state laid out like the weights.
  std::vector<std::vector<float>> full, back;
  std::vector<Tensor> full_t, back_t;
  for (size_t i = 0; i < blocks.size(); ++i) {
    full.push_back(uniform(blocks[i].n, 400 + i, -3, 3));
    back.emplace_back(static_cast<size_t>(blocks[i].n), 0.0f);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    full_t.push_back(f32(full[i], {blocks[i].n}));
    back_t.push_back(f32(back[i], {blocks[i].n}));
  }
  layout.scatter(full_t, shard_t, Tensor(), scratch_t);
  layout.gather(shard_t, Tensor(), back_t, scratch_t);
  for (size_t i = 0; i < blocks.size(); ++i)
    expect_close(back[i].data(), full[i].data(), blocks[i].n, 0, "round trip of block " + std::to_string(i));
  // bf16 shards (optimizer.state_dtype = bf16) round in the scratch: exact for values
  // that are bf16 already.
  std::vector<uint16_t> half(static_cast<size_t>(layout.shard_elements()));
  Tensor half_t(half.data(), {layout.shard_elements()}, DType::bf16);
  for (std::vector<float>& f : full)
    for (float& x : f) x = f32_from_bf16(bf16_from_f32(x));
  layout.scatter(full_t, half_t, Tensor(), scratch_t);
  layout.gather(half_t, Tensor(), back_t, scratch_t);
  for (size_t i = 0; i < blocks.size(); ++i)
    expect_close(back[i].data(), full[i].data(), blocks[i].n, 0, "bf16 round trip of block " + std::to_string(i));
}

// One hot expert (5, load 10; the others 1) over 4 ranks of 2 experts and 1 replica slot
// each, worked by hand: replication gives expert 5 a copy on every rank (10/2, 10/3,
// 10/4 stay the highest per copy) and the fourth replica to expert 0 (ties: the lower);
// packing puts 5's copies on ranks 0, 1 (tied with 3: the lower) and 3, and 0's on the
// one rank with room, 2. Loads a rank then 4, 4.5, 4, 4.5 (mean 4.25) against 11 on
// rank 2 without replicas.
TEST_F(ExpertPlacement, AHotExpertGetsReplicasWorkedByHand) {
  std::vector<double> load(8, 1.0);
  load[5] = 10;
  const parallel::Placement p = parallel::plan_placement(load, 4, 1);
  const std::vector<std::vector<int32_t>> want = {{0, 1, 5}, {2, 3, 5}, {4, 5, 0}, {6, 7, 5}};
  EXPECT_EQ(p.slots, want);
  EXPECT_EQ(p.rank_loads(load), (std::vector<double>{4.0, 4.5, 4.0, 4.5}));
  EXPECT_DOUBLE_EQ(parallel::max_over_mean(p, load), 4.5 / 4.25);
  EXPECT_DOUBLE_EQ(parallel::max_over_mean(parallel::owners_only(8, 4, 1), load), 11 / 4.25);
  // Routing: a rank holding the expert keeps its slots; the others split them by token
  // over the holders in rank order (expert 0: ranks 0 and 2).
  EXPECT_EQ(p.holders(0), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(p.route(5, 1, 7), 1);
  EXPECT_EQ(p.route(0, 2, 7), 2);
  EXPECT_EQ(p.route(0, 1, 3), 2);
  EXPECT_EQ(p.route(0, 3, 4), 0);
  EXPECT_EQ(p.route(6, 0, 9), 3);
  // Without replica slots, or without load, it is the owners' placement.
  EXPECT_EQ(parallel::plan_placement(load, 4, 0), parallel::owners_only(8, 4, 0));
  EXPECT_DOUBLE_EQ(parallel::max_over_mean(p, std::vector<double>(8, 0.0)), 1.0);
}

// The copies' shares, worked by hand: 3 ranks, one expert each, loads 1, 3, 6, and a
// replica of expert 2 on rank 0. Each holder keeps its own senders' 6/3 = 2 rows; the
// other 2 fill the lower holder first: rank 2 (0 + 2) up to rank 0's level (1 + 2), then
// both evenly, so rank 0 gets 2.5 (share 5/12) and rank 2 3.5 (7/12), against 3 and 3
// with even shares: rank loads 3.5, 3, 3.5. Rank 1's tokens then split 1/12 : 3/12 over
// ranks 0 and 2 (their shares above 1/3), by the golden-ratio sequence of the token.
TEST_F(ExpertPlacement, CopiesShareAHotExpertsRowsToEvenTheRanks) {
  parallel::Placement p = parallel::owners_only(3, 3, 1);
  p.slots[0][1] = 2;
  const std::vector<double> load = {1, 3, 6};
  parallel::balance_shares(p, load);
  EXPECT_DOUBLE_EQ(p.share[0][1], 5.0 / 12);
  EXPECT_DOUBLE_EQ(p.share[2][0], 7.0 / 12);
  EXPECT_EQ(p.share[1], (std::vector<double>{1.0, 0.0}));
  const std::vector<double> ranks = p.rank_loads(load);
  for (int r = 0; r < 3; ++r) EXPECT_DOUBLE_EQ(ranks[static_cast<size_t>(r)], r == 1 ? 3.0 : 3.5) << "rank " << r;
  EXPECT_EQ(p.route(2, 0, 1), 0);
  EXPECT_EQ(p.route(2, 2, 2), 2);
  EXPECT_EQ(p.route(2, 1, 1), 2);  // frac(0.618) x 4/12 = 0.206, past rank 0's 1/12
  EXPECT_EQ(p.route(2, 1, 2), 0);  // frac(1.236) x 4/12 = 0.079
  int to_rank0 = 0;
  for (int64_t t = 0; t < 10000; ++t) to_rank0 += p.route(2, 1, t) == 0;
  EXPECT_NEAR(to_rank0, 2500, 5);
}

// Skewed random loads (a few experts 10 above the rest, which are below 1): the same placement on every
// rank; each rank its own experts first, at most R replicas, no expert twice on a rank,
// every replica on its owner's node; and max/mean no higher than without replicas.
TEST_F(ExpertPlacement, DeterministicEqualOnEveryRankAndWithinItsNode) {
  comm::Communicator& w = world_comm();
  for (int64_t per_node : {0, 2}) {
    const std::vector<float> u = uniform(64, 7, 0, 1);
    std::vector<double> load(u.begin(), u.end());
    for (int64_t e : {3, 17, 18, 40}) load[static_cast<size_t>(e)] += 10;
    const parallel::Placement p = parallel::plan_placement(load, 8, 2, per_node);
    std::vector<int32_t> flat;
    for (const auto& s : p.slots) flat.insert(flat.end(), s.begin(), s.end());
    std::vector<int32_t> all(flat.size() * static_cast<size_t>(w.size()));
    w.all_gather(Tensor(flat.data(), {static_cast<int64_t>(flat.size())}, DType::i32),
                 Tensor(all.data(), {static_cast<int64_t>(all.size())}, DType::i32));
    for (int r = 0; r < w.size(); ++r)
      EXPECT_TRUE(std::equal(flat.begin(), flat.end(), all.begin() + static_cast<ptrdiff_t>(r * flat.size())))
          << "rank " << r << "'s placement differs";
    EXPECT_EQ(p, parallel::plan_placement(load, 8, 2, per_node));
    for (int64_t r = 0; r < 8; ++r) {
      const std::vector<int32_t>& s = p.slots[static_cast<size_t>(r)];
      ASSERT_EQ(s.size(), 10u);
      for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(s[static_cast<size_t>(i)], r * 8 + i);
      std::vector<int32_t> sorted = s;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "rank " << r;
      for (int64_t i = 8; i < 10; ++i) {
        if (per_node > 0 && s[static_cast<size_t>(i)] >= 0) {
          EXPECT_EQ(p.owner(s[static_cast<size_t>(i)]) / per_node, r / per_node) << "rank " << r;
        }
      }
    }
    for (int64_t e : {3, 17, 18, 40}) EXPECT_GE(p.holders(e).size(), 2u) << "expert " << e;
    EXPECT_LT(parallel::max_over_mean(p, load), parallel::max_over_mean(parallel::owners_only(64, 8, 2), load));
  }
  EXPECT_NE(error_of([] { parallel::plan_placement(std::vector<double>(6, 1.0), 4, 1); }).find("6 experts over 4 ranks"),
            std::string::npos);
}

// The nodes of an ep group from its ranks' hosts: equal node-major groups, else flat.
TEST_F(ExpertPlacement, NodesComeFromTheRanksHosts) {
  EXPECT_EQ(parallel::ranks_per_node({7, 7, 9, 9}), 2);
  EXPECT_EQ(parallel::ranks_per_node({7, 7, 7, 7, 5, 5, 5, 5}), 4);
  EXPECT_EQ(parallel::ranks_per_node({7, 7, 7, 7}), 0);  // one node
  EXPECT_EQ(parallel::ranks_per_node({7, 9, 7, 9}), 0);  // not node-major
  EXPECT_EQ(parallel::ranks_per_node({7, 7, 7, 9}), 0);  // unequal nodes
  EXPECT_EQ(parallel::ranks_per_node({7, 7, 9, 9, 7, 7}), 0);  // a host twice
  EXPECT_EQ(parallel::ranks_per_node({3}), 0);
}

// The loads' moving average: the first step's counts, then decay * mean + (1 - decay) * counts.
TEST_F(ExpertPlacement, LoadAverageWeighsTheSteps) {
  parallel::LoadAverage a;
  a.decay = 0.75;
  a.add({{4, 0}, {1, 2}});
  a.add({{0, 8}, {1, 6}});
  EXPECT_EQ(a.mean, (std::vector<std::vector<double>>{{3.0, 2.0}, {1.0, 3.0}}));
}

// The dispatch's kernel routes as the rule says: on skewed loads over 4 ranks with 2
// replica slots each, for every sender, random choices go to route_slot's slot, which
// holds the chosen expert, on Placement::route's rank; a sender holding a copy keeps
// the slot; and the counts by slot add up to the counts by expert.
TEST_F(ExpertPlacement, TheDispatchKernelRoutesAsTheRuleSays) {
  const int64_t E = 16, P = 4, R = 2, N = 40, k = 3;
  const std::vector<float> u = uniform(E, 11, 0, 1);
  std::vector<double> load(u.begin(), u.end());
  load[5] += 6;
  load[12] += 3;
  const parallel::Placement p = parallel::plan_placement(load, P, R);
  const int64_t S = p.slots_per_rank();
  for (int64_t sender = 0; sender < P; ++sender) {
    const parallel::RouteTable t = parallel::route_table(p, sender);
    std::vector<int32_t> idx(static_cast<size_t>(N * k)), slots(idx.size(), -2);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>((i * 7 + i / 5 + sender) % E);
    std::vector<int32_t> mine = t.mine, first = t.first, slot = t.slot;
    std::vector<int64_t> bound = t.bound;
    const int64_t c = static_cast<int64_t>(slot.size());
    mt::ep_route_slots(Tensor(idx.data(), {N, k}, DType::i32), Tensor(mine.data(), {E}, DType::i32),
                       Tensor(first.data(), {E + 1}, DType::i32), Tensor(slot.data(), {c}, DType::i32),
                       Tensor(bound.data(), {c}, DType::i64), Tensor(slots.data(), {N, k}, DType::i32));
    std::vector<int32_t> slot_counts(static_cast<size_t>(P * S), 0);
    std::vector<int64_t> counts(static_cast<size_t>(E), 0);
    for (int64_t tok = 0; tok < N; ++tok)
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = idx[static_cast<size_t>(tok * k + j)], g = slots[static_cast<size_t>(tok * k + j)];
        EXPECT_EQ(g, parallel::route_slot(t, e, tok)) << "sender " << sender << " token " << tok;
        ASSERT_TRUE(g >= 0 && g < P * S) << g;
        EXPECT_EQ(p.slots[static_cast<size_t>(g / S)][static_cast<size_t>(g % S)], e) << "slot " << g;
        EXPECT_EQ(g / S, p.route(e, sender, tok));
        const std::vector<int64_t> h = p.holders(e);
        if (std::find(h.begin(), h.end(), sender) != h.end()) {
          EXPECT_EQ(g / S, sender) << "expert " << e;
        }
        ++slot_counts[static_cast<size_t>(g)];
        ++counts[static_cast<size_t>(e)];
      }
    if (P == world_comm().size()) {
      ExpertReplicas rep(&world_comm(), E, R, Device::cpu);
      std::vector<float> v(static_cast<size_t>(S));
      Param w;
      w.name = "w";
      w.value = w.grad = w.compute = Tensor(v.data(), {S}, DType::f32);
      rep.add(0, 0, w);
      rep.set_placement(0, p);
      EXPECT_EQ(rep.expert_counts(0, slot_counts), counts);
    }
  }
  // Both hot experts have copies, and the shares send rows to them.
  EXPECT_GE(p.holders(5).size(), 2u);
  EXPECT_GE(p.holders(12).size(), 2u);
}

// ExpertReplicas' moves, exactly (small integers in f32), on every rank of the world: 2
// experts a rank and 1 replica slot. Placement A puts on rank r a copy of the next
// rank's first expert, B of the previous rank's second (rank 0's slot left empty). After
// each refresh a replica holds its owner's weights; sum_gradients adds each replica's
// gradient to its owner's (once: a second call before the next refresh adds nothing).
TEST_F(ExpertPlacement, ReplicasTakeTheirOwnersWeightsAndGiveBackTheirGradients) {
  comm::Communicator& world = world_comm();
  const int64_t W = world.size(), me = world.rank(), E = 2 * W, S = 3, C = 4;
  if (W < 2) GTEST_SKIP() << "replicas live on other ranks";
  std::vector<float> value(static_cast<size_t>(S * C)), grad(value.size());
  Param w;
  w.name = "layers.0.experts.down";
  w.expert = true;
  w.value = w.compute = Tensor(value.data(), {S, C}, DType::f32);
  w.grad = Tensor(grad.data(), {S, C}, DType::f32);
  ExpertReplicas rep(&world, E, 1, Device::cpu);
  rep.add(0, 0, w);
  auto at = [&](std::vector<float>& t, int64_t b, int64_t c) -> float& { return t[static_cast<size_t>(b * C + c)]; };
  for (int pass = 0; pass < 2; ++pass) {
    parallel::Placement p = parallel::owners_only(E, W, 1);
    for (int64_t r = 0; r < W; ++r)
      p.slots[static_cast<size_t>(r)][2] = static_cast<int32_t>(pass == 0 ? (r + 1) % W * 2 : (r + W - 1) % W * 2 + 1);
    if (pass == 1) p.slots[0][2] = -1;
    parallel::balance_shares(p, std::vector<double>(static_cast<size_t>(E), 1.0));
    EXPECT_TRUE(rep.set_placement(0, p));
    EXPECT_FALSE(rep.set_placement(0, p));
    for (int64_t b = 0; b < S; ++b)
      for (int64_t c = 0; c < C; ++c) {
        at(value, b, c) = b < 2 ? static_cast<float>(100 * (me * 2 + b) + c) : -1.0f;
        at(grad, b, c) = static_cast<float>(1000 * me + 10 * b + c);
      }
    rep.refresh();
    const int32_t e = p.slots[static_cast<size_t>(me)][2];
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(at(value, 2, c), e < 0 ? -1.0f : static_cast<float>(100 * e + c));
    rep.sum_gradients(0);
    rep.sum_gradients(0);
    for (int64_t b = 0; b < 2; ++b) {
      const int64_t expert = me * 2 + b;
      for (int64_t c = 0; c < C; ++c) {
        float want = static_cast<float>(1000 * me + 10 * b + c);
        for (int64_t q = 0; q < W; ++q)
          if (p.slots[static_cast<size_t>(q)][2] == expert) want += static_cast<float>(1000 * q + 20 + c);
        EXPECT_EQ(at(grad, b, c), want) << "pass " << pass << " expert " << expert;
      }
    }
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // An exception on one rank would leave the others waiting in a collective: let it
  // end the process instead (its message printed), and mpirun ends the job.
  GTEST_FLAG_SET(catch_exceptions, false);
  mt::comm::World& w = mt::comm::world();
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (w.rank() == 0) {
    std::printf("test_parallel: a world of %d rank(s), launcher: %s\n", w.size(), w.launch().launcher.c_str());
  } else {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new mt::RankFailurePrinter(w.rank()));
  }
  int32_t failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  w.comm().all_reduce(mt::Tensor(&failed, {1}, mt::DType::i32));
  return failed != 0 ? 1 : 0;
}
