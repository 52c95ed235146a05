#include "comm/communicator.h"

#include <mpi.h>
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#include <sanitizer/lsan_interface.h>
#define MT_LSAN 1
#endif
#endif

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <unistd.h>

#include "core/check.h"

#ifdef MOETRAIN_WITH_CUDA
#include <nccl.h>

#include <array>

#include "kernels/cuda/device.h"
#include "kernels/cuda/runtime.h"
#endif

namespace mt::comm {

struct Communicator::Impl {
  MPI_Comm mpi = MPI_COMM_NULL;  // null for a communicator of this process alone
#ifdef MOETRAIN_WITH_CUDA
  ncclComm_t nccl = nullptr;     // created at the first GPU operation
#endif
};

// ---- host staging (ranks that share a GPU; see the header) ----------------------------

namespace {

// Staging blocks are kept for reuse, pinned ones for GPU tensors (a pinned allocation
// costs milliseconds) and plain ones for host tensors (tests); the smallest free block
// that fits is taken, else a new one of the next power of two. One host thread makes
// every call (the header), so no lock.
struct StageBlock {
  char* data = nullptr;
  size_t bytes = 0;
  bool pinned = false;
};
// Reused until the process ends; plain blocks are freed then, pinned ones go with the
// process (the CUDA runtime may be gone by the time statics are destroyed).
struct StagePool {
  std::vector<StageBlock> blocks;
  ~StagePool() {
    for (const StageBlock& b : blocks)
      if (!b.pinned) std::free(b.data);
  }
};
std::vector<StageBlock>& free_blocks() {
  static StagePool pool;
  return pool.blocks;
}

StageBlock take_block(size_t bytes, bool pinned) {
  std::vector<StageBlock>& blocks = free_blocks();
  auto best = blocks.end();
  for (auto it = blocks.begin(); it != blocks.end(); ++it)
    if (it->pinned == pinned && it->bytes >= bytes && (best == blocks.end() || it->bytes < best->bytes)) best = it;
  if (best != blocks.end()) {
    StageBlock b = *best;
    blocks.erase(best);
    return b;
  }
  StageBlock b{.bytes = std::max<size_t>(std::bit_ceil(std::max<size_t>(bytes, 1)), size_t{1} << 16), .pinned = pinned};
#ifdef MOETRAIN_WITH_CUDA
  if (pinned) {
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.data), b.bytes));
    return b;
  }
#endif
  MT_CHECK(!pinned) << "a pinned staging block needs CUDA";
  b.data = static_cast<char*>(std::malloc(b.bytes));
  MT_CHECK(b.data != nullptr) << "host staging: cannot allocate " << b.bytes << " bytes";
  return b;
}

// Tensor bytes between the device (or host, for every_tensor) and the block.
void stage_copy(void* dst, const void* src, size_t bytes, bool device) {
  if (bytes == 0) return;
#ifdef MOETRAIN_WITH_CUDA
  if (device) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda::stream()));
    return;
  }
#endif
  MT_CHECK(!device) << "host staging of a GPU tensor needs CUDA";
  std::memcpy(dst, src, bytes);
}

void stage_sync([[maybe_unused]] bool device) {
#ifdef MOETRAIN_WITH_CUDA
  if (device) cuda::synchronize();
#endif
}

}  // namespace

// The host copies of one operation's tensors, in one block: each distinct tensor once
// (an in-place operation reads and writes the same view), 256-byte aligned.
struct Stage {
  StageBlock block;
  bool device = false;
  std::vector<Tensor> originals, views;
  std::vector<bool> written;

  // Stages `reads` (copied in now) and `writes` (copied back by finish()); the host
  // waits for the current stream first, which may still be filling them.
  Stage(const std::vector<Tensor>& reads, const std::vector<Tensor>& writes) {
    for (const Tensor& t : reads) add(t, false);
    const size_t read_count = originals.size();
    for (const Tensor& t : writes) add(t, true);
    size_t bytes = 0;
    std::vector<size_t> offset;
    for (const Tensor& t : originals) {
      device = device || t.device == Device::cuda;
      offset.push_back(bytes);
      bytes += (static_cast<size_t>(t.nbytes()) + 255) / 256 * 256;
    }
    block = take_block(bytes, device);
    for (size_t i = 0; i < originals.size(); ++i) {
      Tensor v = originals[i];
      v.data = block.data + offset[i];
      v.device = Device::cpu;
      views.push_back(v);
    }
    stage_sync(device);
    // Reads were added first, so a tensor both read and written is among them.
    for (size_t i = 0; i < read_count; ++i)
      stage_copy(views[i].data, originals[i].data, static_cast<size_t>(views[i].nbytes()), device);
    stage_sync(device);
  }
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;
  ~Stage() {
    if (block.data != nullptr) free_blocks().push_back(block);
  }

