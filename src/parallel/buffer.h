// Temporary tensors of the parallel layers, whose sizes are known only at run time
// (expert-parallel transfers and plans, ring attention's blocks and partial sums), on
// the device of the tensors they serve. Host memory is aligned heap memory; GPU memory
// comes from CUDA's stream-ordered pool on the backend's stream, so it is usable at once
// by the work queued there and goes back to the pool after the work queued before its
// last owner lets go, with no synchronisation (kernels/cuda/runtime.h, stream_alloc).
#pragma once

#include <memory>

#include "core/arena.h"
#include "core/tensor.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace mt::parallel {

// A tensor and its storage; copies share the storage, which goes with the last one.
struct Buffer {
  Tensor t;
  std::shared_ptr<void> storage;
};

inline Buffer make_buffer(Device device, DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  Buffer b;
#ifdef MOETRAIN_WITH_CUDA
  if (device == Device::cuda) {
    b.storage = std::shared_ptr<void>(cuda::stream_alloc(bytes), cuda::stream_free);
    b.t = Tensor(b.storage.get(), shape, dtype, device);
    return b;
  }
#endif
  // Host memory (and, in a build without CUDA, device_alloc's error for a cuda buffer).
  b.storage = std::shared_ptr<void>(device_alloc(device, bytes), [device](void* p) { device_free(device, p); });
  b.t = Tensor(b.storage.get(), shape, dtype, device);
  return b;
}

}  // namespace mt::parallel
