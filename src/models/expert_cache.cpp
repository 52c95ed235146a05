#include "models/expert_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/check.h"
#include "kernels/elementwise.h"

namespace mt {

namespace {

#ifdef MOETRAIN_WITH_CUDA
// The cache's copies: one stream for the process (runtime.h: streams outlive their
// buffers), non-blocking like the main stream. In and out share it, so a line's
// gradients are back in host memory before a later fetch reads them.
cudaStream_t copy_stream() {
  static cudaStream_t s = nullptr;
  if (s == nullptr) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}
#endif

// The shape of `count` experts of an [E, ...] block.
Shape experts_shape(const Shape& s, int64_t count) {
  Shape out = s;
  out.d[0] = count;
  return out;
}

}  // namespace

ExpertCache::ExpertCache(std::vector<Param>& params, std::vector<std::vector<int>> blocks, int64_t experts,
                         int64_t slots, int64_t line, Device device, bool counting)
    : params_(&params), blocks_(std::move(blocks)), experts_(experts), device_(device), counting_(counting) {
  MT_CHECK(slots >= 1) << "offload.gpu_expert_slots = " << slots << ": expected at least one expert slot";
  MT_CHECK(experts >= 1) << "ExpertCache: a cached layer holds " << experts << " experts";
  MT_CHECK(line >= 0) << "ExpertCache: lines of " << line << " experts";
  line_ = line > 0 ? std::min(line, experts) : slots >= experts ? experts : std::max<int64_t>(1, slots / 2);
  lines_ = (experts + line_ - 1) / line_;
  const int64_t frames = std::max<int64_t>(1, slots / line_);
  const std::vector<int>* shape_of = nullptr;
  for (const std::vector<int>& b : blocks_)
    if (!b.empty()) shape_of = &b;
  written_.assign(blocks_.size(), std::vector<bool>(static_cast<size_t>(lines_), false));
  passed_.assign(blocks_.size(), {});
  if (shape_of == nullptr) return;
  for (size_t l = 0; l < blocks_.size(); ++l)
    for (size_t j = 0; j < blocks_[l].size(); ++j) {
      const Param& p = params[static_cast<size_t>(blocks_[l][j])];
      const Param& q = params[static_cast<size_t>((*shape_of)[j])];
      MT_CHECK(blocks_[l].size() == shape_of->size() && p.value.shape == q.value.shape && p.value.dim(0) == experts)
          << "ExpertCache: layer " << l << "'s " << p.name << " " << p.value.str() << " is not shaped as " << q.name
          << " " << q.value.str();
    }
  Arena count = Arena::counting("expert cache", device);
  for (int64_t f = 0; f < frames; ++f)
    for (int j : *shape_of) {
      const Param& p = params[static_cast<size_t>(j)];
      count.alloc(p.compute.dtype, experts_shape(p.value.shape, line_));
      count.alloc(DType::f32, experts_shape(p.value.shape, line_));
    }
  frames_arena_ = counting ? Arena::counting("expert cache", device) : Arena("expert cache", device, count.peak());
  frames_.resize(static_cast<size_t>(frames));
  for (Frame& f : frames_)
    for (int j : *shape_of) {
      const Param& p = params[static_cast<size_t>(j)];
      f.compute.push_back(frames_arena_.alloc(p.compute.dtype, experts_shape(p.value.shape, line_)));
      f.grad.push_back(frames_arena_.alloc(DType::f32, experts_shape(p.value.shape, line_)));
    }
}

int ExpertCache::find(int64_t layer, int64_t line) const {
  for (size_t i = 0; i < frames_.size(); ++i)
    if (frames_[i].layer == layer && frames_[i].line == line) return static_cast<int>(i);
  return -1;
}

Tensor ExpertCache::host_rows(const Tensor& t, int64_t line) const {
  const int64_t first = line * line_;
  return t.rows(first, std::min(experts_, first + line_));
}

void ExpertCache::copy(const Tensor& dst, const Tensor& src) {
  if (dst.nbytes() == 0) return;
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) {
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDefault, copy_stream()));
    return;
  }
#endif
  const auto start = std::chrono::steady_clock::now();
  std::memcpy(dst.data, src.data, src.nbytes());
  stats_.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Zeros into t, queued behind the copies like them.
void ExpertCache::zero(const Tensor& t) {
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) {
    CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), copy_stream()));
    return;
  }
#endif
  mt::fill(t, 0.0f);
}

// A free frame, else the least recently used one; its line's changed gradients go back
// to host memory first, once the compute queued on it is done.
int ExpertCache::victim() {
  int best = 0;
  for (size_t i = 0; i < frames_.size(); ++i) {
    if (frames_[i].layer < 0) return static_cast<int>(i);
    if (frames_[i].used < frames_[static_cast<size_t>(best)].used) best = static_cast<int>(i);
  }
  Frame& f = frames_[static_cast<size_t>(best)];
  store_grads(f);
  f.layer = f.line = -1;
  f.has_grads = false;
  return best;
}

