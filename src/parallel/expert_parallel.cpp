#include "parallel/expert_parallel.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "parallel/buffer.h"

namespace mt::parallel {

namespace {

Tensor index_tensor(const std::vector<int32_t>& v) {
  return Tensor(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())}, DType::i32);
}

Tensor i64_tensor(std::vector<int64_t>& v) { return Tensor(v.data(), {static_cast<int64_t>(v.size())}, DType::i64); }

// An index array where the plan's kernels read it: the host vector, or its GPU copy.
Tensor indices(const EpPlan& p, const std::vector<int32_t>& host, const Tensor& gpu) {
  return p.device == Device::cuda ? gpu : index_tensor(host);
}

// The rows that travel: f32 on the host, bf16 on the GPU (the dispatch kernels' dtypes).
DType row_dtype(const EpPlan& p) { return p.device == Device::cuda ? DType::bf16 : DType::f32; }

// A transfer buffer of rows x width elements on the plan's device, alive for one call.
Buffer rows_buffer(const EpPlan& p, int64_t rows, int64_t width) {
  return make_buffer(p.device, row_dtype(p), {rows, width});
}

// Row counts per rank -> element counts for the all-to-all-v.
std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

// The plan's index arrays are where its idx was; every tensor of the exchange must be too.
void check_device(const EpPlan& p, std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    MT_CHECK(t->device == p.device) << op << ": " << t->str() << " is not on the plan's device ("
                                    << (p.device == Device::cuda ? "cuda" : "cpu")
                                    << ", where the router's idx was)";
}

int64_t width_of(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.ndim() == 2) << op << ": " << name << " should be 2-D, got " << t.str();
  return t.dim(1);
}

// The index arrays the kernels read, copied to the GPU in one block (each array
// 256-byte aligned in it); the host vectors stay for the counts and the metrics.
void upload(EpPlan& p) {
  const std::vector<int32_t>* host[] = {&p.sent_token, &p.token_rows, &p.slot_row,   &p.order,
                                        &p.local_slot_row, &p.return_row, &p.return_pos, &p.offsets};
  Tensor* dev[] = {&p.gpu.sent_token, &p.gpu.token_rows, &p.gpu.slot_row,   &p.gpu.order,
                   &p.gpu.local_slot_row, &p.gpu.return_row, &p.gpu.return_pos, &p.gpu.offsets};
  constexpr int64_t kAlign = 64;  // i32 elements
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const std::vector<int32_t>* v : host) {
    at.push_back(total);
    total += (static_cast<int64_t>(v->size()) + kAlign - 1) / kAlign * kAlign;
  }
  std::vector<int32_t> packed(static_cast<size_t>(total), -1);
  for (size_t i = 0; i < at.size(); ++i) std::copy(host[i]->begin(), host[i]->end(), packed.begin() + at[i]);
  Buffer block = make_buffer(Device::cuda, DType::i32, {total});
  mt::copy(block.t, Tensor(packed.data(), {total}, DType::i32));  // waits: `packed` may go
  for (size_t i = 0; i < at.size(); ++i)
    *dev[i] = block.t.rows(at[i], at[i] + static_cast<int64_t>(host[i]->size()));
  p.gpu.block = block.storage;
  p.device = Device::cuda;
}

}  // namespace

int64_t EpPlan::received_rows() const {
  int64_t u = 0;
  for (int64_t r : recv_rows_from) u += r;
  return u;
}

Tensor EpPlan::offsets_tensor() const { return indices(*this, offsets, gpu.offsets); }

std::vector<int64_t> EpPlan::local_counts() const {
  std::vector<int64_t> c(static_cast<size_t>(local_experts));
  for (int64_t e = 0; e < local_experts; ++e) c[e] = offsets[e + 1] - offsets[e];
  return c;
}

int64_t EpPlan::returned_rows() const {
  int64_t n = 0;
  for (int64_t r : slots_to) n += r;
  return n;
}

