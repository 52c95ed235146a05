// What every CUDA kernel file shares: the stream work goes to and the device buffers
// tied to it, the cuBLASLt handle, host<->device copies, argument checks, and error
// checks that report through mt::Error.
//
//   CUDA_CHECK(cudaMemcpyAsync(...));   // throws: call, file, line, CUDA's error string
//   kernel<<<grid, block, 0, stream()>>>(...);
//   CUDA_CHECK_LAUNCH();                // a bad launch is reported at the launch site
//
// Streams. Every kernel, copy and library call goes to stream(): the current stream,
// which is the backend's main stream (main_stream()) unless a StreamScope names another.
// Work on one stream is ordered without events; between streams, join() or an Event
// orders it.
//
//   cuda::StreamScope scope(second);     // ops now queue on `second`
//   cuda::join(second, cuda::main_stream());  // ... after what the main stream has queued
//
// What is per stream: scratch(), the cuBLASLt workspace, the grouped GEMM's workspace
// and cuDNN's workspace (scratch) are one buffer per stream they are used on, so two
// streams running at once never share one; synchronize() and copy() wait for the
// current stream only; stream_alloc hands out memory ordered on the current stream.
// What is per process: the main stream, the cuBLASLt handle, cuDNN's handle (set to the
// current stream at each call), the plan caches and the event pool, unlocked: one host
// thread drives the backend. Streams given to StreamScope must live as long as the
// process or be synchronised before they are destroyed: their buffers are kept under the
// stream's handle, which CUDA may hand out again.
//
// One process drives one GPU (one rank per GPU), so this state belongs to the device
// that was current at first use.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace mt::cuda {

[[noreturn]] void fail_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line);

// The backend's own stream, created at first use. Non-blocking: it does not serialise
// with the legacy default stream (a library's or a test's stray cudaMemcpy would
// otherwise stall it); the arena's allocations synchronise before they are handed out.
cudaStream_t main_stream();
// The current stream: main_stream() outside any StreamScope.
cudaStream_t stream();

// Makes `s` the current stream until the scope ends, then restores the
// one before (scopes nest).
class StreamScope {
 public:
  explicit StreamScope(cudaStream_t s);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  cudaStream_t previous_;
};

// A point in a stream's queue that other streams can wait for: an event without timing,
// from a process-wide pool, and back in it when destroyed. A wait already queued keeps
// the point it was given, so the Event may be destroyed or recorded again right after.
class Event {
 public:
  Event() = default;  // marks nothing; waiting for it does nothing
  // What `s` has queued so far.
  static Event record(cudaStream_t s);
  // `s` runs nothing more until the marked work is done (the host does not wait).
  void wait(cudaStream_t s) const;
  // A mark that keeps its time (a pool of its own), and the device's milliseconds from
  // `a` to `b`, both timed; the host waits for b first.
  static Event record_timed(cudaStream_t s);
  static float elapsed_ms(const Event& a, const Event& b);
  // Whether it marks anything (a CPU transfer's Request has nothing to wait for, and
  // must not touch the CUDA runtime: the machine may have no GPU).
  bool marks() const { return e_ != nullptr; }
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

 private:
  explicit Event(cudaEvent_t e, bool timed = false) : e_(e), timed_(timed) {}
  cudaEvent_t e_ = nullptr;
  bool timed_ = false;
};

// `waiter` runs nothing more until what `producer` has queued so far is done; later work
// on `producer` is not waited for. Nothing when they are the same stream.
void join(cudaStream_t waiter, cudaStream_t producer);

// Waits (on the host) for everything queued on the current stream.
void synchronize();
// Times the host has waited for the device (synchronize, and the expert plan's
// count reads), since the process started: metrics.jsonl reports it per step.
void count_host_wait();
int64_t host_waits();

cublasLtHandle_t blaslt();
// cuBLASLt's workspace: 32 MiB, what NVIDIA recommends on Hopper; the current stream's.
constexpr size_t kBlasltWorkspaceBytes = size_t{32} << 20;
void* blaslt_workspace();

// Device buffers kept per stream, one of each kind for every stream that asks: a buffer
// of at least `bytes`, grown (stream-ordered: the old one is freed after the work queued
// on the stream that used it) when a larger one is asked for, on the first step of a
// run, and reused after that, so a steady-state step allocates nothing. Valid until the
// next call for the same kind on the same stream; work on one stream is ordered, so
// consecutive ops can each use it.
enum class StreamBuffer : uint8_t { scratch, blaslt, grouped_gemm };
void* stream_buffer(StreamBuffer kind, size_t bytes);

// The current stream's buffer for the partial results of multi-pass reductions (loss
// sums, norms, column sums) and cuDNN's workspace.
inline void* scratch(size_t bytes) { return stream_buffer(StreamBuffer::scratch, bytes); }

// Device memory ordered on the current stream, for temporaries whose size is known only
// at run time (the expert-parallel plans and transfers, ring attention's blocks): usable
// at once by work queued on that stream (or on a stream ordered after it). stream_free
// returns it to the pool once the work queued so far on the stream that allocated it
// and on the current stream is done (on a stream of its own when those differ, so
// neither waits for the other), with no host synchronisation either way. Work on other
// streams that used it must be joined into one of those two first. From the device's
// default pool, told to keep what is freed for the next request. stream_free(nullptr)
// does nothing and never throws (it runs in destructors).
void* stream_alloc(size_t bytes);
void stream_free(void* p);

// One process drives one GPU: the ranks of a node take GPUs local_rank % count. Called
// by the world's setup (comm::World) for multi-rank runs, before any CUDA state exists
// (streams, pools, NCCL communicators belong to the device current when they are
// made). Without a usable GPU it does nothing: a CPU run needs none.
void select_device(int local_rank);

// dst = src, same dtype and element count, any pair of devices, on the current stream.
// Synchronises that stream when either side is host memory, so the host buffer is free
// (or filled) on return.
void copy(const Tensor& dst, const Tensor& src);

// A kernel argument: on the GPU, one of `allowed` dtypes, exactly `shape`, with storage.
void check_arg(const Tensor& t, const char* name, std::initializer_list<DType> allowed, Shape shape);

int sm_count();

}  // namespace mt::cuda

#define CUDA_CHECK(call)                                                     \
  do {                                                                       \
    cudaError_t mt_cuda_err_ = (call);                                       \
    if (mt_cuda_err_ != cudaSuccess) ::mt::cuda::fail_cuda(mt_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(call)                                                   \
  do {                                                                       \
    cublasStatus_t mt_cublas_st_ = (call);                                   \
    if (mt_cublas_st_ != CUBLAS_STATUS_SUCCESS)                              \
      ::mt::cuda::fail_cublas(mt_cublas_st_, #call, __FILE__, __LINE__);     \
  } while (0)

// After each launch: a bad configuration is reported where the kernel was launched,
// not at whichever call happens to come next.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
