// Collectives and point-to-point messages between ranks: MPI for host buffers, NCCL
// for GPU buffers (built with CUDA), chosen by the tensors' device.
//
//   comm::World& w = comm::world();          // MPI_Init once, when launched with > 1 rank
//   w.comm().all_reduce(grad);               // sum over every rank, in place
//   Request r = ep.start_all_to_all_v(x, sc, xs, rc, Traffic::expert);
//   ... compute ...
//   r.wait();                                // xs is ready (on the GPU: for the current stream)
//
// Every operation is collective over the communicator's ranks (point-to-point: over
// the two peers) and checks its arguments before any message moves, so a bad call
// fails on every rank alike. Errors name the communicator, this rank, the operation
// and the sizes. Sums are supported for f32, bf16, i32 and i64; data movement for any
// dtype. Counts are in elements.
//
// Collectives other than broadcast and barrier, and message batches, are started and
// then joined: the blocking calls are start, then Request::wait. On CPU buffers a start
// is a non-blocking MPI call and wait is MPI_Waitall (a world of one copies at the
// start). On GPU buffers nothing makes the host wait: a start queues the NCCL calls on
// its Traffic's communication stream after the work already queued on the current stream
// (kernels/cuda/runtime.h), and wait() makes the then-current stream wait for them.
// Started operations, on any communicators, must be started in the same order on every
// rank (NCCL kernels of several communicators wait for their peers and can otherwise
// deadlock); they may be waited for in any order. A communicator's NCCL communicator is
// created at its first GPU operation, which all its ranks must reach. A GPU broadcast
// runs on the current stream. One host thread makes all of a process's calls, GPU ones
// included (MPI is initialised FUNNELED, and nothing here takes a lock).
//
// Ranks that share a GPU. NCCL refuses two ranks of one communicator on one device, so
// when ranks of the world share a GPU (share_gpus, decided once by World from every
// rank's PCI bus id) every communicator stages its GPU tensors through host memory and
// moves them with the same MPI calls as CPU tensors, as Gloo does for CUDA tensors. A
// start waits (on the host) for the current stream, copies the tensors it reads into a
// pinned staging block and starts the non-blocking MPI call on the block; wait() ends
// the MPI call, copies what it wrote back to the device on the current stream and waits
// for that copy, so the block can be reused. Both halves block the host; the contract
// (any order of waits, every Traffic kind, the same order of starts on every rank) is
// the CPU path's. For testing a mesh on one GPU, not for speed. Staging::every_tensor
// stages host tensors too, so the same code runs in tests on machines without a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt::comm {

// How this process was started, from the launcher's environment variables: Open MPI
// (OMPI_COMM_WORLD_*), PMI (PMI_RANK/PMI_SIZE, as MPICH and srun --mpi=pmi2 set),
// SLURM (SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID), then
// torchrun-style RANK/WORLD_SIZE/LOCAL_RANK; none of them is a world of one.
struct Launch {
  int rank = 0, size = 1, local_rank = 0;
  std::string launcher = "none";
};
// `env` looks a variable up (nullptr when unset): std::getenv, or a table in tests.
Launch detect_launch(const std::function<const char*(const char*)>& env);

class Communicator;
struct Stage;  // host staging's copies of one operation's tensors (communicator.cpp)

// Which GPU a rank drives: its host, the device's ordinal there and its PCI bus id
// (empty bus id: no GPU).
struct RankGpu {
  std::string host;
  int ordinal = -1;
  std::string bus_id;
};
// What World decides from every rank's RankGpu: whether any two ranks drive one GPU
// (then every communicator stages GPU tensors through host memory, ranks alone on a GPU
// too, so one communicator never mixes the paths), how many ranks drive each rank's GPU
// (0 without one), and the banner's line ("ranks 0-3 share GPU 0: ..."), empty when none
// share.
struct GpuSharing {
  bool staged = false;
  std::vector<int> ranks_on_gpu;
  std::string text;
};
GpuSharing share_gpus(std::span<const RankGpu> gpus);

// How a communicator moves GPU tensors: none (NCCL), gpu_tensors (through host memory:
// ranks share a GPU), every_tensor (host tensors staged too: the staged path's tests).
enum class Staging : uint8_t { none, gpu_tensors, every_tensor };

// The kinds of traffic that may be in flight at once. On the GPU each kind has a
// communication stream of its own, so one kind's transfers never queue behind
// another's (a layer's gradient reduction behind the next layer's token exchange);
// operations of one communicator still run in the order they were started (NCCL
// orders them).
enum class Traffic : uint8_t { expert, context, gradient, gather, pipeline };

// A started collective or batch of sends and receives; wait() returns when it is done
// (on the GPU: when the current stream is ordered after it). The buffers belong to the
// transfer until then and must stay alive; the Request keeps whatever else it needs
// (counts, displacements). Destroying a Request that was not waited for waits.
class Request {
 public:
  Request();
  ~Request();
  Request(Request&&) noexcept;
  Request& operator=(Request&&) noexcept;
  void wait();

 private:
  friend class Communicator;
  struct Impl;
  explicit Request(std::string where);
  std::unique_ptr<Impl> impl_;
};

// One message of a batch: send `tensor` to `peer`, or receive into it from `peer`.
// Between two ranks, messages are matched in the order they were posted.
struct P2P {
  bool send = true;
  Tensor tensor;
  int peer = 0;
};
inline P2P send_to(const Tensor& t, int peer) { return {true, t, peer}; }
inline P2P recv_from(const Tensor& t, int peer) { return {false, t, peer}; }