EpPlan ep_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts, int64_t capacity) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2 && idx.dim(1) >= 1)
      << "ep_plan wants router idx i32 [N,k] (k >= 1), got " << idx.str();
  MT_CHECK(idx.data != nullptr || idx.numel() == 0) << "ep_plan: idx " << idx.str() << " has no storage";
  const int64_t n = idx.dim(0), k = idx.dim(1), size = ep.size();
  MT_CHECK(num_experts >= 1 && num_experts % size == 0)
      << "ep_plan: " << num_experts << " experts do not split evenly over " << size << " expert-parallel ranks";
  const int64_t per = num_experts / size;
  EpPlan p;
  p.tokens = n;
  p.top_k = k;
  p.num_experts = num_experts;
  p.ep_size = size;
  p.first_expert = ep.rank() * per;
  p.local_experts = per;
  // The plan is built on the host: a GPU idx comes over first (the exchange's one wait).
  std::vector<int32_t> idx_host;
  if (idx.device == Device::cuda) {
    idx_host.resize(static_cast<size_t>(n * k));
    mt::copy(Tensor(idx_host.data(), idx.shape, DType::i32), idx);
  }
  const int32_t* id = idx.device == Device::cuda ? idx_host.data() : idx.i32();
  p.expert_counts.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t s = 0; s < n * k; ++s) {
    MT_CHECK(id[s] >= 0 && id[s] < num_experts) << "ep_plan: idx of token " << s / k << " slot " << s % k << " is "
                                                << id[s] << ", outside [0, " << num_experts << ")";
    ++p.expert_counts[id[s]];
  }

  // Each token's destination ranks, increasing: token_rows holds them for now and
  // becomes the sent-row numbers below. `seen` dedups a rank owning several of the
  // token's experts.
  p.token_rows.assign(static_cast<size_t>(n * k), -1);
  p.sent_rows_to.assign(static_cast<size_t>(size), 0);
  p.slots_to.assign(static_cast<size_t>(size), 0);
  std::vector<int64_t> seen(static_cast<size_t>(size), -1);
  for (int64_t t = 0; t < n; ++t) {
    int32_t* dest = p.token_rows.data() + t * k;
    int64_t count = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = id[t * k + j] / per;
      ++p.slots_to[r];
      if (seen[r] == t) continue;
      seen[r] = t;
      dest[count++] = static_cast<int32_t>(r);
      ++p.sent_rows_to[r];
    }
    std::sort(dest, dest + count);
  }

  // Counting sort of the (token, rank) rows by rank, tokens increasing within a rank;
  // the returned outputs likewise by rank, then token, then slot.
  std::vector<int64_t> next_row(static_cast<size_t>(size), 0), next_slot(next_row.size(), 0);
  for (int64_t r = 1; r < size; ++r) {
    next_row[r] = next_row[r - 1] + p.sent_rows_to[r - 1];
    next_slot[r] = next_slot[r - 1] + p.slots_to[r - 1];
  }
  p.sent_token.resize(static_cast<size_t>(next_row[size - 1] + p.sent_rows_to[size - 1]));
  p.slot_row.resize(static_cast<size_t>(n * k));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t q = 0; q < k && p.token_rows[t * k + q] >= 0; ++q) {
      const int64_t r = p.token_rows[t * k + q];
      p.sent_token[next_row[r]] = static_cast<int32_t>(t);
      p.token_rows[t * k + q] = static_cast<int32_t>(next_row[r]++);
    }
    for (int64_t j = 0; j < k; ++j) p.slot_row[t * k + j] = static_cast<int32_t>(next_slot[id[t * k + j] / per]++);
  }

  // Counts first, so every rank can size what it receives; then each sent row's k
  // expert ids, which tell the receiver which of its experts want the row.
  std::vector<int64_t> ones(static_cast<size_t>(size), 1);
  p.recv_rows_from.assign(static_cast<size_t>(size), 0);
  ep.all_to_all_v(i64_tensor(p.sent_rows_to), ones, i64_tensor(p.recv_rows_from), ones);
  const int64_t u_rows = p.received_rows();
  std::vector<int32_t> send_idx(static_cast<size_t>(p.sent_rows() * k)), recv_idx(static_cast<size_t>(u_rows * k));
  for (int64_t s = 0; s < p.sent_rows(); ++s) std::copy_n(id + p.sent_token[s] * k, k, send_idx.begin() + s * k);
  ep.all_to_all_v(index_tensor(send_idx), times(p.sent_rows_to, k), index_tensor(recv_idx),
                  times(p.recv_rows_from, k));

  // The receiver's counting sort by local expert (cpu::dispatch_plan), with the slots
  // whose expert lives elsewhere in one extra bucket after the local ones, dropped.
  for (int32_t& e : recv_idx)
    e = e >= p.first_expert && e < p.first_expert + per ? static_cast<int32_t>(e - p.first_expert)
                                                         : static_cast<int32_t>(per);
  std::vector<int32_t> counts(static_cast<size_t>(per + 1)), offsets(static_cast<size_t>(per + 2));
  std::vector<int32_t> order(recv_idx.size());
  p.local_slot_row.resize(recv_idx.size());
  // A capacity caps the extra bucket too, harmlessly: its slots are dropped anyway.
  MT_CHECK(capacity >= 0) << "ep_plan: capacity " << capacity << " should be >= 0";
  cpu::dispatch_plan(Tensor(recv_idx.data(), {u_rows, k}, DType::i32), per + 1, capacity, index_tensor(counts),
                     index_tensor(offsets), index_tensor(order), index_tensor(p.local_slot_row));
  const int32_t local = offsets[per];
  p.order.assign(order.begin(), order.begin() + local);
  p.offsets.assign(offsets.begin(), offsets.begin() + per + 1);
  for (int32_t& r : p.local_slot_row)
    if (r >= local) r = -1;
  if (capacity > 0) {
    // Each sender learns which of its slots for this rank's experts were kept (1) or
    // dropped (0), in the (token, slot) order it numbered them, and renumbers the rows
    // of `back` over the kept ones.
    std::vector<int32_t> kept_here, kept_there(static_cast<size_t>(p.returned_rows()));
    std::vector<int64_t> local_from(static_cast<size_t>(size), 0);
    int64_t u = 0;
    for (int64_t r = 0; r < size; ++r)
      for (int64_t end = u + p.recv_rows_from[r]; u < end; ++u)
        for (int64_t j = 0; j < k; ++j)
          if (recv_idx[u * k + j] < per) {
            kept_here.push_back(p.local_slot_row[u * k + j] >= 0 ? 1 : 0);
            ++local_from[r];
          }
    ep.all_to_all_v(index_tensor(kept_here), local_from, index_tensor(kept_there), p.slots_to);
    std::vector<int64_t> kept_to(static_cast<size_t>(size), 0), first(static_cast<size_t>(size), 0);
    for (int64_t r = 0, at = 0; r < size; at += p.slots_to[r], ++r) {
      first[r] = at;
      for (int64_t i = 0; i < p.slots_to[r]; ++i) kept_to[r] += kept_there[at + i];
    }
    std::vector<int64_t> seen_to(static_cast<size_t>(size), 0), next(static_cast<size_t>(size), 0);
    for (int64_t r = 1; r < size; ++r) next[r] = next[r - 1] + kept_to[r - 1];
    for (int64_t s = 0; s < n * k; ++s) {
      const int64_t r = id[s] / per;
      if (kept_there[first[r] + seen_to[r]++] != 0) {
        p.slot_row[s] = static_cast<int32_t>(next[r]++);
      } else {
        p.slot_row[s] = -1;
        --p.expert_counts[id[s]];
        ++p.dropped;
      }
    }
    p.slots_to = kept_to;
  }

  // Outputs go back in the order the source expects: by source rank, token, slot.
  p.slots_from.assign(static_cast<size_t>(size), 0);
  p.return_row.reserve(static_cast<size_t>(local));
  int64_t u = 0;
  for (int64_t r = 0; r < size; ++r)
    for (int64_t end = u + p.recv_rows_from[r]; u < end; ++u)
      for (int64_t j = 0; j < k; ++j)
        if (p.local_slot_row[u * k + j] >= 0) {
          p.return_row.push_back(p.local_slot_row[u * k + j]);
          ++p.slots_from[r];
        }
  p.return_pos.resize(p.return_row.size());
  for (size_t i = 0; i < p.return_row.size(); ++i) p.return_pos[p.return_row[i]] = static_cast<int32_t>(i);
  if (idx.device == Device::cuda) upload(p);
  return p;
}

