// What the CUDA runtime sees on this machine.
#pragma once

#include <cstddef>
#include <string>

namespace mt::cuda {

struct DeviceInfo {
  int count = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  size_t memory_bytes = 0;
  bool kernels_run = false;  // a probe kernel built for sm_90a ran on device 0
  std::string error;         // why the runtime could not answer, if it could not
};

DeviceInfo query_device();

// Device memory this process holds on its GPU: in use now (cudaMemGetInfo) less in use when
// note_memory_baseline first ran (the context made), so pools' reservations, library
// workspaces and handles count too; assumes no other process allocates on it. 0 without a GPU.
void note_memory_baseline();
size_t memory_held();
// Device memory no one holds now (cudaMemGetInfo's free); 0 without a GPU.
size_t free_memory();
// The memory of the GPU this process drives (cudaMemGetInfo's total); 0 without a GPU.
size_t total_memory();
// The GPU this process drives (cudaGetDevice); -1 without one.
int current_device();

}  // namespace mt::cuda
