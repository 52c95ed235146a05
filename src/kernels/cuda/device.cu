// CUDA device discovery for `moetrain --version` and the trainer's device choice, and the
// device memory this process holds (device.h).
#include "kernels/cuda/device.h"

#include <utility>

namespace mt::cuda {

namespace {

// Touches the device once so a broken driver/runtime pairing is found at start-up.
__global__ void probe_kernel(int* out) { *out = 1; }

// cudaMemGetInfo's free and total bytes; zeros without a GPU.
std::pair<size_t, size_t> memory_info() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return {0, 0};
  }
  return {free, total};
}

size_t in_use() {
  const auto [free, total] = memory_info();
  return total - free;
}

size_t g_baseline = 0;
bool g_noted = false;

}  // namespace

DeviceInfo query_device() {
  DeviceInfo info;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    info.error = cudaGetErrorString(e);
    return info;
  }
  info.count = count;
  if (count == 0) return info;
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return info;
  info.name = p.name;
  info.sm_major = p.major;
  info.sm_minor = p.minor;
  info.memory_bytes = p.totalGlobalMem;
  int* flag = nullptr;
  if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    probe_kernel<<<1, 1>>>(flag);
    int host = 0;
    e = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost);
    info.kernels_run = e == cudaSuccess && host == 1;
    if (e != cudaSuccess) info.error = cudaGetErrorString(e);
    cudaFree(flag);
  }
  return info;
}

void note_memory_baseline() {
  if (g_noted) return;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return;
  }
  cudaFree(nullptr);  // makes the context, whose memory is not ours to count
  g_baseline = in_use();
  g_noted = true;
}

size_t free_memory() { return memory_info().first; }
size_t total_memory() { return memory_info().second; }

int current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

size_t memory_held() {
  if (!g_noted) return 0;
  const size_t now = in_use();
  return now > g_baseline ? now - g_baseline : 0;
}

}  // namespace mt::cuda