  // The host view of `t` (which must be one of the staged tensors).
  const Tensor& view(const Tensor& t) const {
    size_t i = 0;
    while (i < originals.size() && !same(originals[i], t)) ++i;
    MT_CHECK(i < originals.size()) << "host staging: " << t.str() << " was not staged";
    return views[i];
  }

  // Copies the written views back to their tensors, and waits for the copies.
  void finish() {
    for (size_t i = 0; i < originals.size(); ++i)
      if (written[i]) stage_copy(originals[i].data, views[i].data, static_cast<size_t>(views[i].nbytes()), device);
    stage_sync(device);
  }

 private:
  static bool same(const Tensor& a, const Tensor& b) {
    return a.data == b.data && a.dtype == b.dtype && a.numel() == b.numel() && a.device == b.device;
  }
  void add(const Tensor& t, bool write) {
    for (size_t i = 0; i < originals.size(); ++i)
      if (same(originals[i], t)) {
        written[i] = written[i] || write;
        return;
      }
    originals.push_back(t);
    written.push_back(write);
  }
};

struct Request::Impl {
  std::string where;  // the operation, for errors
  std::vector<MPI_Request> mpi;
  // What MPI reads until the operation completes: all_to_all_v's counts and
  // displacements (the caller's arrays may be gone by then).
  std::vector<int> mpi_counts;
#ifdef MOETRAIN_WITH_CUDA
  cuda::Event done;  // on the traffic's stream, after the operation
#endif
  // Host staging: the block the MPI call runs on, and what it wrote, copied back at wait.
  std::unique_ptr<Stage> stage;
};

namespace {

// ---- launch -----------------------------------------------------------------------

bool read_int(const std::function<const char*(const char*)>& env, const char* name, int& out) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return false;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  MT_CHECK(*end == '\0' && errno == 0 && x >= 0 && x <= INT_MAX)
      << "environment variable " << name << "=" << v << " is not a non-negative integer";
  out = static_cast<int>(x);
  return true;
}

// ---- MPI --------------------------------------------------------------------------

MPI_Op g_bf16_sum = MPI_OP_NULL;

// bf16 travels as uint16 payloads, which MPI cannot add: sum in fp32, round once.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = bf16_from_f32(f32_from_bf16(a[i]) + f32_from_bf16(b[i]));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::bf16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::f8e4m3:
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_sum(DType t) { return t == DType::bf16 ? g_bf16_sum : MPI_SUM; }

void check_mpi(int rc, const std::string& where) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  MT_FAIL() << where << ": MPI error: " << std::string(text, static_cast<size_t>(len));
}

// MPI counts and displacements are int.
int mpi_count(int64_t n, const std::string& where) {
  MT_CHECK(n <= INT_MAX) << where << ": " << n << " elements exceed MPI's int count; split the transfer";
  return static_cast<int>(n);
}

bool mpi_finalized() {
  int fin = 0;
  MPI_Finalized(&fin);
  return fin != 0;
}

// ---- arguments ---------------------------------------------------------------------

void check_storage(const Tensor& t, const char* name, const std::string& where) {
  MT_CHECK(t.data != nullptr || t.numel() == 0) << where << ": " << name << " " << t.str() << " has no storage";
}

void check_summable(const Tensor& t, const std::string& where) {
  MT_CHECK(t.dtype == DType::f32 || t.dtype == DType::bf16 || t.dtype == DType::i32 || t.dtype == DType::i64)
      << where << ": sums are for f32, bf16, i32 and i64 tensors, got " << t.str();
}

void check_pair(const Tensor& in, const Tensor& out, const std::string& where) {
  check_storage(in, "input", where);
  check_storage(out, "output", where);
  MT_CHECK(in.dtype == out.dtype && in.device == out.device)
      << where << ": input " << in.str() << " and output " << out.str() << " differ in dtype or device";
}

// A GPU tensor here means the NCCL path; without CUDA there cannot be one.
bool on_gpu(const Tensor& t, [[maybe_unused]] const std::string& where) {
#ifndef MOETRAIN_WITH_CUDA
  MT_CHECK(t.device == Device::cpu) << where << ": " << t.str() << " is on the GPU but moetrain was built without CUDA";
#endif
  return t.device == Device::cuda;
}

#ifdef MOETRAIN_WITH_CUDA
// ---- NCCL -------------------------------------------------------------------------

