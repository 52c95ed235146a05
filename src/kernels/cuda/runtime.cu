#include "kernels/cuda/runtime.h"

#include <cstdint>
#include <sstream>

#include "core/arena.h"
#include "kernels/cuda/device.h"

namespace mt::cuda {

void fail_cuda(cudaError_t e, const char* call, const char* file, int line) {
  ::mt::CheckFailure(call, file, line) << "CUDA error " << cudaGetErrorName(e) << ": " << cudaGetErrorString(e);
  __builtin_unreachable();  // CheckFailure's destructor throws
}

void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  ::mt::CheckFailure(call, file, line) << "cuBLAS error " << cublasLtGetStatusName(s) << ": "
                                       << cublasLtGetStatusString(s);
  __builtin_unreachable();
}

// The handles below live for the whole process and are never destroyed: at static
// destruction the CUDA runtime may already be gone, and destroying them then fails.
cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

void synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream())); }

cublasLtHandle_t blaslt() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t created = nullptr;
    CUBLAS_CHECK(cublasLtCreate(&created));
    return created;
  }();
  return h;
}

void* blaslt_workspace() {
  static void* w = device_alloc(Device::cuda, kBlasltWorkspaceBytes);
  return w;
}

void* scratch(size_t bytes) {
  static void* buffer = nullptr;
  static size_t capacity = 0;
  if (bytes > capacity) {
    // device_free waits for the device, so no queued kernel still reads the old buffer.
    device_free(Device::cuda, buffer);
    capacity = bytes;
    buffer = device_alloc(Device::cuda, capacity);
  }
  return buffer;
}

void* stream_alloc(size_t bytes) {
  // The default pool's release threshold is 0, which hands freed memory back to the
  // driver at every synchronisation; keep it instead, as the arenas' pool does.
  static const bool kept = [] {
    int dev = 0;
    cudaMemPool_t pool = nullptr;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return true;
  }();
  (void)kept;
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  CUDA_CHECK(cudaMallocAsync(&p, bytes, stream()));
  return p;
}

void stream_free(void* p) {
  if (p != nullptr) cudaFreeAsync(p, stream());
}

void select_device(int local_rank) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // no driver or no GPU: clear the error, stay on the CPU
    return;
  }
  CUDA_CHECK(cudaSetDevice(local_rank % count));
  note_memory_baseline();
}

void copy(const Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel())
      << "copy needs the same dtype and element count: dst " << dst.str() << ", src " << src.str();
  if (dst.numel() == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDefault, stream()));
  if (dst.device == Device::cpu || src.device == Device::cpu) synchronize();
}

void check_arg(const Tensor& t, const char* name, std::initializer_list<DType> allowed, Shape shape) {
  bool dtype_ok = false;
  for (DType d : allowed) dtype_ok = dtype_ok || t.dtype == d;
  bool ok = dtype_ok && t.shape == shape && t.device == Device::cuda && (t.data != nullptr || shape.numel() == 0);
  if (ok) return;
  std::ostringstream want;
  const char* sep = "";
  for (DType d : allowed) {
    want << sep << dtype_name(d);
    sep = "|";
  }
  MT_FAIL() << name << " should be " << want.str() << shape.str() << "@cuda, got " << t.str()
            << (t.data == nullptr && shape.numel() != 0 ? " without storage" : "");
}

int sm_count() {
  static int n = [] {
    int dev = 0, count = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return n;
}

}  // namespace mt::cuda