void ep_dispatch_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& x, const Tensor& xs) {
  const char* op = "ep_dispatch_forward";
  const int64_t d = width_of(x, op, "x");
  check_device(plan, {&x, &xs}, op);
  check_tensor(x, "ep dispatch x", row_dtype(plan), {plan.tokens, d});
  check_tensor(xs, "ep dispatch xs", row_dtype(plan), {plan.local_rows(), d});
  const Buffer send = rows_buffer(plan, plan.sent_rows(), d), recv = rows_buffer(plan, plan.received_rows(), d);
  mt::dispatch_forward(x, indices(plan, plan.sent_token, plan.gpu.sent_token), 1, send.t);
  ep.all_to_all_v(send.t, times(plan.sent_rows_to, d), recv.t, times(plan.recv_rows_from, d));
  mt::dispatch_forward(recv.t, indices(plan, plan.order, plan.gpu.order), plan.top_k, xs);
}

void ep_dispatch_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& dxs, const Tensor& dx) {
  const char* op = "ep_dispatch_backward";
  const int64_t d = width_of(dxs, op, "dxs");
  check_device(plan, {&dxs, &dx}, op);
  check_tensor(dxs, "ep dispatch dxs", row_dtype(plan), {plan.local_rows(), d});
  check_tensor(dx, "ep dispatch dx", row_dtype(plan), {plan.tokens, d});
  const Buffer drecv = rows_buffer(plan, plan.received_rows(), d), dsend = rows_buffer(plan, plan.sent_rows(), d);
  // A received row's copies (one per local expert) add up here, so one row per
  // (token, rank) travels back, and the token's rank adds the ranks' rows.
  mt::dispatch_backward(dxs, indices(plan, plan.local_slot_row, plan.gpu.local_slot_row), drecv.t);
  ep.all_to_all_v(drecv.t, times(plan.recv_rows_from, d), dsend.t, times(plan.sent_rows_to, d));
  mt::dispatch_backward(dsend.t, indices(plan, plan.token_rows, plan.gpu.token_rows), dx);
}

