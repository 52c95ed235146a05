// One block of memory carved into tensors by a bump pointer.
//
// Parameters, gradients, optimizer state and activations each live in an arena sized
// up front, so a step allocates nothing and `moetrain plan` can report the numbers
// before launch. A counting arena hands out storage-less tensors and only measures,
// which is how the plan is computed with the same code that allocates for real.
#pragma once

#include <cstddef>
#include <string>

#include "core/tensor.h"

namespace mt {

// Raw device memory: aligned host memory for cpu; for cuda, a block from CUDA's
// stream-ordered pool, ready on every stream when returned (an error naming the build
// when CUDA support is not compiled in). Freeing a cuda block waits for the device.
void* device_alloc(Device device, size_t bytes);
void device_free(Device device, void* p);
// Host memory the kernel could hand out now (free pages, not counting caches it may drop);
// the environment's MOETRAIN_HOST_MEMORY_BYTES where set (the hook of the test of ranks
// that share a host).
size_t available_host_memory();
// Throws unless a GPU can be used: `what` (the option that asks for one), then that
// there is no usable GPU and why (no CUDA in this build, no device, the driver).
void require_gpu(const std::string& what);

class Arena {
 public:
  static constexpr size_t kAlign = 256;

  Arena() = default;  // empty: holds nothing until assigned
  Arena(std::string name, Device device, size_t capacity_bytes);
  // Host memory (Device::cpu tensors), page-locked when `pinned` and CUDA is built, so
  // that copies to and from a GPU run asynchronously at the bus's full rate.
  static Arena host(std::string name, size_t capacity_bytes, bool pinned);
  static Arena counting(std::string name, Device device);
  ~Arena();
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Tensor alloc(DType dtype, Shape shape);
  // Everything handed out before becomes invalid; the block is kept.
  void reset() { used_ = 0; }
  // Hands out from offset `used` on (at most the peak so far): rewound, what was handed
  // out past it becomes invalid (the same bytes for tensors that never live at once);
  // moved forward, past what was rewound over.
  void rewind(size_t used) { used_ = used < peak_ ? used : peak_; }

  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return capacity_; }

 private:
  std::string name_;
  Device device_ = Device::cpu;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t peak_ = 0;
  bool counting_ = false;
  bool pinned_ = false;
};

}  // namespace mt
