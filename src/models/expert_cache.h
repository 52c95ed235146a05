// Expert offload, its weights tier (offload.experts = weights): the routed experts'
// compute copies and gradients live in host memory with their master weights, and the
// device holds offload.gpu_expert_slots experts at a time in a cache of lines.
//
// Where the parts are: the decoder allocates the cached matrices' compute copies and
// gradients in its host arena (models/decoder.cpp, Param::cached; pinned and mapped on a
// GPU run, so that the gradient norm and AdamW's streamed update, train/offload.h, read
// them in place over PCIe); the MoE block runs a cached layer's expert products line by
// line from here (models/moe.cpp, Moe::cached_experts); the trainer flushes the cache
// before the gradient norm (train/trainer.cpp); the plan counts the lines as device
// memory and the host copies as host memory.
//
// A line is `line_experts()` consecutive experts of one layer, all of its cached
// matrices, weights and gradients: a layer's products run once per line, over the
// line's window of the rows (kernels/grouped_gemm.h). In training, with slots for a
// layer's experts or more, a line is a whole layer; with fewer, half the slots, so that
// one line is fetched while the other computes. Generation (cli/generate.cpp) takes
// lines of one expert: a token reaches k experts a layer, and only those are fetched.
// The frames are replaced least recently used first. A line is fetched when its window
// has rows (the routing read at the layer's forward); a line none of a micro-batch's
// tokens reach is not. Behind a layer's pass the next cached layer's lines are
// prefetched: those its last pass fetched (every line before its first), as many as the
// frames hold besides the lines this pass fetched.
//
// Gradients: a line's gradients are fetched with it for a W (from host memory, or zeros
// for a line not written yet this step, or nothing for the step's first write, which
// overwrites), accumulate in the frame while it stays, and go back to host memory when
// it is evicted or flushed. So each expert's gradient sees the additions an in-device
// gradient would, in the same order: an offloaded run gives the same bits.
//
// The order that makes it pay: at training batch sizes a micro-batch reaches every expert
// of every layer, so depth first (each micro-batch through the whole model) fetches each
// layer's weights twice and moves its gradients in and out once per micro-batch. A layer
// sweep (training.layer_sweep, train/schedule.h) takes G micro-batches through a layer
// while its lines stay, so that is once per sweep; with full recomputation a sweep's
// micro-batches share one activation block, which is what lets G be a whole step's.
//
// On the GPU the copies run on a stream of their own: a frame is overwritten only after
// the compute queued on its previous line is done, and the compute on a line waits for
// its copies. On the CPU backend host and device are one memory, but every path runs:
// frames, eviction, the copies, the flush.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/param.h"
#include "models/interface.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace mt {

class ExpertCache {
 public:
  ExpertCache() = default;
  // blocks[l]: indices into params of layer l's cached matrices ([experts, ...] each, the
  // same shapes in every layer that has any; empty: a layer not cached). `slots`: the
  // experts the device holds at once (>= 1); `line`: the experts a line holds (0: the
  // training rule above). With `counting` the frames are only counted.
  ExpertCache(std::vector<Param>& params, std::vector<std::vector<int>> blocks, int64_t experts, int64_t slots,
              int64_t line, Device device, bool counting);

  bool caches(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(blocks_.size()) && !blocks_[static_cast<size_t>(layer)].empty();
  }
  int64_t line_experts() const { return line_; }
  size_t bytes() const { return frames_arena_.peak(); }
  // What `moetrain plan` predicts a step of `micro_batches` in sweeps of `sweep`
  // (train/schedule.h) moves each way: holding every cached line, the weights come in
  // once and the gradients go out once; holding fewer, each pass over a layer (a sweep's
  // when the frames hold a layer's lines and the next one's, else each micro-batch's)
  // fetches the weights in its forward and again in its backward, and the gradients in
  // and out, at most.
  ExpertCacheStats planned_traffic(int64_t micro_batches, int64_t sweep) const;

  // A line's experts of a layer on the device: its cached matrices as Params (the line's
  // compute copies and gradients), in the order of blocks[layer].
  struct Line {
    std::vector<Param> params;
  };
  // The order a pass takes the layer's lines in: those in frames first, the most recent
  // first, then the others (a pass back over what the last one left finds it there).
  std::vector<int64_t> order(int64_t layer) const;
  // Line i of the layer on the device, its weights fetched if it was not there. With
  // `grads` its gradients too, for a W: `accumulate` false is the step's first write
  // of the layer (the product overwrites; nothing is fetched), true adds to what the
  // step has written (zeros for a line not written yet).
  Line& fetch(int64_t layer, int64_t line, bool grads = false, bool accumulate = false);
  // The work on the fetched line is queued; with `wrote` its gradients changed.
  void done(bool wrote);
  // Starts fetching the lines the layer's last pass fetched (all of them before its
  // first), as many as the frames hold besides those the current pass fetched, without
  // waiting for them.
  void prefetch(int64_t layer);
  // The traffic since the last flush, the lines left as they are (on the GPU it waits
  // for the main stream to pass the last fetch).
  ExpertCacheStats stats();
  // Every changed gradient back in host memory (and zeros for the lines a step never
  // wrote), every line dropped (the update changes the weights). Returns the traffic
  // since the last flush.
  ExpertCacheStats flush();

 private:
  struct Frame {
    int64_t layer = -1, line = -1;  // the line held (-1: none)
    bool has_grads = false, dirty = false;
    int64_t used = 0;  // LRU tick
    std::vector<Tensor> compute, grad;
    Line view;  // the line's Params over compute and grad, made when it is loaded
#ifdef MOETRAIN_WITH_CUDA
    cuda::Event ready, released;  // its copies done; the compute queued on it done
#endif
  };
  int find(int64_t layer, int64_t line) const;
  int victim();
  void load_weights(Frame& f, int64_t layer, int64_t line);
  void store_grads(Frame& f);
  void copy(const Tensor& dst, const Tensor& src);
  void zero(const Tensor& t);
  Tensor host_rows(const Tensor& t, int64_t line) const;
  Line make_view(const Frame& f) const;
  void count_waits();

  std::vector<Param>* params_ = nullptr;
  std::vector<std::vector<int>> blocks_;
  std::vector<std::vector<bool>> written_;  // [layer][line]: its gradients written this step
  // [layer][line]: fetched by the layer's last pass (empty: no pass yet); the pass is
  // the run of fetches of pass_layer_.
  std::vector<std::vector<bool>> passed_;
  int64_t pass_layer_ = -1;
  int64_t experts_ = 0, line_ = 0, lines_ = 0;
  Device device_ = Device::cpu;
  bool counting_ = false;
  Arena frames_arena_;
  std::vector<Frame> frames_;
  int current_ = -1;  // the frame of the last fetch
#ifdef MOETRAIN_WITH_CUDA
  // Timed marks on the main stream around each fetch's wait for its frame's copies,
  // read at the flush.
  std::vector<std::pair<cuda::Event, cuda::Event>> waits_;
#endif
  int64_t tick_ = 0;
  ExpertCacheStats stats_;
};

}  // namespace mt