void check_nccl(ncclResult_t r, const char* call, const std::string& where, ncclComm_t comm) {
  if (r == ncclSuccess) return;
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  MT_FAIL() << where << ": " << call << " failed: " << ncclGetErrorString(r)
            << (last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
}
#define NCCL_CHECK(call, where, comm) check_nccl((call), #call, (where), (comm))

char* at(const Tensor& t, int64_t elements) { return static_cast<char*>(t.data) + elements * dtype_size(t.dtype); }

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::f8e4m3:
    case DType::u8: return ncclUint8;
  }
  return ncclUint8;
}

// One communication stream per kind of traffic (see Traffic), made at its first use.
// Highest priority: when an NCCL kernel is queued, the block scheduler gives it the next
// SMs that compute kernels free instead of letting it wait behind the thousands of
// blocks of the next GEMM; a transfer that starts late stalls the peers waiting for it,
// not only this rank. NCCL's kernels take few SMs, so compute loses little.
// No lock: one host thread makes all of a process's calls into comm (communicator.h).
cudaStream_t traffic_stream(Traffic t) {
  constexpr size_t kTrafficKinds = static_cast<size_t>(Traffic::pipeline) + 1;
  static std::array<cudaStream_t, kTrafficKinds> streams{};
  cudaStream_t& s = streams[static_cast<size_t>(t)];
  if (s == nullptr) {
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  }
  return s;
}

// Queues `issue` (NCCL calls on communicator c and the stream it is given) on traffic's
// stream after the work queued so far on the current stream, which may fill its buffers,
// and marks the end for Request::wait. The host waits for neither.
template <class Issue>
cuda::Event on_traffic(Traffic t, ncclComm_t c, const Issue& issue) {
  const cudaStream_t s = traffic_stream(t);
  cuda::join(s, cuda::stream());
  issue(s, c);
  return cuda::Event::record(s);
}

// The unique id comes from rank 0 and reaches the others over MPI; a one-rank
// communicator needs no MPI at all.
ncclComm_t nccl_comm(Communicator::Impl& im, int rank, int size, const std::string& where) {
  if (im.nccl != nullptr) return im.nccl;
  ncclUniqueId id{};
  if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id), where, nullptr);
  if (size > 1) check_mpi(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, im.mpi), where + " (NCCL id broadcast)");
  NCCL_CHECK(ncclCommInitRank(&im.nccl, size, id, rank), where, nullptr);
  return im.nccl;
}
#endif

}  // namespace

// ---- launch -----------------------------------------------------------------------

Launch detect_launch(const std::function<const char*(const char*)>& env) {
  struct Source {
    const char* launcher;
    const char* rank;
    std::initializer_list<const char*> size;
    const char* local;
  };
  const Source sources[] = {
      {"Open MPI", "OMPI_COMM_WORLD_RANK", {"OMPI_COMM_WORLD_SIZE"}, "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"PMI", "PMI_RANK", {"PMI_SIZE"}, "MPI_LOCALRANKID"},
      // A batch script has SLURM_NTASKS too; the step's own count is what srun started.
      {"SLURM", "SLURM_PROCID", {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, "SLURM_LOCALID"},
      {"torchrun", "RANK", {"WORLD_SIZE"}, "LOCAL_RANK"},
  };
  for (const Source& s : sources) {
    Launch l;
    const char* size_name = nullptr;
    for (const char* n : s.size)
      if (size_name == nullptr && read_int(env, n, l.size)) size_name = n;
    if (!read_int(env, s.rank, l.rank) || size_name == nullptr) continue;
    MT_CHECK(l.size >= 1 && l.rank < l.size) << s.launcher << " variables give rank " << s.rank << "=" << l.rank
                                              << " of " << size_name << "=" << l.size;
    if (!read_int(env, s.local, l.local_rank)) l.local_rank = l.size == 1 ? 0 : -1;
    l.launcher = s.launcher;
    return l;
  }
  return Launch{};
}

// ---- ranks that share a GPU ----------------------------------------------------------

namespace {

// "rank 4", "ranks 0-3", "ranks 0-1, 4, 6-7".
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out.append(", ");
    out.append(std::to_string(ranks[i]));
    if (j > i) out.append("-").append(std::to_string(ranks[j]));
    i = j + 1;
  }
  return out;
}

}  // namespace