class Communicator {
 public:
  // A communicator of this process alone: no MPI needed (collectives are copies).
  explicit Communicator(std::string name);
  // One that only describes a group, rank `rank` of `size`, for `moetrain plan` to build
  // a model as a rank of that mesh would: every operation on it is an error.
  static Communicator describing(std::string name, int rank, int size);
  ~Communicator();
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) = delete;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }

  // x = sum over ranks of x, in place.
  void all_reduce(const Tensor& x) { start_all_reduce(x, Traffic::gradient).wait(); }
  // in holds size() blocks of out.numel() elements; out = sum over ranks of block rank().
  void reduce_scatter(const Tensor& in, const Tensor& out) { start_reduce_scatter(in, out, Traffic::gradient).wait(); }
  // out = the in of every rank, concatenated in rank order.
  void all_gather(const Tensor& in, const Tensor& out) { start_all_gather(in, out, Traffic::gather).wait(); }
  // in holds send_counts[p] elements for each rank p in rank order, out receives
  // recv_counts[p] from each p in rank order; both sums must equal the tensors' sizes.
  void all_to_all_v(const Tensor& in, std::span<const int64_t> send_counts, const Tensor& out,
                    std::span<const int64_t> recv_counts) {
    start_all_to_all_v(in, send_counts, out, recv_counts, Traffic::expert).wait();
  }
  // The same collectives in two halves (the blocking ones above are start, then wait):
  // start_* checks the arguments (a bad call fails there, on every rank, with nothing
  // started) and starts the transfer, on the GPU on `traffic`'s stream; Request::wait()
  // joins it.
  Request start_all_reduce(const Tensor& x, Traffic traffic);
  Request start_reduce_scatter(const Tensor& in, const Tensor& out, Traffic traffic);
  Request start_all_gather(const Tensor& in, const Tensor& out, Traffic traffic);
  Request start_all_to_all_v(const Tensor& in, std::span<const int64_t> send_counts, const Tensor& out,
                             std::span<const int64_t> recv_counts, Traffic traffic);
  void broadcast(const Tensor& x, int root);
  void barrier();

  // Starts every message of the batch at once (on NCCL: one group, on `traffic`'s
  // stream), so a batch that both sends and receives cannot deadlock against its peers'
  // batches. send and recv are such batches of one message, joined at once.
  void send(const Tensor& x, int peer) { start({send_to(x, peer)}).wait(); }
  void recv(const Tensor& x, int peer) { start({recv_from(x, peer)}).wait(); }
  Request start(std::span<const P2P> ops, Traffic traffic = Traffic::pipeline);
  Request start(std::initializer_list<P2P> ops, Traffic traffic = Traffic::pipeline) {
    return start(std::span<const P2P>(ops.begin(), ops.size()), traffic);
  }

  // A communicator per color of this one's ranks, ordered by key (collective); it
  // stages as this one does.
  Communicator split(int color, int key, std::string name);
  // How GPU tensors travel (see the header): set by World for the world communicator
  // before anything is split from it, or by a test.
  void set_staging(Staging s) { staging_ = s; }
  Staging staging() const { return staging_; }
  // Creates the NCCL communicator now (collective); GPU operations otherwise do it
  // at first use. An error in a build without CUDA.
  void init_gpu();

  struct Impl;  // MPI and NCCL handles, kept out of this header

 private:
  Communicator(std::string name, int rank, int size, std::unique_ptr<Impl> impl);
  friend class World;
  // "all_reduce on comm 'ep' (rank 1 of 4)": what every error of an operation starts with.
  std::string where(const char* op) const;
  // Whether `t` travels through host staging on this communicator; through_host stages
  // `reads` and `writes`, runs `start` (the operation on the stage's host views) with
  // staging off and hands the Request the stage, which its wait() finishes.
  bool stages(const Tensor& t) const;
  Request through_host(const std::vector<Tensor>& reads, const std::vector<Tensor>& writes,
                       const std::function<Request(const Stage&)>& start);

  std::string name_;
  int rank_ = 0, size_ = 1;
  bool shape_only_ = false;
  Staging staging_ = Staging::none;
  std::unique_ptr<Impl> impl_;
};

// `text` as rank `root` of `c` holds it, on every rank (collective; other ranks' `text`
// is not read).
std::string broadcast_text(Communicator& c, const std::string& text, int root);

// Sums host doubles over the ranks of `c` (null: one rank, nothing to do). Gathered as
// raw 64-bit words and added in rank order: exact doubles, and the same sum on every rank
// (there is no f64 reduction; an f32 one lost ~1e-7). Collective.
void sum_in_rank_order(Communicator* c, std::vector<double>& v);

// The process-wide world. Created at the first world() call: reads the launcher's
// variables, calls MPI_Init (only when there is more than one rank, so a lone
// process needs no mpirun), checks that MPI agrees with the launcher, and names the
// rank in every check message (mt::set_check_rank). MPI_Finalize runs at exit.
class World {
 public:
  const Launch& launch() const { return launch_; }
  int rank() const { return launch_.rank; }
  int size() const { return launch_.size; }
  int local_rank() const { return launch_.local_rank; }
  Communicator& comm() { return *comm_; }
  // Whether ranks share GPUs, and so stage GPU messages through host memory.
  const GpuSharing& gpu_sharing() const { return sharing_; }
  // Ends every rank of the job with `code` (MPI_Abort), so one rank's error does not
  // leave the others waiting in a collective; without MPI, exits.
  [[noreturn]] void abort(int code);

  World(const World&) = delete;
  World& operator=(const World&) = delete;
  ~World();

 private:
  World();
  friend World& world();
  Launch launch_;
  bool finalize_ = false;  // MPI was initialised here, so it is finalised here
  GpuSharing sharing_;
  std::unique_ptr<Communicator> comm_;
};

World& world();

}  // namespace mt::comm