void ep_combine_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& ys, const Tensor& weight,
                        const Tensor& back, const Tensor& y) {
  const char* op = "ep_combine_forward";
  const int64_t d = width_of(ys, op, "ys");
  check_device(plan, {&ys, &weight, &back, &y}, op);
  check_tensor(ys, "ep combine ys", row_dtype(plan), {plan.local_rows(), d});
  check_tensor(weight, "ep combine weight", DType::f32, {plan.tokens, plan.top_k});
  check_tensor(back, "ep combine back", row_dtype(plan), {plan.returned_rows(), d});
  check_tensor(y, "ep combine y", row_dtype(plan), {plan.tokens, d});
  const Buffer ret = rows_buffer(plan, plan.local_rows(), d);
  mt::dispatch_forward(ys, indices(plan, plan.return_row, plan.gpu.return_row), 1, ret.t);
  ep.all_to_all_v(ret.t, times(plan.slots_from, d), back, times(plan.slots_to, d));
  mt::combine_forward(back, weight, indices(plan, plan.slot_row, plan.gpu.slot_row), y);
}

void ep_combine_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& back, const Tensor& weight,
                         const Tensor& dy, const Tensor& dys, const Tensor& dweight) {
  const char* op = "ep_combine_backward";
  const int64_t d = width_of(dy, op, "dy");
  check_device(plan, {&back, &weight, &dy, &dys, &dweight}, op);
  check_tensor(back, "ep combine back", row_dtype(plan), {plan.returned_rows(), d});
  check_tensor(dy, "ep combine dy", row_dtype(plan), {plan.tokens, d});
  check_tensor(dys, "ep combine dys", row_dtype(plan), {plan.local_rows(), d});
  const Buffer dback = rows_buffer(plan, plan.returned_rows(), d), dret = rows_buffer(plan, plan.local_rows(), d);
  mt::combine_backward(back, weight, indices(plan, plan.slot_row, plan.gpu.slot_row), dy, dback.t, dweight);
  ep.all_to_all_v(dback.t, times(plan.slots_to, d), dret.t, times(plan.slots_from, d));
  mt::dispatch_forward(dret.t, indices(plan, plan.return_pos, plan.gpu.return_pos), 1, dys);
}

}  // namespace mt::parallel