GpuSharing share_gpus(std::span<const RankGpu> gpus) {
  GpuSharing out;
  out.ranks_on_gpu.assign(gpus.size(), 0);
  // Each GPU's ranks, in the order of its first rank.
  std::vector<std::vector<int>> groups;
  auto first = [&](size_t g) -> const RankGpu& { return gpus[static_cast<size_t>(groups[g][0])]; };
  bool hosts = false;
  for (size_t r = 0; r < gpus.size(); ++r) {
    hosts = hosts || gpus[r].host != gpus[0].host;
    if (gpus[r].bus_id.empty()) continue;
    size_t g = 0;
    while (g < groups.size() && !(first(g).host == gpus[r].host && first(g).bus_id == gpus[r].bus_id)) ++g;
    if (g == groups.size()) groups.emplace_back();
    groups[g].push_back(static_cast<int>(r));
  }
  std::string shared;
  std::vector<int> alone;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g]) out.ranks_on_gpu[static_cast<size_t>(r)] = static_cast<int>(groups[g].size());
    if (groups[g].size() == 1) {
      alone.push_back(groups[g][0]);
      continue;
    }
    out.staged = true;
    if (!shared.empty()) shared.append(", ");
    shared.append(rank_list(groups[g])).append(" share GPU ").append(std::to_string(first(g).ordinal));
    if (hosts) shared.append(" of ").append(first(g).host);
  }
  if (!out.staged) return out;
  std::sort(alone.begin(), alone.end());
  out.text = shared;
  if (!alone.empty()) out.text.append(" (").append(rank_list(alone)).append(" alone on a GPU, staged the same way)");
  out.text.append(": GPU messages go through host memory and MPI (for testing a mesh; not fast)");
  return out;
}

// ---- Request ----------------------------------------------------------------------

Request::Request() = default;
Request::Request(std::string where) : impl_(std::make_unique<Impl>()) { impl_->where = std::move(where); }
Request::Request(Request&&) noexcept = default;

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    // The request assigned over is waited for (by old's destructor): its transfer may
    // still use its buffers.
    Request old(std::move(*this));
    impl_ = std::move(o.impl_);
  }
  return *this;
}

Request::~Request() {
  if (!impl_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    // A destructor cannot throw; a failed transfer must still not pass silently.
    std::fprintf(stderr, "%s\n", e.what());
    std::abort();
  }
}

void Request::wait() {
  if (!impl_) return;
  std::unique_ptr<Impl> im = std::move(impl_);
  if (!im->mpi.empty())
    check_mpi(MPI_Waitall(static_cast<int>(im->mpi.size()), im->mpi.data(), MPI_STATUSES_IGNORE), im->where);
  if (im->stage) im->stage->finish();
#ifdef MOETRAIN_WITH_CUDA
  if (im->done.marks()) im->done.wait(cuda::stream());
#endif
}

// ---- Communicator -----------------------------------------------------------------

Communicator::Communicator(std::string name) : name_(std::move(name)), impl_(std::make_unique<Impl>()) {}

Communicator::Communicator(std::string name, int rank, int size, std::unique_ptr<Impl> impl)
    : name_(std::move(name)), rank_(rank), size_(size), impl_(std::move(impl)) {}

Communicator::Communicator(Communicator&&) noexcept = default;

Communicator::~Communicator() {
  if (!impl_) return;
#ifdef MOETRAIN_WITH_CUDA
  if (impl_->nccl != nullptr) ncclCommDestroy(impl_->nccl);
#endif
  if (impl_->mpi != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&impl_->mpi);
}

Communicator Communicator::describing(std::string name, int rank, int size) {
  Communicator c(std::move(name), rank, size, std::make_unique<Impl>());
  c.shape_only_ = true;
  return c;
}

std::string Communicator::where(const char* op) const {
  MT_CHECK(!shape_only_) << op << " on communicator '" << name_ << "': it only describes rank " << rank_ << " of "
                         << size_ << " for planning and cannot communicate";
  return std::string(op) + " on communicator '" + name_ + "' (rank " + std::to_string(rank_) + " of " +
         std::to_string(size_) + ")";
}

bool Communicator::stages(const Tensor& t) const {
  return staging_ == Staging::every_tensor || (staging_ == Staging::gpu_tensors && t.device == Device::cuda);
}

Request Communicator::through_host(const std::vector<Tensor>& reads, const std::vector<Tensor>& writes,
                                   const std::function<Request(const Stage&)>& start) {
  auto stage = std::make_unique<Stage>(reads, writes);
  const Staging was = staging_;
  staging_ = Staging::none;
  Request r;
  try {
    r = start(*stage);
  } catch (...) {
    staging_ = was;
    throw;
  }
  staging_ = was;
  if (!r.impl_) r.impl_ = std::make_unique<Request::Impl>();
  r.impl_->stage = std::move(stage);
  return r;
}

