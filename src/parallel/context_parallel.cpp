#include "parallel/context_parallel.h"

#include <array>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/ring_merge.h"
#include "parallel/buffer.h"

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

// q, k, v, sinks, out and lse, as both directions take them.
Dims check_inputs(const comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                  const char* op) {
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && q.dim(1) % 2 == 0)
      << op << " wants this rank's two zigzag chunks, q [B,2C,Hq,Dqk], k [B,2C,Hkv,Dqk] and v [B,2C,Hkv,Dv], got q "
      << q.str() << ", k " << k.str() << ", v " << v.str() << " (cp " << cp.size() << ")";
  const Dims n{q.dim(0), q.dim(1) / 2, q.dim(2), k.dim(2), q.dim(3), v.dim(3)};
  const DType act = activation_dtype(q);
  check_tensor(q, "ring attention q", act, {n.b, 2 * n.c, n.hq, n.d});
  check_tensor(k, "ring attention k", act, {n.b, 2 * n.c, n.hkv, n.d});
  check_tensor(v, "ring attention v", act, {n.b, 2 * n.c, n.hkv, n.d_v});
  check_tensor(out, "ring attention out", act, {n.b, 2 * n.c, n.hq, n.d_v});
  check_tensor(lse, "ring attention lse", DType::f32, {n.b, n.hq, 2 * n.c});
  MT_CHECK(a.q_offset == 0 && a.k_offset == 0) << op << ": the ring sets the position offsets per block, got q_offset "
                                               << a.q_offset << ", k_offset " << a.k_offset;
  check_devices(q, {&k, &v, &sinks, &out, &lse}, op);
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

}  // namespace

void ring_attention_forward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  const Dims n = check_inputs(cp, q, k, v, sinks, a, out, lse, "ring_attention_forward");
  const DType act = activation_dtype(q);
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  auto buffer = [&](DType dtype, Shape shape) { return make_buffer(q.device, dtype, shape); };
  // The running output (and in the backward every partial gradient sum) is fp32, so out,
  // dq, dk and dv are rounded to their dtype once, at the end, as by one attention call.
  const Buffer acc = buffer(DType::f32, out.shape);
  const Buffer o_blk = buffer(act, {1, n.c, n.hq, n.d_v}), l_blk = buffer(DType::f32, {1, n.hq, n.c});
  const Buffer bufs[2][2] = {{buffer(act, k.shape), buffer(act, v.shape)},
                             {buffer(act, k.shape), buffer(act, v.shape)}};
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
        for (int64_t b = 0; b < n.b; ++b) {
          mt::attention_forward(block(q, b, qs, n.c), block(cur_k, b, ks, n.c), block(cur_v, b, ks, n.c),
                                qc == kc ? sinks : Tensor(), args, o_blk.t, l_blk.t);
          mt::ring_merge(o_blk.t, l_blk.t, b, qs, acc.t, lse);
        }
      }
    pass.wait();
    cur_k = nx[0].t;
    cur_v = nx[1].t;
  }
  mt::cast(acc.t, out);
}

void ring_attention_backward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& dsinks) {
  const char* op = "ring_attention_backward";
  const Dims n = check_inputs(cp, q, k, v, sinks, a, out, lse, op);
  const DType act = activation_dtype(q);
  check_tensor(dout, "ring attention dout", act, out.shape);
  check_tensor(dq, "ring attention dq", act, q.shape);
  check_tensor(dk, "ring attention dk", act, k.shape);
  check_tensor(dv, "ring attention dv", act, v.shape);
  check_devices(q, {&dout, &dq, &dk, &dv, &dsinks}, op);
  const int r = cp.rank(), size = cp.size(), next = (r + 1) % size, prev = (r + size - 1) % size;
  auto buffer = [&](DType dtype, Shape shape) { return make_buffer(q.device, dtype, shape); };
  const Buffer dq_acc = buffer(DType::f32, q.shape);
  mt::fill(dq_acc.t, 0.0f);
  // The final lse of each (batch row, slot) as the contiguous [1,Hq,C] a block takes:
  // columns [slot C, slot C + C) of lse's [B Hq, 2C] rows.
  const Buffer lse_blocks = buffer(DType::f32, {n.b * 2, n.hq, n.c});
  for (int64_t b = 0; b < n.b; ++b)
    for (int qs = 0; qs < 2; ++qs)
      mt::copy_columns(lse_blocks.t.rows(b * 2 + qs, b * 2 + qs + 1), 0,
                       lse.view({n.b * n.hq, 2 * n.c}).rows(b * n.hq, (b + 1) * n.hq), qs * n.c, n.c, false);
  // attention_backward overwrites its gradients: each block's go to scratch first, then
  // into the fp32 sums.
  const Buffer dq_blk = buffer(act, {1, n.c, n.hq, n.d}), dk_blk = buffer(act, {1, n.c, n.hkv, n.d}),
               dv_blk = buffer(act, {1, n.c, n.hkv, n.d_v});
  auto pair = [&](DType t) { return std::array<Buffer, 2>{buffer(t, k.shape), buffer(t, v.shape)}; };
  const std::array<Buffer, 2> kv[2] = {pair(act), pair(act)};                  // K/V arriving for the next step
  const std::array<Buffer, 2> mine[2] = {pair(DType::f32), pair(DType::f32)};  // this step's dK/dV, then passed on
  const std::array<Buffer, 2> partial = pair(DType::f32);  // the partial sum arriving from the previous rank
  Tensor cur_k = k, cur_v = v;
  // Step s: K/V of rank r - s. Its dK/dV partial sum (ranks r - s .. r - 1 added)
  // arrives while this rank computes its share; meanwhile the sum of step s - 1
  // leaves for the next rank.
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
      ops.insert(ops.end(), {comm::send_to(done[0].t, next), comm::send_to(done[1].t, next),
                             comm::recv_from(partial[0].t, prev), comm::recv_from(partial[1].t, prev)});
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
          mt::accumulate(dq_blk.t, block(dq_acc.t, b, qs, n.c));
          mt::accumulate(dk_blk.t, block(acc[0].t, b, ks, n.c));
          mt::accumulate(dv_blk.t, block(acc[1].t, b, ks, n.c));
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

}  // namespace mt::parallel
