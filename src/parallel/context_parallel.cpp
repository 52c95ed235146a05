#include "parallel/context_parallel.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "parallel/buffer.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/ring_merge.h"
#endif

namespace mt::parallel {

std::vector<int64_t> zigzag_positions(int64_t seq, int rank, int cp) {
  MT_CHECK(cp >= 1 && seq % (2 * cp) == 0)
      << "a sequence of " << seq << " positions does not split into 2 * cp = " << 2 * cp << " equal chunks";
  const int64_t c = seq / (2 * cp);
  std::vector<int64_t> out;
  for (int64_t chunk : {static_cast<int64_t>(rank), static_cast<int64_t>(2 * cp - 1 - rank)})
    for (int64_t i = 0; i < c; ++i) out.push_back(chunk * c + i);
  return out;
}


namespace {

struct Dims {
  int64_t b, c, hq, hkv, d, d_v;  // C: positions per chunk; d: q and k's head dim, d_v: v and out's
};

// q, k, v, out and the gradients: f32 on the host, bf16 on the GPU (the attention
// kernels' dtypes); lse, sinks and dsinks are f32 on both.
DType activation_dtype(const Tensor& q) { return q.device == Device::cuda ? DType::bf16 : DType::f32; }

// Every tensor of the ring on q's device; an absent one (sinks, dsinks) has no storage.
void check_devices(const Tensor& q, std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    MT_CHECK(t->data == nullptr || t->device == q.device) << op << ": " << t->str() << " is not on q's device ("
                                                          << q.str() << ")";
}

Dims check_inputs(const comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& sinks, const cpu::AttentionArgs& a, const char* op) {
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && q.dim(1) % 2 == 0)
      << op << " wants this rank's two zigzag chunks, q [B,2C,Hq,Dqk], k [B,2C,Hkv,Dqk] and v [B,2C,Hkv,Dv], got q "
      << q.str() << ", k " << k.str() << ", v " << v.str() << " (cp " << cp.size() << ")";
  const Dims n{q.dim(0), q.dim(1) / 2, q.dim(2), k.dim(2), q.dim(3), v.dim(3)};
  const DType act = activation_dtype(q);
  check_tensor(q, "ring attention q", act, {n.b, 2 * n.c, n.hq, n.d});
  check_tensor(k, "ring attention k", act, {n.b, 2 * n.c, n.hkv, n.d});
  check_tensor(v, "ring attention v", act, {n.b, 2 * n.c, n.hkv, n.d_v});
  MT_CHECK(a.q_offset == 0 && a.k_offset == 0) << op << ": the ring sets the position offsets per block, got q_offset "
                                               << a.q_offset << ", k_offset " << a.k_offset;
  check_devices(q, {&k, &v, &sinks}, op);
  return n;
}

// The chunk cp rank r holds in slot s: r first, then its mirror 2cp-1-r.
int64_t chunk_of(int r, int cp, int slot) { return slot == 0 ? r : 2 * cp - 1 - r; }

// Batch row b's slot s of a [B,2C,H,Dh] tensor, as the contiguous [1,C,H,Dh] it is.
Tensor block(const Tensor& t, int64_t b, int slot, int64_t c) {
  const int64_t first = (b * 2 + slot) * c;
  return t.view({t.dim(0) * t.dim(1), t.dim(2), t.dim(3)}).rows(first, first + c).view({1, c, t.dim(2), t.dim(3)});
}

// Whether any query of chunk qc sees any key of chunk kc: causal, and the nearest pair
// (first query, last key) within the window.
bool visible(int64_t qc, int64_t kc, int64_t c, int64_t window) {
  if (kc > qc) return false;
  return window == 0 || qc * c - (kc * c + c - 1) < window;
}

cpu::AttentionArgs block_args(const cpu::AttentionArgs& a, int64_t qc, int64_t kc, int64_t c) {
  cpu::AttentionArgs b = a;
  b.q_offset = qc * c;
  b.k_offset = kc * c;
  return b;
}

// Two buffers shaped like k and v that travel the ring together (K and V, or dK and dV).
struct Pair {
  std::vector<float> ks, vs;
  Tensor k, v;
  Pair(const Tensor& k_like, const Tensor& v_like)
      : ks(static_cast<size_t>(k_like.numel())), vs(static_cast<size_t>(v_like.numel())) {
    k = Tensor(ks.data(), k_like.shape, DType::f32);
    v = Tensor(vs.data(), v_like.shape, DType::f32);
  }
  Pair(const Pair&) = delete;  // the views point into this object's own storage
};

// Folds one block's (o, lse) for batch row b, slot qs into the running (out, lse):
// softmax over the union of the blocks' keys = the blocks' softmaxes weighted by
// exp(lse_block - lse_union). A row that sees no key of the block (lse -inf) is
// left alone; the first block a row sees is copied.
void merge(const Tensor& o_blk, const Tensor& l_blk, const Tensor& out, const Tensor& lse, int64_t b, int qs,
           const Dims& n) {
  const float* ob = o_blk.f32();
  const float* lb = l_blk.f32();
  float* op = out.f32();
  float* lp = lse.f32();
  const float minus_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < n.hq; ++h)
    for (int64_t i = 0; i < n.c; ++i) {
      const float l_new = lb[h * n.c + i];
      if (l_new == minus_inf) continue;
      float& l = lp[(b * n.hq + h) * 2 * n.c + qs * n.c + i];
      float* o = op + ((b * 2 * n.c + qs * n.c + i) * n.hq + h) * n.d_v;
      const float* x = ob + (i * n.hq + h) * n.d_v;
      if (l == minus_inf) {
        std::copy_n(x, n.d_v, o);
        l = l_new;
        continue;
      }
      const double m = std::max(l, l_new), w_old = std::exp(l - m), w_new = std::exp(l_new - m), z = w_old + w_new;
      for (int64_t e = 0; e < n.d_v; ++e) o[e] = static_cast<float>((w_old * o[e] + w_new * x[e]) / z);
      l = static_cast<float>(m + std::log(z));
    }
}

