#include "train/offload.h"

#include <algorithm>
#include <chrono>

#include "core/check.h"
#include "kernels/elementwise.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace mt {

namespace {

// A block's experts [e0, e1): the same rows of each of its tensors (null ones stay null).
Tensor experts_of(const Tensor& t, int64_t e0, int64_t e1) { return t.data == nullptr ? t : t.rows(e0, e1); }

#ifdef MOETRAIN_WITH_CUDA
// The copy streams: made once and kept for the process (runtime.h: streams outlive
// their buffers), non-blocking like the main stream.
cudaStream_t copy_stream(int which) {
  static cudaStream_t streams[2] = {nullptr, nullptr};
  if (streams[which] == nullptr) CUDA_CHECK(cudaStreamCreateWithFlags(&streams[which], cudaStreamNonBlocking));
  return streams[which];
}
#endif

}  // namespace

StreamedUpdate::StreamedUpdate(Device device, DType state, int64_t elements)
    : device_(device), state_(state), elements_(elements), staging_("offload staging", device, bytes(state, elements)) {
  for (int s = 0; s < 2; ++s) {
    param_[s] = staging_.alloc(DType::f32, {elements});
    m_[s] = staging_.alloc(state, {elements});
    v_[s] = staging_.alloc(state, {elements});
  }
}

int64_t StreamedUpdate::set_elements(const std::vector<Param>& params, DType state, double staging_mib) {
  int64_t expert = 0, block = 0;
  for (const Param& p : params)
    if (p.offloaded) {
      expert = std::max(expert, p.value.numel() / p.value.dim(0));
      block = std::max(block, p.value.numel());
    }
  const double per = static_cast<double>(dtype_size(DType::f32) + 2 * dtype_size(state));
  return std::min(block, std::max(expert, static_cast<int64_t>(staging_mib * (1 << 20) / per)));
}

size_t StreamedUpdate::bytes(DType state, int64_t elements) {
  if (elements == 0) return 0;
  Arena count = Arena::counting("offload staging", Device::cpu);
  for (int s = 0; s < 2; ++s)
    for (DType d : {DType::f32, state, state}) count.alloc(d, {elements});
  return count.peak();
}

OffloadTraffic StreamedUpdate::update(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& a) {
  const auto start = std::chrono::steady_clock::now();
  OffloadTraffic traffic;
#ifdef MOETRAIN_WITH_CUDA
  const bool gpu = device_ == Device::cuda;
  cuda::Event in_done[2], updated[2], out_done[2];
#endif
  int64_t chunk = 0;
  for (const AdamWBlock& b : blocks) {
    MT_CHECK(b.param.device == Device::cpu && b.m.device == Device::cpu)
        << "StreamedUpdate: the weights and moments of an offloaded block are in host memory, got "
        << b.param.str() << " and " << b.m.str();
    const int64_t E = b.param.dim(0), per = b.param.numel() / E, take = std::max<int64_t>(1, elements_ / per);
    MT_CHECK(per <= elements_) << "StreamedUpdate: one expert of " << b.param.str() << " is " << per
                               << " elements, more than the staging's " << elements_;
    for (int64_t e0 = 0; e0 < E; e0 += take, ++chunk) {
      const int64_t e1 = std::min(E, e0 + take);
      const int s = static_cast<int>(chunk % 2);
      const Tensor host[3] = {b.param.rows(e0, e1), b.m.rows(e0, e1), b.v.rows(e0, e1)};
      const Shape shape = host[0].shape;
      const Tensor staged[3] = {Tensor(param_[s].data, shape, DType::f32, device_),
                                Tensor(m_[s].data, shape, state_, device_), Tensor(v_[s].data, shape, state_, device_)};
      AdamWBlock block = b;
      block.param = staged[0];
      block.m = staged[1];
      block.v = staged[2];
      block.key = b.key + static_cast<uint64_t>(e0 * per);
      for (Tensor* t : {&block.grad, &block.compute, &block.fp8.q, &block.fp8.scale, &block.fp8.qt, &block.fp8.scale_t})
        *t = experts_of(*t, e0, e1);
      for (const Tensor& t : host) traffic.bytes_in += static_cast<int64_t>(t.nbytes());
#ifdef MOETRAIN_WITH_CUDA
      if (gpu) {
        // In on the first copy stream once the set's last chunk has gone out, updated on
        // the main stream, out on the second.
        const cudaStream_t in = copy_stream(0), out = copy_stream(1), main = cuda::stream();
        out_done[s].wait(in);
        for (int j = 0; j < 3; ++j)
          CUDA_CHECK(cudaMemcpyAsync(staged[j].data, host[j].data, host[j].nbytes(), cudaMemcpyHostToDevice, in));
        in_done[s] = cuda::Event::record(in);
        in_done[s].wait(main);
        mt::adamw_step_multi({block}, a);
        updated[s] = cuda::Event::record(main);
        updated[s].wait(out);
        for (int j = 0; j < 3; ++j)
          CUDA_CHECK(cudaMemcpyAsync(host[j].data, staged[j].data, host[j].nbytes(), cudaMemcpyDeviceToHost, out));
        out_done[s] = cuda::Event::record(out);
        continue;
      }
#endif
      for (int j = 0; j < 3; ++j) copy(staged[j], host[j]);
      mt::adamw_step_multi({block}, a);
      for (int j = 0; j < 3; ++j) copy(host[j], staged[j]);
    }
  }
#ifdef MOETRAIN_WITH_CUDA
  // The host copies are read by the host (checkpoints) and the next update: whole first.
  if (gpu && chunk > 0) {
    CUDA_CHECK(cudaStreamSynchronize(copy_stream(1)));
    cuda::count_host_wait();
  }
#endif
  traffic.bytes_out = traffic.bytes_in;  // every chunk goes back out as it came in
  traffic.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return traffic;
}

}  // namespace mt
