#include "kernels/cuda/runtime.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/cuda/device.h"

namespace mt::cuda {

void fail_cuda(cudaError_t e, const char* call, const char* file, int line) {
  const bool no_gpu = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver;
  ::mt::CheckFailure(call, file, line) << (no_gpu ? "there is no usable GPU here: " : "") << "CUDA error "
                                       << cudaGetErrorName(e) << ": " << cudaGetErrorString(e);
  __builtin_unreachable();  // CheckFailure's destructor throws
}

void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  ::mt::CheckFailure(call, file, line) << "cuBLAS error " << cublasLtGetStatusName(s) << ": "
                                       << cublasLtGetStatusString(s);
  __builtin_unreachable();
}

// The handles and tables below live for the whole process and are never destroyed: at
// static destruction the CUDA runtime may already be gone, and destroying them then
// fails.
namespace {

cudaStream_t t_current = nullptr;  // null: the main stream
std::atomic<int64_t> g_host_waits{0};

// Events for ordering only, reused: creating one per cross-stream wait would cost a
// driver call each time on the step's path. Two pools: marks without timing (the cheap ones) and timed marks.
std::vector<cudaEvent_t>& free_events(bool timed) {
  static auto* v = new std::vector<cudaEvent_t>[2];
  return v[timed ? 1 : 0];
}

cudaError_t take_event(cudaEvent_t& e, bool timed = false) {
  if (!free_events(timed).empty()) {
    e = free_events(timed).back();
    free_events(timed).pop_back();
    return cudaSuccess;
  }
  return cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming);
}

void give_event(cudaEvent_t e, bool timed = false) noexcept {
  if (e == nullptr) return;
  free_events(timed).push_back(e);
}

// The stream that frees memory let go of on a stream other than its own (stream_free),
// made before the first allocation so that stream_free creates nothing and cannot fail
// to. The first call also sets the default pool's release threshold, 0, which hands
// freed memory back to the driver at every synchronisation, to keep it instead, as the
// arenas' pool does.
cudaStream_t release_stream() {
  static const cudaStream_t release = [] {
    int dev = 0;
    cudaMemPool_t pool = nullptr;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return release;
}

// Which stream each stream_alloc block was allocated on, for its free.
std::unordered_map<void*, cudaStream_t>& allocs() {
  static auto* m = new std::unordered_map<void*, cudaStream_t>();
  return *m;
}

constexpr size_t kStreamBufferKinds = 3;
struct StreamBuffers {
  cudaStream_t stream;
  std::array<void*, kStreamBufferKinds> data{};
  std::array<size_t, kStreamBufferKinds> capacity{};
};

}  // namespace

cudaStream_t main_stream() {
  static cudaStream_t s = [] {
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

cudaStream_t stream() { return t_current != nullptr ? t_current : main_stream(); }

StreamScope::StreamScope(cudaStream_t s) : previous_(t_current) {
  MT_CHECK(s != nullptr) << "StreamScope wants a stream the caller created, got the legacy default stream (null), "
                            "which would serialise with every blocking stream";
  t_current = s;
}

StreamScope::~StreamScope() { t_current = previous_; }

Event Event::record(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  CUDA_CHECK(take_event(e));
  Event marked(e);
  CUDA_CHECK(cudaEventRecord(e, s));
  return marked;
}

void Event::wait(cudaStream_t s) const {
  if (e_ != nullptr) CUDA_CHECK(cudaStreamWaitEvent(s, e_, 0));
}

Event Event::record_timed(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  CUDA_CHECK(take_event(e, true));
  Event marked(e, true);
  CUDA_CHECK(cudaEventRecord(e, s));
  return marked;
}

float Event::elapsed_ms(const Event& a, const Event& b) {
  MT_CHECK(a.timed_ && b.timed_) << "Event::elapsed_ms of marks without timing";
  CUDA_CHECK(cudaEventSynchronize(b.e_));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, a.e_, b.e_));
  return ms;
}

Event::~Event() { give_event(e_, timed_); }

Event::Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)), timed_(std::exchange(o.timed_, false)) {}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    give_event(e_, timed_);
    e_ = std::exchange(o.e_, nullptr);
    timed_ = std::exchange(o.timed_, false);
  }
  return *this;
}

void join(cudaStream_t waiter, cudaStream_t producer) {
  if (waiter != producer) Event::record(producer).wait(waiter);
}

void count_host_wait() { ++g_host_waits; }
int64_t host_waits() { return g_host_waits.load(); }

void synchronize() {
  count_host_wait();
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

cublasLtHandle_t blaslt() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t created = nullptr;
    CUBLAS_CHECK(cublasLtCreate(&created));
    return created;
  }();
  return h;
}

void* blaslt_workspace() { return stream_buffer(StreamBuffer::blaslt, kBlasltWorkspaceBytes); }

void* stream_buffer(StreamBuffer kind, size_t bytes) {
  static auto* table = new std::vector<StreamBuffers>();
  release_stream();
  const cudaStream_t s = stream();
  const size_t k = static_cast<size_t>(kind);
  auto it = std::find_if(table->begin(), table->end(), [&](const StreamBuffers& b) { return b.stream == s; });
  if (it == table->end()) it = table->insert(table->end(), StreamBuffers{s});
  if (bytes > it->capacity[k]) {
    // Only work on s used the old buffer, and it is queued before this free.
    if (it->data[k] != nullptr) CUDA_CHECK(cudaFreeAsync(it->data[k], s));
    it->data[k] = nullptr;
    it->capacity[k] = 0;
    CUDA_CHECK(cudaMallocAsync(&it->data[k], bytes, s));
    it->capacity[k] = bytes;
  }
  return it->data[k];
}

void* stream_alloc(size_t bytes) {
  release_stream();
  if (bytes == 0) return nullptr;
  const cudaStream_t s = stream();
  void* p = nullptr;
  CUDA_CHECK(cudaMallocAsync(&p, bytes, s));
  allocs()[p] = s;
  return p;
}

void stream_free(void* p) {
  if (p == nullptr) return;
  const cudaStream_t now = stream();
  cudaStream_t born = now;
  if (auto it = allocs().find(p); it != allocs().end()) {
    born = it->second;
    allocs().erase(it);
  }
  if (born == now) {
    cudaFreeAsync(p, now);
    return;
  }
  // Let go of on another stream than its own: freed on the release stream after both
  // (runtime.h). Nothing throws; a failed wait leaves the memory out of the pool rather than reused early.
  const cudaStream_t release = release_stream();
  cudaEvent_t e = nullptr;
  bool ordered = take_event(e) == cudaSuccess;
  for (cudaStream_t s : {born, now})
    ordered = ordered && cudaEventRecord(e, s) == cudaSuccess && cudaStreamWaitEvent(release, e, 0) == cudaSuccess;
  give_event(e);
  if (ordered) cudaFreeAsync(p, release);
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
  const bool dtype_ok = std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end();
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