#ifdef MOETRAIN_WITH_CUDA
// The GPU ring: the passes and blocks of the host's, with the running output and every
// partial gradient sum kept in fp32 buffers (so out, dq, dk and dv are rounded to bf16
// once, at the end, as by a single attention call), the merge and the sums as kernels
// (kernels/ring_merge.h), and the passes as NCCL batches on the communication stream,
// overlapping the blocks' kernels on the backend's stream.
Buffer gpu_buffer(DType dtype, Shape shape) { return make_buffer(Device::cuda, dtype, shape); }

void ring_forward_gpu(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                      const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Dims& n) {
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  const Buffer acc = gpu_buffer(DType::f32, out.shape);
  const Buffer o_blk = gpu_buffer(DType::bf16, {1, n.c, n.hq, n.d_v}), l_blk = gpu_buffer(DType::f32, {1, n.hq, n.c});
  const Buffer bufs[2][2] = {{gpu_buffer(DType::bf16, k.shape), gpu_buffer(DType::bf16, v.shape)},
                             {gpu_buffer(DType::bf16, k.shape), gpu_buffer(DType::bf16, v.shape)}};
  mt::fill(acc.t, 0.0f);
  mt::fill(lse, -std::numeric_limits<float>::infinity());
  Tensor cur_k = k, cur_v = v;
  // Step s uses the K/V of rank r - s while those of r - s - 1 arrive.
  for (int s = 0; s < size; ++s) {
    const int src = (r - s + size) % size;
    const Buffer* nx = bufs[s % 2];
    comm::Request pass;
    if (s + 1 < size)
      pass = cp.start({comm::send_to(cur_k, next), comm::send_to(cur_v, next), comm::recv_from(nx[0].t, prev),
                       comm::recv_from(nx[1].t, prev)},
                      comm::Traffic::context);
    for (int qs = 0; qs < 2; ++qs)
      for (int ks = 0; ks < 2; ++ks) {
        const int64_t qc = chunk_of(r, size, qs), kc = chunk_of(src, size, ks);
        if (!visible(qc, kc, n.c, a.window)) continue;
        const cpu::AttentionArgs args = block_args(a, qc, kc, n.c);
        const Tensor blk_sinks = qc == kc ? sinks : Tensor();
        for (int64_t b = 0; b < n.b; ++b) {
          mt::attention_forward(block(q, b, qs, n.c), block(cur_k, b, ks, n.c), block(cur_v, b, ks, n.c), blk_sinks,
                                args, o_blk.t, l_blk.t);
          cuda::ring_merge(o_blk.t, l_blk.t, b, qs, acc.t, lse);
        }
      }
    pass.wait();
    cur_k = nx[0].t;
    cur_v = nx[1].t;
  }
  mt::cast(acc.t, out);
}