Request Communicator::start_all_reduce(const Tensor& x, [[maybe_unused]] Traffic traffic) {
  const std::string w = where("all_reduce") + " of " + x.str();
  check_storage(x, "tensor", w);
  check_summable(x, w);
  if (stages(x)) return through_host({x}, {x}, [&](const Stage& st) { return start_all_reduce(st.view(x), traffic); });
  Request r(w);
  if (on_gpu(x, w)) {
#ifdef MOETRAIN_WITH_CUDA
    r.impl_->done = on_traffic(traffic, nccl_comm(*impl_, rank_, size_, w), [&](cudaStream_t s, ncclComm_t c) {
      NCCL_CHECK(ncclAllReduce(x.data, x.data, static_cast<size_t>(x.numel()), nccl_type(x.dtype), ncclSum, c, s), w,
                 c);
    });
#endif
    return r;
  }
  if (size_ == 1) return r;
  r.impl_->mpi.resize(1);
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, x.data, mpi_count(x.numel(), w), mpi_type(x.dtype), mpi_sum(x.dtype),
                           impl_->mpi, r.impl_->mpi.data()),
            w);
  return r;
}

Request Communicator::start_reduce_scatter(const Tensor& in, const Tensor& out, [[maybe_unused]] Traffic traffic) {
  const std::string w = where("reduce_scatter") + " of " + in.str() + " into " + out.str();
  check_pair(in, out, w);
  check_summable(in, w);
  MT_CHECK(in.numel() == size_ * out.numel()) << w << ": the input should hold " << size_ << " blocks of the output's "
                                              << out.numel() << " elements";
  if (stages(in))
    return through_host({in}, {out},
                        [&](const Stage& st) { return start_reduce_scatter(st.view(in), st.view(out), traffic); });
  Request r(w);
  if (on_gpu(in, w)) {
#ifdef MOETRAIN_WITH_CUDA
    r.impl_->done = on_traffic(traffic, nccl_comm(*impl_, rank_, size_, w), [&](cudaStream_t s, ncclComm_t c) {
      NCCL_CHECK(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()), nccl_type(in.dtype), ncclSum,
                                   c, s),
                 w, c);
    });
#endif
    return r;
  }
  if (size_ == 1) {
    if (in.data != out.data) std::memcpy(out.data, in.data, out.nbytes());
    return r;
  }
  r.impl_->mpi.resize(1);
  check_mpi(MPI_Ireduce_scatter_block(in.data, out.data, mpi_count(out.numel(), w), mpi_type(in.dtype),
                                      mpi_sum(in.dtype), impl_->mpi, r.impl_->mpi.data()),
            w);
  return r;
}

Request Communicator::start_all_gather(const Tensor& in, const Tensor& out, [[maybe_unused]] Traffic traffic) {
  const std::string w = where("all_gather") + " of " + in.str() + " into " + out.str();
  check_pair(in, out, w);
  MT_CHECK(out.numel() == size_ * in.numel()) << w << ": the output should hold " << size_ << " blocks of the input's "
                                              << in.numel() << " elements";
  if (stages(in))
    return through_host({in}, {out},
                        [&](const Stage& st) { return start_all_gather(st.view(in), st.view(out), traffic); });
  Request r(w);
  if (on_gpu(in, w)) {
#ifdef MOETRAIN_WITH_CUDA
    r.impl_->done = on_traffic(traffic, nccl_comm(*impl_, rank_, size_, w), [&](cudaStream_t s, ncclComm_t c) {
      NCCL_CHECK(ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()), nccl_type(in.dtype), c, s), w, c);
    });
#endif
    return r;
  }
  if (size_ == 1) {
    if (in.data != out.data) std::memcpy(out.data, in.data, in.nbytes());
    return r;
  }
  const int n = mpi_count(in.numel(), w);
  r.impl_->mpi.resize(1);
  check_mpi(MPI_Iallgather(in.data, n, mpi_type(in.dtype), out.data, n, mpi_type(in.dtype), impl_->mpi,
                           r.impl_->mpi.data()),
            w);
  return r;
}