void ExpertCache::store_grads(Frame& f) {
  if (!f.dirty) return;
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) f.released.wait(copy_stream());
#endif
  const std::vector<int>& b = blocks_[static_cast<size_t>(f.layer)];
  for (size_t j = 0; j < b.size(); ++j) {
    const Tensor host = host_rows((*params_)[static_cast<size_t>(b[j])].grad, f.line);
    copy(host, f.grad[j].rows(0, host.dim(0)));
    stats_.bytes_out += static_cast<int64_t>(host.nbytes());
  }
  f.dirty = false;
}

void ExpertCache::load_weights(Frame& f, int64_t layer, int64_t line) {
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) f.released.wait(copy_stream());
#endif
  const std::vector<int>& b = blocks_[static_cast<size_t>(layer)];
  for (size_t j = 0; j < b.size(); ++j) {
    const Tensor host = host_rows((*params_)[static_cast<size_t>(b[j])].compute, line);
    copy(f.compute[j].rows(0, host.dim(0)), host);
    stats_.bytes_in += static_cast<int64_t>(host.nbytes());
  }
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) f.ready = cuda::Event::record(copy_stream());
#endif
  f.layer = layer;
  f.line = line;
  f.has_grads = false;
  f.view = make_view(f);
  stats_.misses += std::min(experts_, (line + 1) * line_) - line * line_;
}

ExpertCache::Line ExpertCache::make_view(const Frame& f) const {
  Line v;
  const int64_t count = std::min(experts_, (f.line + 1) * line_) - f.line * line_;
  const std::vector<int>& b = blocks_[static_cast<size_t>(f.layer)];
  for (size_t j = 0; j < b.size(); ++j) {
    const Param& p = (*params_)[static_cast<size_t>(b[j])];
    Param q;
    q.name = p.name;
    q.matrix = p.matrix;
    q.expert = p.expert;
    q.layer = p.layer;
    q.compute = f.compute[j].rows(0, count);
    q.grad = f.grad[j].rows(0, count);
    q.value = q.compute;
    v.params.push_back(std::move(q));
  }
  return v;
}

std::vector<int64_t> ExpertCache::order(int64_t layer) const {
  std::vector<const Frame*> held;
  for (const Frame& f : frames_)
    if (f.layer == layer) held.push_back(&f);
  std::sort(held.begin(), held.end(), [](const Frame* a, const Frame* b) { return a->used > b->used; });
  std::vector<int64_t> lines;
  for (const Frame* f : held) lines.push_back(f->line);
  for (int64_t i = 0; i < lines_; ++i)
    if (find(layer, i) < 0) lines.push_back(i);
  return lines;
}

ExpertCache::Line& ExpertCache::fetch(int64_t layer, int64_t line, bool grads, bool accumulate) {
  MT_CHECK(caches(layer) && line >= 0 && line < lines_)
      << "ExpertCache: line " << line << " of layer " << layer << ", which it does not cache";
  int i = find(layer, line);
  const size_t l = static_cast<size_t>(layer);
  if (layer != pass_layer_) {
    passed_[l].assign(static_cast<size_t>(lines_), false);
    pass_layer_ = layer;
  }
  passed_[l][static_cast<size_t>(line)] = true;
  if (stats_.expert_uses.empty()) {
    stats_.expert_uses.assign(blocks_.size(), std::vector<int64_t>(static_cast<size_t>(experts_), 0));
    stats_.expert_hits = stats_.expert_uses;
  }
  for (int64_t e = line * line_; e < std::min(experts_, (line + 1) * line_); ++e) {
    ++stats_.expert_uses[l][static_cast<size_t>(e)];
    stats_.expert_hits[l][static_cast<size_t>(e)] += i >= 0;
  }
  if (i >= 0) {
    stats_.hits += std::min(experts_, (line + 1) * line_) - line * line_;
  } else {
    i = victim();
    load_weights(frames_[static_cast<size_t>(i)], layer, line);
  }
  Frame& f = frames_[static_cast<size_t>(i)];
  if (grads && !f.has_grads) {
    const std::vector<int>& b = blocks_[static_cast<size_t>(layer)];
    const bool written = written_[static_cast<size_t>(layer)][static_cast<size_t>(line)];
#ifdef MOETRAIN_WITH_CUDA
    if (device_ == Device::cuda) f.released.wait(copy_stream());
#endif
    for (size_t j = 0; j < b.size() && accumulate; ++j) {
      const Tensor host = host_rows((*params_)[static_cast<size_t>(b[j])].grad, line);
      const Tensor frame = f.grad[j].rows(0, host.dim(0));
      if (written) {
        copy(frame, host);
        stats_.bytes_in += static_cast<int64_t>(host.nbytes());
      } else {
        zero(frame);  // what the step's first write left for experts without rows
      }
    }
#ifdef MOETRAIN_WITH_CUDA
    if (device_ == Device::cuda && accumulate) f.ready = cuda::Event::record(copy_stream());
#endif
    f.has_grads = true;
  }
  f.used = ++tick_;
  current_ = i;
  // The compute waits for this frame's copies only, not for the prefetches and
  // write-backs queued behind them.
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) {
    cuda::Event before = cuda::Event::record_timed(cuda::stream());
    f.ready.wait(cuda::stream());
    waits_.emplace_back(std::move(before), cuda::Event::record_timed(cuda::stream()));
  }
