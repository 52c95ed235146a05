#include "parallel/expert_parallel.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/dispatch.h"

namespace mt::parallel {

namespace {

Tensor index_tensor(const std::vector<int32_t>& v) {
  return Tensor(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())}, DType::i32);
}

Tensor i64_tensor(std::vector<int64_t>& v) { return Tensor(v.data(), {static_cast<int64_t>(v.size())}, DType::i64); }

// A transfer buffer of rows x width floats, alive for one call.
Tensor rows_buffer(std::vector<float>& storage, int64_t rows, int64_t width) {
  storage.resize(static_cast<size_t>(rows * width));
  return Tensor(storage.data(), {rows, width}, DType::f32);
}

// Row counts per rank -> element counts for the all-to-all-v.
std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

// The plan's index arrays are host memory; a GPU tensor here needs the GPU version.
void check_host(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    MT_CHECK(t->device == Device::cpu) << op << ": expert parallelism runs on host tensors for now, got " << t->str();
}

int64_t width_of(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.ndim() == 2) << op << ": " << name << " should be 2-D, got " << t.str();
  return t.dim(1);
}

}  // namespace

int64_t EpPlan::received_rows() const {
  int64_t u = 0;
  for (int64_t r : recv_rows_from) u += r;
  return u;
}

Tensor EpPlan::offsets_tensor() const { return index_tensor(offsets); }

std::vector<int64_t> EpPlan::local_counts() const {
  std::vector<int64_t> c(static_cast<size_t>(local_experts));
  for (int64_t e = 0; e < local_experts; ++e) c[e] = offsets[e + 1] - offsets[e];
  return c;
}

EpPlan ep_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2 && idx.device == Device::cpu && idx.dim(1) >= 1)
      << "ep_plan wants router idx i32 [N,k] (k >= 1) on the host, got " << idx.str();
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
  const int32_t* id = idx.i32();
  for (int64_t s = 0; s < n * k; ++s)
    MT_CHECK(id[s] >= 0 && id[s] < num_experts) << "ep_plan: idx of token " << s / k << " slot " << s % k << " is "
                                                << id[s] << ", outside [0, " << num_experts << ")";

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
  cpu::dispatch_plan(Tensor(recv_idx.data(), {u_rows, k}, DType::i32), per + 1, 0, index_tensor(counts),
                     index_tensor(offsets), index_tensor(order), index_tensor(p.local_slot_row));
  const int32_t local = offsets[per];
  p.order.assign(order.begin(), order.begin() + local);
  p.offsets.assign(offsets.begin(), offsets.begin() + per + 1);
  for (int32_t& r : p.local_slot_row)
    if (r >= local) r = -1;

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
  return p;
}

void ep_dispatch_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& x, const Tensor& xs) {
  const char* op = "ep_dispatch_forward";
  const int64_t d = width_of(x, op, "x");
  check_host({&x, &xs}, op);
  check_tensor(x, "ep dispatch x", DType::f32, {plan.tokens, d});
  check_tensor(xs, "ep dispatch xs", DType::f32, {plan.local_rows(), d});
  std::vector<float> send_storage, recv_storage;
  Tensor send = rows_buffer(send_storage, plan.sent_rows(), d);
  Tensor recv = rows_buffer(recv_storage, plan.received_rows(), d);
  mt::dispatch_forward(x, index_tensor(plan.sent_token), 1, send);
  ep.all_to_all_v(send, times(plan.sent_rows_to, d), recv, times(plan.recv_rows_from, d));
  mt::dispatch_forward(recv, index_tensor(plan.order), plan.top_k, xs);
}

void ep_dispatch_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& dxs, const Tensor& dx) {
  const char* op = "ep_dispatch_backward";
  const int64_t d = width_of(dxs, op, "dxs");
  check_host({&dxs, &dx}, op);
  check_tensor(dxs, "ep dispatch dxs", DType::f32, {plan.local_rows(), d});
  check_tensor(dx, "ep dispatch dx", DType::f32, {plan.tokens, d});
  std::vector<float> recv_storage, send_storage;
  Tensor drecv = rows_buffer(recv_storage, plan.received_rows(), d);
  Tensor dsend = rows_buffer(send_storage, plan.sent_rows(), d);
  // A received row's copies (one per local expert) add up here, so one row per
  // (token, rank) travels back, and the token's rank adds the ranks' rows.
  mt::dispatch_backward(dxs, index_tensor(plan.local_slot_row), drecv);
  ep.all_to_all_v(drecv, times(plan.recv_rows_from, d), dsend, times(plan.sent_rows_to, d));
  mt::dispatch_backward(dsend, index_tensor(plan.token_rows), dx);
}

void ep_combine_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& ys, const Tensor& weight,
                        const Tensor& back, const Tensor& y) {
  const char* op = "ep_combine_forward";
  const int64_t d = width_of(ys, op, "ys");
  check_host({&ys, &weight, &back, &y}, op);
  check_tensor(ys, "ep combine ys", DType::f32, {plan.local_rows(), d});
  check_tensor(weight, "ep combine weight", DType::f32, {plan.tokens, plan.top_k});
  check_tensor(back, "ep combine back", DType::f32, {plan.returned_rows(), d});
  check_tensor(y, "ep combine y", DType::f32, {plan.tokens, d});
  std::vector<float> ret_storage;
  Tensor ret = rows_buffer(ret_storage, plan.local_rows(), d);
  mt::dispatch_forward(ys, index_tensor(plan.return_row), 1, ret);
  ep.all_to_all_v(ret, times(plan.slots_from, d), back, times(plan.slots_to, d));
  mt::combine_forward(back, weight, index_tensor(plan.slot_row), y);
}

void ep_combine_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& back, const Tensor& weight,
                         const Tensor& dy, const Tensor& dys, const Tensor& dweight) {
  const char* op = "ep_combine_backward";
  const int64_t d = width_of(dy, op, "dy");
  check_host({&back, &weight, &dy, &dys, &dweight}, op);
  check_tensor(back, "ep combine back", DType::f32, {plan.returned_rows(), d});
  check_tensor(dy, "ep combine dy", DType::f32, {plan.tokens, d});
  check_tensor(dys, "ep combine dys", DType::f32, {plan.local_rows(), d});
  std::vector<float> back_storage, ret_storage;
  Tensor dback = rows_buffer(back_storage, plan.returned_rows(), d);
  Tensor dret = rows_buffer(ret_storage, plan.local_rows(), d);
  mt::combine_backward(back, weight, index_tensor(plan.slot_row), dy, dback, dweight);
  ep.all_to_all_v(dback, times(plan.slots_to, d), dret, times(plan.slots_from, d));
  mt::dispatch_forward(dret, index_tensor(plan.return_pos), 1, dys);
}

}  // namespace mt::parallel