void ring_backward_gpu(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks,
                       const Dims& n) {
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  const Buffer dq_acc = gpu_buffer(DType::f32, q.shape);
  mt::fill(dq_acc.t, 0.0f);
  // The final lse of each (batch row, slot) as the contiguous [1,Hq,C] a block takes.
  const Buffer lse_blocks = gpu_buffer(DType::f32, {n.b * 2, n.hq, n.c});
  for (int64_t b = 0; b < n.b; ++b)
    for (int qs = 0; qs < 2; ++qs) cuda::lse_block(lse, b, qs, lse_blocks.t.rows(b * 2 + qs, b * 2 + qs + 1));
  // attention_backward overwrites its gradients: each block's go to bf16 scratch first,
  // then into the fp32 sums.
  const Buffer dq_blk = gpu_buffer(DType::bf16, {1, n.c, n.hq, n.d}),
               dk_blk = gpu_buffer(DType::bf16, {1, n.c, n.hkv, n.d}),
               dv_blk = gpu_buffer(DType::bf16, {1, n.c, n.hkv, n.d_v});
  auto pair = [&](DType t) {
    return std::array<Buffer, 2>{gpu_buffer(t, k.shape), gpu_buffer(t, v.shape)};
  };
  const std::array<Buffer, 2> kv[2] = {pair(DType::bf16), pair(DType::bf16)};  // K/V arriving for the next step
  const std::array<Buffer, 2> mine[2] = {pair(DType::f32), pair(DType::f32)};  // this step's dK/dV, then passed on
  const std::array<Buffer, 2> partial = pair(DType::f32);  // the partial sum arriving from the previous rank
  Tensor cur_k = k, cur_v = v;
  // Step s: K/V of rank r - s; its dK/dV partial sum arrives while this rank computes
  // its share, and the sum of step s - 1 leaves for the next rank (as on the host).
  for (int s = 0; s < size; ++s) {
    const int src = (r - s + size) % size;
    const std::array<Buffer, 2>& nx = kv[s % 2];
    const std::array<Buffer, 2>& acc = mine[s % 2];
    std::vector<comm::P2P> ops;
    if (s + 1 < size)
      ops = {comm::send_to(cur_k, next), comm::send_to(cur_v, next), comm::recv_from(nx[0].t, prev),
             comm::recv_from(nx[1].t, prev)};
    if (s > 0) {
      const std::array<Buffer, 2>& done = mine[(s - 1) % 2];
      for (comm::P2P op : {comm::send_to(done[0].t, next), comm::send_to(done[1].t, next),
                           comm::recv_from(partial[0].t, prev), comm::recv_from(partial[1].t, prev)})
        ops.push_back(op);
    }
    comm::Request pass = cp.start(ops, comm::Traffic::context);
    mt::fill(acc[0].t, 0.0f);
    mt::fill(acc[1].t, 0.0f);
    for (int qs = 0; qs < 2; ++qs)
      for (int ks = 0; ks < 2; ++ks) {
        const int64_t qc = chunk_of(r, size, qs), kc = chunk_of(src, size, ks);
        if (!visible(qc, kc, n.c, a.window)) continue;
        const cpu::AttentionArgs args = block_args(a, qc, kc, n.c);
        const bool diagonal = qc == kc;
        for (int64_t b = 0; b < n.b; ++b) {
          mt::attention_backward(block(q, b, qs, n.c), block(cur_k, b, ks, n.c), block(cur_v, b, ks, n.c),
                                 diagonal ? sinks : Tensor(), args, block(out, b, qs, n.c),
                                 lse_blocks.t.rows(b * 2 + qs, b * 2 + qs + 1), block(dout, b, qs, n.c), dq_blk.t,
                                 dk_blk.t, dv_blk.t, diagonal ? dsinks : Tensor());
          cuda::accumulate(dq_blk.t, block(dq_acc.t, b, qs, n.c));
          cuda::accumulate(dk_blk.t, block(acc[0].t, b, ks, n.c));
          cuda::accumulate(dv_blk.t, block(acc[1].t, b, ks, n.c));
        }
      }
    pass.wait();
    if (s > 0) {
      mt::add(acc[0].t, partial[0].t, acc[0].t);
      mt::add(acc[1].t, partial[1].t, acc[1].t);
    }
    cur_k = nx[0].t;
    cur_v = nx[1].t;
  }
  // Every rank has added its share to the last K/V held (rank r + 1's): send it home.
  const std::array<Buffer, 2>& last = mine[(size - 1) % 2];
  const std::array<Buffer, 2> home = pair(DType::f32);
  cp.start({comm::send_to(last[0].t, next), comm::send_to(last[1].t, next), comm::recv_from(home[0].t, prev),
            comm::recv_from(home[1].t, prev)},
           comm::Traffic::context)
      .wait();
  mt::cast(dq_acc.t, dq);
  mt::cast(home[0].t, dk);
  mt::cast(home[1].t, dv);
}
#endif

}  // namespace