Request Communicator::start_all_to_all_v(const Tensor& in, std::span<const int64_t> send_counts, const Tensor& out,
                                         std::span<const int64_t> recv_counts, [[maybe_unused]] Traffic traffic) {
  const std::string w = where("all_to_all_v") + " of " + in.str() + " into " + out.str();
  check_pair(in, out, w);
  MT_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_)
      << w << ": wants one send and one receive count per rank (" << size_ << "), got " << send_counts.size()
      << " and " << recv_counts.size();
  // Displacements are the running sums of the counts: the blocks are packed in rank order.
  std::vector<int64_t> send_at(static_cast<size_t>(size_) + 1, 0), recv_at(send_at.size(), 0);
  for (int p = 0; p < size_; ++p) {
    MT_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0)
        << w << ": negative count for rank " << p << " (send " << send_counts[p] << ", receive " << recv_counts[p] << ")";
    send_at[p + 1] = send_at[p] + send_counts[p];
    recv_at[p + 1] = recv_at[p] + recv_counts[p];
  }
  MT_CHECK(send_at[size_] == in.numel() && recv_at[size_] == out.numel())
      << w << ": the send counts add up to " << send_at[size_] << " and the receive counts to " << recv_at[size_]
      << ", but the tensors hold " << in.numel() << " and " << out.numel() << " elements";
  MT_CHECK(size_ > 1 || send_counts[0] == recv_counts[0])
      << w << ": one rank sends " << send_counts[0] << " elements to itself but expects " << recv_counts[0];
  if (stages(in))
    return through_host({in}, {out}, [&](const Stage& st) {
      return start_all_to_all_v(st.view(in), send_counts, st.view(out), recv_counts, traffic);
    });
  Request r(w);
  if (on_gpu(in, w)) {
#ifdef MOETRAIN_WITH_CUDA
    const ncclDataType_t t = nccl_type(in.dtype);
    r.impl_->done = on_traffic(traffic, nccl_comm(*impl_, rank_, size_, w), [&](cudaStream_t s, ncclComm_t c) {
      NCCL_CHECK(ncclGroupStart(), w, c);
      for (int p = 0; p < size_; ++p) {
        if (send_counts[p] > 0)
          NCCL_CHECK(ncclSend(at(in, send_at[p]), static_cast<size_t>(send_counts[p]), t, p, c, s), w, c);
        if (recv_counts[p] > 0)
          NCCL_CHECK(ncclRecv(at(out, recv_at[p]), static_cast<size_t>(recv_counts[p]), t, p, c, s), w, c);
      }
      NCCL_CHECK(ncclGroupEnd(), w, c);
    });
#endif
    return r;
  }
  if (size_ == 1) {
    if (in.data != out.data) std::memcpy(out.data, in.data, in.nbytes());
    return r;
  }
  // Send counts, send displacements, receive counts, receive displacements.
  std::vector<int>& a = r.impl_->mpi_counts;
  a.resize(4 * static_cast<size_t>(size_));
  int *sc = a.data(), *sd = sc + size_, *rc = sd + size_, *rd = rc + size_;
  for (int p = 0; p < size_; ++p) {
    sc[p] = mpi_count(send_counts[p], w);
    sd[p] = mpi_count(send_at[p], w);
    rc[p] = mpi_count(recv_counts[p], w);
    rd[p] = mpi_count(recv_at[p], w);
  }
  const MPI_Datatype t = mpi_type(in.dtype);
  r.impl_->mpi.resize(1);
  check_mpi(MPI_Ialltoallv(in.data, sc, sd, t, out.data, rc, rd, t, impl_->mpi, r.impl_->mpi.data()), w);
  return r;
}

void Communicator::broadcast(const Tensor& x, int root) {
  const std::string w = where("broadcast") + " of " + x.str() + " from rank " + std::to_string(root);
  check_storage(x, "tensor", w);
  MT_CHECK(root >= 0 && root < size_) << w << ": the root is not a rank of the communicator";
  if (stages(x)) {
    through_host({x}, {x}, [&](const Stage& st) {
      broadcast(st.view(x), root);
      return Request();
    }).wait();
    return;
  }
  if (on_gpu(x, w)) {
#ifdef MOETRAIN_WITH_CUDA
    ncclComm_t c = nccl_comm(*impl_, rank_, size_, w);
    NCCL_CHECK(ncclBroadcast(x.data, x.data, static_cast<size_t>(x.numel()), nccl_type(x.dtype), root, c,
                             cuda::stream()),
               w, c);
#endif
    return;
  }
  if (size_ == 1) return;
  check_mpi(MPI_Bcast(x.data, mpi_count(x.numel(), w), mpi_type(x.dtype), root, impl_->mpi), w);
}

void Communicator::barrier() {
  if (size_ == 1) return;
  check_mpi(MPI_Barrier(impl_->mpi), where("barrier"));
}

std::string broadcast_text(Communicator& c, const std::string& text, int root) {
  std::vector<int64_t> length = {static_cast<int64_t>(text.size())};
  c.broadcast(Tensor(length.data(), {1}, DType::i64), root);
  std::string out = c.rank() == root ? text : std::string(static_cast<size_t>(length[0]), '\0');
  c.broadcast(Tensor(out.data(), {length[0]}, DType::u8), root);
  return out;
}

void sum_in_rank_order(Communicator* c, std::vector<double>& v) {
  if (!c || v.empty()) return;
  const int64_t n = static_cast<int64_t>(v.size()), ranks = c->size();
  std::vector<int64_t> mine(v.size()), all(static_cast<size_t>(n * ranks));
  std::memcpy(mine.data(), v.data(), v.size() * sizeof(double));
  c->all_gather(Tensor(mine.data(), {n}, DType::i64), Tensor(all.data(), {n * ranks}, DType::i64));
  std::fill(v.begin(), v.end(), 0.0);
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < n; ++i)
      v[static_cast<size_t>(i)] += std::bit_cast<double>(all[static_cast<size_t>(r * n + i)]);
}

