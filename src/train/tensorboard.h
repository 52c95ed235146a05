// TensorBoard event files (metrics.tensorboard), written by hand: no TensorFlow, no
// protobuf library. A file is a sequence of TFRecord frames
//   uint64 length, uint32 masked crc32c(length), data, uint32 masked crc32c(data)
// (little-endian) whose data is an Event message in protobuf's wire format:
//   wall_time (double, 1), step (int64, 2), file_version (string, 3; the first record,
//   "brain.Event:2"), summary (5: repeated Value {tag string 1, simple_value float 2}),
//   session_log (7: {status 1}; START, at a resumed step, makes TensorBoard drop the
//   events at and after that step that earlier files of the folder hold).
// Those few fields are all the scalars dashboard reads.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/file.h"
#include "train/trainer.h"

namespace mt {

class TensorBoardWriter {
 public:
  // Creates `folder` and folder/events.out.tfevents.<unix seconds>.<host> (a suffix
  // .1, .2, ... when that name is taken, so that files sort in the order written).
  explicit TensorBoardWriter(const std::string& folder);
  const std::string& path() const { return path_; }
  // Scalars of one step, written at once so a live TensorBoard sees them. Each returns ""
  // or why the event could not be written (io::AppendFile: the file keeps whole events).
  std::string scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, float>>& values);
  // A restart from a checkpoint: the steps from `step` on are written again.
  std::string restart(int64_t step, double wall_time);

 private:
  std::string record(const std::string& event);
  std::string path_;
  io::AppendFile out_;
};

// What a step contributes: loss, lb_loss, grad_norm, lr, tokens_per_s, memory_bytes
// (and device_memory_bytes on a GPU), dropped_slots, expert_row_bytes, routing_skew, and per MoE layer l (its index
// among all decoder layers) expert_load/layer_<l>/max_over_mean and min_over_mean:
// the most and least loaded experts' token counts over the mean count (1 = balanced).
std::vector<std::pair<std::string, float>> step_scalars(const StepResult& r);

// Masked CRC-32C as TFRecord frames carry it (exposed for the test).
uint32_t tfrecord_masked_crc(const void* data, size_t n);

}  // namespace mt
