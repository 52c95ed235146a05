#include "core/arena.h"

#include <cstdint>
#include <cstdlib>
#include <unistd.h>
#include <utility>

#ifdef MOETRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

#ifdef MOETRAIN_WITH_CUDA
// One stream-ordered pool for the process's GPU (the device current at first use).
// Its release threshold is unbounded, so a freed arena's memory stays in the pool for
// the next one instead of going back to the driver; allocations are queued on the
// legacy stream and synchronised, so a block is ready for any stream once handed out.
static cudaMemPool_t cuda_pool() {
  static cudaMemPool_t pool = [] {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t p = nullptr;
    if (e == cudaSuccess) e = cudaMemPoolCreate(&p, &props);
    uint64_t keep = UINT64_MAX;
    if (e == cudaSuccess) e = cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep);
    MT_CHECK(e == cudaSuccess) << "creating the GPU memory pool: " << cudaGetErrorString(e);
    return p;
  }();
  return pool;
}
#endif

size_t available_host_memory() {
  if (const char* bytes = std::getenv("MOETRAIN_HOST_MEMORY_BYTES")) return std::strtoull(bytes, nullptr, 10);
  return static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

void require_gpu(const std::string& what) {
#ifdef MOETRAIN_WITH_CUDA
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) cudaGetLastError();
  MT_CHECK(e == cudaSuccess && count > 0)
      << what << ", but there is no usable GPU here (" << (e == cudaSuccess ? "no CUDA device" : cudaGetErrorString(e))
      << "); use the CPU, or a machine with an NVIDIA Hopper GPU and a driver for CUDA 13";
#else
  MT_FAIL() << what << ", but there is no usable GPU: this moetrain was built without CUDA (CPU backend only; "
            << "build it where nvcc is, make CUDA=ON), so use the CPU";
#endif
}

void* device_alloc(Device device, size_t bytes) {
  if (bytes == 0) return nullptr;
  if (device == Device::cpu) {
    // Refused before allocating: past the machine's memory the kernel would let it
    // through (overcommit) and kill the process later, somewhere else.
    const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
    MT_CHECK(static_cast<double>(bytes) <= physical)
        << "planned host memory of " << static_cast<double>(bytes) / (1 << 30) << " GiB (" << bytes
        << " bytes) in one block is more than this machine's " << physical / (1 << 30) << " GiB; a smaller model, "
        << "or more ranks to shard it (moetrain plan shows what each rank holds)";
    void* p = std::aligned_alloc(Arena::kAlign, (bytes + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign);
    MT_CHECK(p != nullptr) << "out of host memory allocating " << bytes << " bytes";
    return p;
  }
#ifdef MOETRAIN_WITH_CUDA
  void* p = nullptr;
  cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, cuda_pool(), cudaStreamLegacy);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
  MT_CHECK(e == cudaSuccess) << "GPU allocation of " << bytes << " bytes from the stream-ordered pool: "
                             << cudaGetErrorString(e);
  return p;
#else
  MT_FAIL() << "a cuda tensor was requested but this moetrain was built without CUDA (-DMOETRAIN_CUDA=OFF or no nvcc)";
  return nullptr;
#endif
}

void device_free(Device device, void* p) {
  if (p == nullptr) return;
  if (device == Device::cpu) {
    std::free(p);
    return;
  }
#ifdef MOETRAIN_WITH_CUDA
  // Kernels on any stream may still use the block: wait for them before it goes back to
  // the pool, where the next allocation may reuse it at once.
  cudaDeviceSynchronize();
  cudaFreeAsync(p, cudaStreamLegacy);
#endif
}

Arena::Arena(std::string name, Device device, size_t capacity_bytes)
    : name_(std::move(name)), device_(device), capacity_(capacity_bytes) {
  base_ = static_cast<char*>(device_alloc(device, capacity_bytes));
}

Arena Arena::host(std::string name, size_t capacity_bytes, bool pinned) {
#ifdef MOETRAIN_WITH_CUDA
  if (pinned && capacity_bytes > 0) {
    Arena a;
    a.name_ = std::move(name);
    a.capacity_ = capacity_bytes;
    a.pinned_ = true;
    const cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&a.base_), capacity_bytes, cudaHostAllocDefault);
    MT_CHECK(e == cudaSuccess) << "page-locking " << static_cast<double>(capacity_bytes) / (1 << 30) << " GiB ("
                               << capacity_bytes << " bytes) of host memory for '" << a.name_
                               << "': " << cudaGetErrorString(e) << "; moetrain plan shows what each rank holds";
    return a;
  }
#endif
  (void)pinned;
  return Arena(std::move(name), Device::cpu, capacity_bytes);
}

Arena Arena::counting(std::string name, Device device) {
  Arena a;
  a.name_ = std::move(name);
  a.device_ = device;
  a.counting_ = true;
  return a;
}

static void release(Device device, void* base, bool pinned) {
#ifdef MOETRAIN_WITH_CUDA
  if (pinned && base != nullptr) {
    cudaDeviceSynchronize();  // copies on any stream may still read or write it
    cudaFreeHost(base);
    return;
  }
#endif
  (void)pinned;
  device_free(device, base);
}

Arena::~Arena() { release(device_, base_, pinned_); }

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    release(device_, base_, pinned_);
    name_ = std::move(o.name_);
    device_ = o.device_;
    base_ = std::exchange(o.base_, nullptr);
    capacity_ = std::exchange(o.capacity_, 0);
    used_ = std::exchange(o.used_, 0);
    peak_ = std::exchange(o.peak_, 0);
    counting_ = o.counting_;
    pinned_ = o.pinned_;
  }
  return *this;
}

Tensor Arena::alloc(DType dtype, Shape shape) {
  size_t bytes = 0, start = (used_ + kAlign - 1) / kAlign * kAlign, end = 0;
  MT_CHECK(!__builtin_mul_overflow(static_cast<size_t>(shape.numel()), dtype_size(dtype), &bytes) &&
           !__builtin_add_overflow(start, bytes, &end))
      << "arena '" << name_ << "': " << dtype_name(dtype) << shape.str() << " at offset " << start
      << " needs more bytes than fit in 64 bits";
  MT_CHECK(counting_ || end <= capacity_) << "arena '" << name_ << "' is full: " << dtype_name(dtype) << shape.str()
                                          << " needs " << bytes << " bytes at offset " << start << " of " << capacity_;
  used_ = end;
  if (used_ > peak_) peak_ = used_;
  return Tensor(counting_ ? nullptr : base_ + start, shape, dtype, device_);
}

}  // namespace mt