Request Communicator::start(std::span<const P2P> ops, [[maybe_unused]] Traffic traffic) {
  std::string w = where("send/recv batch") + " [";
  for (const P2P& op : ops)
    w += std::string(op.send ? " send " : " recv ") + op.tensor.str() + (op.send ? " to " : " from ") +
         std::to_string(op.peer);
  w += " ]";
  for (const P2P& op : ops) {
    check_storage(op.tensor, "tensor", w);
    MT_CHECK(op.peer >= 0 && op.peer < size_) << w << ": peer " << op.peer << " is not a rank of the communicator";
    MT_CHECK(op.tensor.device == ops[0].tensor.device) << w << ": a batch is all on the CPU or all on the GPU";
  }
  if (ops.empty()) return Request();
  if (stages(ops[0].tensor)) {
    std::vector<Tensor> sends, recvs;
    for (const P2P& op : ops) (op.send ? sends : recvs).push_back(op.tensor);
    return through_host(sends, recvs, [&](const Stage& st) {
      std::vector<P2P> host(ops.begin(), ops.end());
      for (P2P& op : host) op.tensor = st.view(op.tensor);
      return start(host, traffic);
    });
  }
  Request r(w);
  if (on_gpu(ops[0].tensor, w)) {
#ifdef MOETRAIN_WITH_CUDA
    r.impl_->done = on_traffic(traffic, nccl_comm(*impl_, rank_, size_, w), [&](cudaStream_t s, ncclComm_t c) {
      NCCL_CHECK(ncclGroupStart(), w, c);
      for (const P2P& op : ops) {
        const size_t n = static_cast<size_t>(op.tensor.numel());
        if (op.send)
          NCCL_CHECK(ncclSend(op.tensor.data, n, nccl_type(op.tensor.dtype), op.peer, c, s), w, c);
        else
          NCCL_CHECK(ncclRecv(op.tensor.data, n, nccl_type(op.tensor.dtype), op.peer, c, s), w, c);
      }
      NCCL_CHECK(ncclGroupEnd(), w, c);
    });
#endif
    return r;
  }
  if (size_ == 1) {
    // Messages to oneself: the i-th send is the i-th receive, as MPI would match them.
    std::vector<const P2P*> sends, recvs;
    for (const P2P& op : ops) (op.send ? sends : recvs).push_back(&op);
    MT_CHECK(sends.size() == recvs.size()) << w << ": " << sends.size() << " sends to oneself but " << recvs.size()
                                           << " receives";
    for (size_t i = 0; i < sends.size(); ++i) {
      const Tensor& a = sends[i]->tensor;
      const Tensor& b = recvs[i]->tensor;
      MT_CHECK(a.nbytes() == b.nbytes() && a.dtype == b.dtype) << w << ": message " << i << " sends " << a.str()
                                                                << " into " << b.str();
      if (a.data != b.data) std::memcpy(b.data, a.data, a.nbytes());
    }
    return r;
  }
  r.impl_->mpi.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2P& op = ops[i];
    const int n = mpi_count(op.tensor.numel(), w);
    const MPI_Datatype t = mpi_type(op.tensor.dtype);
    if (op.send)
      check_mpi(MPI_Isend(op.tensor.data, n, t, op.peer, 0, impl_->mpi, &r.impl_->mpi[i]), w);
    else
      check_mpi(MPI_Irecv(op.tensor.data, n, t, op.peer, 0, impl_->mpi, &r.impl_->mpi[i]), w);
  }
  return r;
}

Communicator Communicator::split(int color, int key, std::string name) {
  auto im = std::make_unique<Impl>();
  int rank = 0, size = 1;
  if (size_ > 1) {
    const std::string w = where("split") + " into '" + name + "'";
    check_mpi(MPI_Comm_split(impl_->mpi, color, key, &im->mpi), w);
    check_mpi(MPI_Comm_set_errhandler(im->mpi, MPI_ERRORS_RETURN), w);
    MPI_Comm_rank(im->mpi, &rank);
    MPI_Comm_size(im->mpi, &size);
  }
  Communicator out(std::move(name), rank, size, std::move(im));
  out.staging_ = staging_;
  return out;
}

void Communicator::init_gpu() {
  const std::string w = where("init_gpu");
#ifdef MOETRAIN_WITH_CUDA
  if (staging_ == Staging::none) nccl_comm(*impl_, rank_, size_, w);
#else
  MT_FAIL() << w << ": moetrain was built without CUDA, so there is no NCCL";
#endif
}