void ring_attention_forward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  const char* op = "ring_attention_forward";
  const Dims n = check_inputs(cp, q, k, v, sinks, a, op);
  check_tensor(out, "ring attention out", activation_dtype(q), {n.b, 2 * n.c, n.hq, n.d_v});
  check_tensor(lse, "ring attention lse", DType::f32, {n.b, n.hq, 2 * n.c});
  check_devices(q, {&out, &lse}, op);
#ifdef MOETRAIN_WITH_CUDA
  if (q.device == Device::cuda) return ring_forward_gpu(cp, q, k, v, sinks, a, out, lse, n);
#endif
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  mt::fill(out, 0.0f);
  std::fill_n(lse.f32(), lse.numel(), -std::numeric_limits<float>::infinity());
  std::vector<float> o_storage(static_cast<size_t>(n.c * n.hq * n.d_v)), l_storage(static_cast<size_t>(n.hq * n.c));
  const Tensor o_blk(o_storage.data(), {1, n.c, n.hq, n.d_v}, DType::f32);
  const Tensor l_blk(l_storage.data(), {1, n.hq, n.c}, DType::f32);
  Pair bufs[2] = {Pair(k, v), Pair(k, v)};
  Tensor cur_k = k, cur_v = v;
  // Step s uses the K/V of rank r - s while those of r - s - 1 arrive.
  for (int s = 0; s < size; ++s) {
    const int src = (r - s + size) % size;
    Pair& nx = bufs[s % 2];
    comm::Request pass;
    if (s + 1 < size)
      pass = cp.start({comm::send_to(cur_k, next), comm::send_to(cur_v, next), comm::recv_from(nx.k, prev),
                       comm::recv_from(nx.v, prev)},
                      comm::Traffic::context);
    for (int qs = 0; qs < 2; ++qs)
      for (int ks = 0; ks < 2; ++ks) {
        const int64_t qc = chunk_of(r, size, qs), kc = chunk_of(src, size, ks);
        if (!visible(qc, kc, n.c, a.window)) continue;
        const cpu::AttentionArgs args = block_args(a, qc, kc, n.c);
        const Tensor blk_sinks = qc == kc ? sinks : Tensor();
        for (int64_t b = 0; b < n.b; ++b) {
          mt::attention_forward(block(q, b, qs, n.c), block(cur_k, b, ks, n.c), block(cur_v, b, ks, n.c), blk_sinks,
                                args, o_blk, l_blk);
          merge(o_blk, l_blk, out, lse, b, qs, n);
        }
      }
    pass.wait();
    cur_k = nx.k;
    cur_v = nx.v;
  }
}

