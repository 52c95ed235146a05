// What every CUDA kernel file shares: the stream the backend runs on, the cuBLASLt
// handle and its workspace, a scratch buffer for multi-pass reductions, host<->device
// copies, argument checks, and error checks that report through mt::Error.
//
//   CUDA_CHECK(cudaMemcpyAsync(...));   // throws: call, file, line, CUDA's error string
//   kernel<<<grid, block, 0, stream()>>>(...);
//   CUDA_CHECK_LAUNCH();                // a bad launch is reported at the launch site
//
// One process drives one GPU (one rank per GPU), so this state is per process and
// belongs to the device that was current at first use.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <initializer_list>

#include "core/tensor.h"

namespace mt::cuda {

[[noreturn]] void fail_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line);

// Every kernel, copy and cuBLASLt call of the backend runs on this one stream, so the
// backend's work is ordered without events. Non-blocking: it does not serialise with
// the legacy default stream (a library's or a test's stray cudaMemcpy would otherwise
// stall it); the arena's allocations synchronise before they are handed out.
cudaStream_t stream();
void synchronize();  // waits for everything queued on stream()

cublasLtHandle_t blaslt();
// cuBLASLt's workspace: 32 MiB, what NVIDIA recommends on Hopper.
constexpr size_t kBlasltWorkspaceBytes = size_t{32} << 20;
void* blaslt_workspace();

// A device buffer of at least `bytes` for the partial results of multi-pass reductions
// (loss sums, norms, column sums). It grows when a larger one is asked for (the first
// step of a run) and is then reused, so a steady-state step allocates nothing. Valid
// until the next call; work queued on stream() is ordered, so consecutive ops can
// each use it.
void* scratch(size_t bytes);

// Device memory ordered on stream(), for temporaries whose size is known only at run
// time (the expert-parallel plans and transfers, ring attention's blocks): usable at
// once by work queued on stream() (or on a stream ordered after it), and back in the
// pool once the work queued before stream_free is done, with no synchronisation
// either way. From the device's default pool, told to keep what is freed for the next
// request. stream_free(nullptr) does nothing and never throws (it runs in destructors).
void* stream_alloc(size_t bytes);
void stream_free(void* p);

// One process drives one GPU: the ranks of a node take GPUs local_rank % count. Called
// by the world's setup (comm::World) for multi-rank runs, before any CUDA state exists
// (streams, pools, NCCL communicators belong to the device current when they are
// made). Without a usable GPU it does nothing: a CPU run needs none.
void select_device(int local_rank);

// dst = src, same dtype and element count, any pair of devices. Synchronises when
// either side is host memory, so the host buffer is free (or filled) on return.
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