// ---- World ------------------------------------------------------------------------

World::World() {
  launch_ = detect_launch([](const char* n) -> const char* { return std::getenv(n); });
  if (launch_.size == 1) {
    launch_.local_rank = 0;
    comm_.reset(new Communicator("world"));
    return;
  }
  const std::string setup =
      "MPI setup of " + launch_.launcher + " rank " + std::to_string(launch_.rank) + " of " + std::to_string(launch_.size);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
    // Only the thread that called MPI_Init makes MPI calls; OpenMP threads compute.
    int provided = 0;
#ifdef MT_LSAN
    // `make sanitize`: what Open MPI allocates and drops while it starts (components it
    // opens and unloads) is not this program's to report; see ~World for the rest.
    __lsan_disable();
#endif
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
#ifdef MT_LSAN
    __lsan_enable();
#endif
    MT_CHECK(rc == MPI_SUCCESS) << setup << ": MPI_Init_thread failed";
    finalize_ = true;
    MT_CHECK(provided >= MPI_THREAD_FUNNELED) << setup << ": MPI provides thread level " << provided
                                              << ", below MPI_THREAD_FUNNELED";
  }
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), setup);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MT_CHECK(rank == launch_.rank && size == launch_.size)
      << launch_.launcher << " says rank " << launch_.rank << " of " << launch_.size << ", but MPI says rank " << rank
      << " of " << size << ": start the ranks with mpirun or srun, whose runtime connects them";
  set_check_rank(rank);
  if (launch_.local_rank < 0) {
    // The launcher did not say: the ranks sharing this node's memory number themselves.
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node), setup);
    MPI_Comm_rank(node, &launch_.local_rank);
    MPI_Comm_free(&node);
  }
  // Which GPU this rank drives, chosen before anything makes CUDA state on the default
  // device (GPUs local_rank % count); every rank learns every other's, to see which share.
  RankGpu mine;
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  mine.host = name;
#ifdef MOETRAIN_WITH_CUDA
  cuda::select_device(launch_.local_rank);
  mine.ordinal = cuda::current_device();
  char bus[64] = {};
  if (mine.ordinal >= 0) CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus - 1, mine.ordinal));
  mine.bus_id = bus;
#endif
  constexpr int kField = 256;
  std::vector<char> packed(3 * kField, '\0'), all(packed.size() * static_cast<size_t>(size));
  std::snprintf(packed.data(), kField, "%s", mine.host.c_str());
  std::snprintf(packed.data() + kField, kField, "%d", mine.ordinal);
  std::snprintf(packed.data() + 2 * kField, kField, "%s", mine.bus_id.c_str());
  check_mpi(MPI_Allgather(packed.data(), 3 * kField, MPI_CHAR, all.data(), 3 * kField, MPI_CHAR, MPI_COMM_WORLD),
            setup + " (which GPU each rank drives)");
  std::vector<RankGpu> gpus(static_cast<size_t>(size));
  for (size_t r = 0; r < gpus.size(); ++r) {
    const char* f = all.data() + r * 3 * kField;
    gpus[r] = {std::string(f, strnlen(f, kField)), std::atoi(f + kField),
               std::string(f + 2 * kField, strnlen(f + 2 * kField, kField))};
  }
  sharing_ = share_gpus(gpus);
  check_mpi(MPI_Op_create(bf16_sum, 1, &g_bf16_sum), setup);
  // A private copy of MPI_COMM_WORLD, so our messages never match another library's.
  auto im = std::make_unique<Communicator::Impl>();
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &im->mpi), setup);
  check_mpi(MPI_Comm_set_errhandler(im->mpi, MPI_ERRORS_RETURN), setup);
  comm_.reset(new Communicator("world", rank, size, std::move(im)));
  if (sharing_.staged) comm_->set_staging(Staging::gpu_tensors);
}

World::~World() {
  comm_.reset();
#ifdef MT_LSAN
  // The leak check runs here, before MPI_Finalize frees and unloads what Open MPI holds,
  // so nothing of its counts as leaked and the reports need no deep stacks to be told
  // apart (LSAN_OPTIONS keeps the fast unwinder: Makefile, sanitize). LSan checks once.
  if (finalize_ && !mpi_finalized()) __lsan_do_leak_check();
#endif
  if (g_bf16_sum != MPI_OP_NULL && !mpi_finalized()) MPI_Op_free(&g_bf16_sum);
  if (finalize_ && !mpi_finalized()) MPI_Finalize();
}

void World::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized != 0 && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

World& world() {
  static World w;
  return w;
}

}  // namespace mt::comm