void ring_attention_backward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& dsinks) {
  const char* op = "ring_attention_backward";
  const Dims n = check_inputs(cp, q, k, v, sinks, a, op);
  const DType act = activation_dtype(q);
  check_tensor(out, "ring attention out", act, {n.b, 2 * n.c, n.hq, n.d_v});
  check_tensor(lse, "ring attention lse", DType::f32, {n.b, n.hq, 2 * n.c});
  check_tensor(dout, "ring attention dout", act, out.shape);
  check_tensor(dq, "ring attention dq", act, q.shape);
  check_tensor(dk, "ring attention dk", act, k.shape);
  check_tensor(dv, "ring attention dv", act, v.shape);
  check_devices(q, {&out, &lse, &dout, &dq, &dk, &dv, &dsinks}, op);
#ifdef MOETRAIN_WITH_CUDA
  if (q.device == Device::cuda)
    return ring_backward_gpu(cp, q, k, v, sinks, a, out, lse, dout, dq, dk, dv, dsinks, n);
#endif
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  mt::fill(dq, 0.0f);

  // The final lse of each (batch row, slot) as the contiguous [1,Hq,C] a block takes.
  std::vector<float> lse_blocks(static_cast<size_t>(n.b * 2 * n.hq * n.c));
  for (int64_t b = 0; b < n.b; ++b)
    for (int qs = 0; qs < 2; ++qs)
      for (int64_t h = 0; h < n.hq; ++h)
        std::copy_n(lse.f32() + (b * n.hq + h) * 2 * n.c + qs * n.c, n.c,
                    lse_blocks.begin() + ((b * 2 + qs) * n.hq + h) * n.c);
  // attention_backward overwrites its gradients: each block's go to scratch first.
  std::vector<float> dq_storage(static_cast<size_t>(n.c * n.hq * n.d));
  const Tensor dq_blk(dq_storage.data(), {1, n.c, n.hq, n.d}, DType::f32);
  Pair dkv_blk(block(k, 0, 0, n.c), block(v, 0, 0, n.c));

  Pair kv[2] = {Pair(k, v), Pair(k, v)};    // K/V arriving for the next step
  Pair mine[2] = {Pair(k, v), Pair(k, v)};  // this step's dK/dV share, then the partial sum passed on
  Pair partial(k, v);                       // the partial sum arriving from the previous rank
  Tensor cur_k = k, cur_v = v;
  // Step s: K/V of rank r - s. Its dK/dV partial sum (ranks r - s .. r - 1 added)
  // arrives while this rank computes its share; meanwhile the sum of step s - 1
  // leaves for the next rank.
  for (int s = 0; s < size; ++s) {
    const int src = (r - s + size) % size;
    Pair& nx = kv[s % 2];
    Pair& acc = mine[s % 2];
    std::vector<comm::P2P> ops;
    if (s + 1 < size)
      ops = {comm::send_to(cur_k, next), comm::send_to(cur_v, next), comm::recv_from(nx.k, prev),
             comm::recv_from(nx.v, prev)};
    if (s > 0) {
      const Pair& done = mine[(s - 1) % 2];
      for (comm::P2P op : {comm::send_to(done.k, next), comm::send_to(done.v, next), comm::recv_from(partial.k, prev),
                           comm::recv_from(partial.v, prev)})
        ops.push_back(op);
    }
    comm::Request pass = cp.start(ops, comm::Traffic::context);
    mt::fill(acc.k, 0.0f);
    mt::fill(acc.v, 0.0f);
    for (int qs = 0; qs < 2; ++qs)
      for (int ks = 0; ks < 2; ++ks) {
        const int64_t qc = chunk_of(r, size, qs), kc = chunk_of(src, size, ks);
        if (!visible(qc, kc, n.c, a.window)) continue;
        const cpu::AttentionArgs args = block_args(a, qc, kc, n.c);
        const bool diagonal = qc == kc;
        for (int64_t b = 0; b < n.b; ++b) {
          const Tensor l_blk(lse_blocks.data() + (b * 2 + qs) * n.hq * n.c, {1, n.hq, n.c}, DType::f32);
          mt::attention_backward(block(q, b, qs, n.c), block(cur_k, b, ks, n.c), block(cur_v, b, ks, n.c),
                                 diagonal ? sinks : Tensor(), args, block(out, b, qs, n.c), l_blk,
                                 block(dout, b, qs, n.c), dq_blk, dkv_blk.k, dkv_blk.v,
                                 diagonal ? dsinks : Tensor());
          const Tensor dq_rows = block(dq, b, qs, n.c), dk_rows = block(acc.k, b, ks, n.c),
                       dv_rows = block(acc.v, b, ks, n.c);
          mt::add(dq_rows, dq_blk, dq_rows);
          mt::add(dk_rows, dkv_blk.k, dk_rows);
          mt::add(dv_rows, dkv_blk.v, dv_rows);
        }
      }
    pass.wait();
    if (s > 0) {
      mt::add(acc.k, partial.k, acc.k);
      mt::add(acc.v, partial.v, acc.v);
    }
    cur_k = nx.k;
    cur_v = nx.v;
  }
  // Every rank has added its share to the last K/V held (rank r + 1's): send it home.
  const Pair& last = mine[(size - 1) % 2];
  cp.start({comm::send_to(last.k, next), comm::send_to(last.v, next), comm::recv_from(dk, prev),
            comm::recv_from(dv, prev)},
           comm::Traffic::context)
      .wait();
}

}  // namespace mt::parallel
