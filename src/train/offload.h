// Expert offload, its optimizer tier (offload.experts = optimizer): the update of the
// blocks whose f32 master weights and AdamW moments live in host memory.
//
// Where the parts are: the decoder allocates the routed experts' matrices' master
// weights in a host arena (models/decoder.cpp, Param::offloaded; pinned on a GPU run),
// their bf16 compute copies, FP8 codes and f32 gradients on the device as before; AdamW
// keeps their moments in host memory too (train/optimizer.cpp) and hands their blocks to
// StreamedUpdate; the sharding leaves them out of its shard vectors (parallel/sharding.h,
// ShardUnit::offloaded); the plan counts them as host memory (train/trainer.cpp,
// plan_memory) and train refuses a run whose host memory would not hold them
// (train/run.cpp).
//
// Each step, after the global gradient norm, the blocks pass through the device in
// chunks of whole experts: a chunk's weights and moments are copied in on one stream,
// updated by the same AdamW kernel on the main stream (which writes the compute copy and
// FP8 codes in the same pass), and copied back on a third. Two staging sets alternate,
// so the next chunk comes in while this one is updated and the one before goes out. On
// the CPU backend host and device are one memory, but the chunks take the same path
// (copies, staging, kernel), so the bits are an update in place's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/param.h"
#include "kernels/adamw.h"

namespace mt {

// Host <-> H200 over pinned buffers, each way, as measured on the GPU machine (issue 32):
// what `moetrain plan` predicts the offloaded update's transfers from.
constexpr double kPcieBytesPerSecond = 55e9;

// One update's transfers: bytes into the device and back out, and the update's wall
// time (the device is otherwise idle then: it is the time the step waited for it).
struct OffloadTraffic {
  int64_t bytes_in = 0, bytes_out = 0;
  double seconds = 0;
};

class StreamedUpdate {
 public:
  StreamedUpdate() = default;
  // Two staging sets of `elements` weights (f32) and moments (`state`) each on `device`.
  StreamedUpdate(Device device, DType state, int64_t elements);
  // The elements a set holds: offload.staging_mib MiB, but at least one expert of the
  // largest offloaded block (a chunk is whole experts) and at most that block.
  static int64_t set_elements(const std::vector<Param>& params, DType state, double staging_mib);
  static size_t bytes(DType state, int64_t elements);
  // Each block's param, m and v in host memory, its grad, compute and FP8 codes on the
  // device, all [E, ...] (or flat: a shard's piece, without copies): updated chunk by
  // chunk along E, with AdamW's rounding noise keyed from block.key as if in one piece.
  // Returns once the host copies are written.
  OffloadTraffic update(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& a);

 private:
  Device device_ = Device::cpu;
  DType state_ = DType::f32;
  int64_t elements_ = 0;
  Arena staging_;
  Tensor param_[2], m_[2], v_[2];
};

}  // namespace mt