#endif
  return f.view;
}

void ExpertCache::done(bool wrote) {
  MT_CHECK(current_ >= 0) << "ExpertCache::done without a fetched line";
  Frame& f = frames_[static_cast<size_t>(current_)];
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) f.released = cuda::Event::record(cuda::stream());
#endif
  if (wrote) {
    f.dirty = true;
    written_[static_cast<size_t>(f.layer)][static_cast<size_t>(f.line)] = true;
  }
  current_ = -1;
}

void ExpertCache::prefetch(int64_t layer) {
  if (!caches(layer) || counting_) return;
  const std::vector<bool>& want = passed_[static_cast<size_t>(layer)];
  const std::vector<bool>* busy = pass_layer_ >= 0 ? &passed_[static_cast<size_t>(pass_layer_)] : nullptr;
  int64_t spare = static_cast<int64_t>(frames_.size()) -
                  (busy != nullptr ? std::count(busy->begin(), busy->end(), true) : 0);
  for (int64_t line = 0; line < lines_ && spare > 0; ++line) {
    if (!want.empty() && !want[static_cast<size_t>(line)]) continue;
    --spare;
    if (find(layer, line) >= 0) continue;
    Frame& f = frames_[static_cast<size_t>(victim())];
    load_weights(f, layer, line);
    f.used = ++tick_;
  }
}

ExpertCacheStats ExpertCache::flush() {
  for (Frame& f : frames_) {
    if (f.layer >= 0) store_grads(f);
    f.layer = f.line = -1;
    f.has_grads = false;
  }
  // A line no micro-batch's tokens reached has the zeros the first write gives them.
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (int64_t line = 0; line < lines_ && !blocks_[l].empty() && !counting_; ++line) {
      if (written_[l][static_cast<size_t>(line)]) continue;
      for (int j : blocks_[l]) zero(host_rows((*params_)[static_cast<size_t>(j)].grad, line));
    }
    std::fill(written_[l].begin(), written_[l].end(), false);
  }
#ifdef MOETRAIN_WITH_CUDA
  // The norm and the update read the host gradients on the main stream.
  if (device_ == Device::cuda && !counting_) cuda::Event::record(copy_stream()).wait(cuda::stream());
#endif
  count_waits();  // the norm waits for the main stream next anyway
  const ExpertCacheStats s = stats_;
  stats_ = {};
  return s;
}

// The compute's waits so far into stats_ (waiting for the main stream to pass the last).
void ExpertCache::count_waits() {
#ifdef MOETRAIN_WITH_CUDA
  for (const auto& [before, after] : waits_) stats_.wait_s += cuda::Event::elapsed_ms(before, after) / 1e3;
  if (!waits_.empty()) cuda::count_host_wait();
  waits_.clear();
#endif
}

ExpertCacheStats ExpertCache::stats() {
  count_waits();
  return stats_;
}

ExpertCacheStats ExpertCache::planned_traffic(int64_t micro_batches, int64_t sweep) const {
  int64_t weights = 0, grads = 0;
  for (const std::vector<int>& b : blocks_)
    for (int j : b) {
      weights += static_cast<int64_t>((*params_)[static_cast<size_t>(j)].compute.nbytes());
      grads += static_cast<int64_t>((*params_)[static_cast<size_t>(j)].grad.nbytes());
    }
  ExpertCacheStats t;
  const int64_t frames = static_cast<int64_t>(frames_.size());
  const int64_t cached_layers =
      std::count_if(blocks_.begin(), blocks_.end(), [](const std::vector<int>& b) { return !b.empty(); });
  const bool all = frames >= cached_layers * lines_;
  const int64_t passes = frames >= 2 * lines_ ? (micro_batches + sweep - 1) / sweep : micro_batches;
  t.bytes_in = all ? weights : passes * (2 * weights + grads);
  t.bytes_out = all ? grads : passes * grads;
  return t;
}

}  // namespace mt
