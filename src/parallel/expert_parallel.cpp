#include "parallel/expert_parallel.h"

#include <numeric>
#include <utility>

#include "core/check.h"
#include "kernels/dispatch.h"
#include "parallel/buffer.h"

namespace mt::parallel {

namespace {

// The rows that travel: f32 on the host, bf16 on the GPU (the dispatch kernels' dtypes).
DType row_dtype(const EpPlan& p) { return p.device == Device::cuda ? DType::bf16 : DType::f32; }

// A transfer buffer of rows x width elements on the plan's device.
Buffer rows_buffer(const EpPlan& p, int64_t rows, int64_t width) {
  return make_buffer(p.device, row_dtype(p), {rows, width});
}

// Row counts per rank -> element counts for the all-to-all-v.
std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

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

// i32 arrays carved out of one buffer on the plan's device (each 256-byte aligned): a
// plan's kept arrays in one allocation, its temporaries in another.
class Carve {
 public:
  explicit Carve(Device device) : device_(device) {}
  // `t` points into the buffer once allocate() has made it.
  void add(Tensor& t, Shape shape) { parts_.push_back({&t, shape}); }
  Buffer allocate() {
    constexpr int64_t kAlign = 64;  // i32 elements
    int64_t total = 0;
    std::vector<int64_t> at;
    for (const Part& part : parts_) {
      at.push_back(total);
      total += (part.shape.numel() + kAlign - 1) / kAlign * kAlign;
    }
    Buffer b = make_buffer(device_, DType::i32, {total});
    for (size_t i = 0; i < parts_.size(); ++i)
      *parts_[i].t = Tensor(static_cast<int32_t*>(b.t.data) + at[i], parts_[i].shape, DType::i32, device_);
    return b;
  }

 private:
  struct Part {
    Tensor* t;
    Shape shape;
  };
  Device device_;
  std::vector<Part> parts_;
};

const char* kind_name(EpExchange::Kind k) {
  static const char* const names[] = {"none in flight", "ep_dispatch_forward_start's", "ep_dispatch_backward_start's",
                                      "ep_combine_forward_start's", "ep_combine_backward_start's"};  // in Kind's order
  return names[static_cast<size_t>(k)];
}

// Waits for the transfer a finish of kind `k` joins; the exchange keeps its buffers
// until the caller has unpacked and empties it.
void join(EpExchange& ex, EpExchange::Kind k, const char* op) {
  MT_CHECK(ex.kind == k) << op << ": the exchange given is " << kind_name(ex.kind) << ", not "
                         << kind_name(k);
  ex.request.wait();
}

// Starts the all-to-all-v of `send` (rows per rank send_rows) into `recv`.
EpExchange start(comm::Communicator& ep, EpExchange::Kind kind, Buffer send, const Tensor& recv,
                 std::shared_ptr<void> recv_storage, const std::vector<int64_t>& send_rows,
                 const std::vector<int64_t>& recv_rows) {
  const int64_t d = send.t.dim(1);
  EpExchange ex;
  ex.kind = kind;
  ex.received = recv;
  ex.request = ep.start_all_to_all_v(send.t, times(send_rows, d), recv, times(recv_rows, d), comm::Traffic::expert);
  ex.send_storage = std::move(send.storage);
  ex.recv_storage = std::move(recv_storage);
  return ex;
}

}  // namespace

int64_t EpPlan::sent_rows() const { return sum(sent_rows_to); }
int64_t EpPlan::received_rows() const { return sum(recv_rows_from); }
int64_t EpPlan::local_rows() const { return sum(slots_from); }
int64_t EpPlan::returned_rows() const { return sum(slots_to); }

namespace {

EpPlan build_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts, int64_t capacity) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2 && idx.dim(1) >= 1)
      << "ep_plan wants router idx i32 [N,k] (k >= 1), got " << idx.str();
  MT_CHECK(idx.data != nullptr || idx.numel() == 0) << "ep_plan: idx " << idx.str() << " has no storage";
  MT_CHECK(capacity >= 0) << "ep_plan: capacity " << capacity << " should be >= 0";
  const int64_t n = idx.dim(0), k = idx.dim(1), size = ep.size();
  MT_CHECK(num_experts >= 1 && num_experts % size == 0)
      << "ep_plan: " << num_experts << " experts do not split evenly over " << size << " expert-parallel ranks";
  const int64_t per = num_experts / size, slots = n * k;
  EpPlan p;
  p.tokens = n;
  p.top_k = k;
  p.device = idx.device;

  // The sender: its rows numbered by (rank, token), a counting sort of each token's
  // first slot to a rank by that rank; its slots by (expert, token, j), the order in
  // which their outputs come back. Both counts per rank go to the ranks concerned.
  Tensor row_buckets, row_counts, row_offsets, expert_offsets, slot_order, counts_io;
  Carve keep(p.device), temp(p.device);
  keep.add(p.sent_slot, {slots});
  keep.add(p.token_rows, {slots});
  keep.add(p.slot_row, {slots});
  keep.add(p.expert_counts, {num_experts});
  temp.add(row_buckets, {n, k});
  temp.add(row_counts, {size});
  temp.add(row_offsets, {size + 1});
  temp.add(expert_offsets, {num_experts + 1});
  temp.add(slot_order, {slots});
  temp.add(counts_io, {2, size, 2});  // [rows, slots] to each rank, then from each rank
  p.storage.push_back(keep.allocate().storage);
  const Buffer sender_temp = temp.allocate();
  mt::ep_row_buckets(idx, per, num_experts, row_buckets);
  mt::dispatch_sort(row_buckets, size, 0, row_counts, row_offsets, p.sent_slot, p.token_rows);
  mt::dispatch_sort(idx, num_experts, 0, p.expert_counts, expert_offsets, slot_order, p.slot_row);
  const Tensor sent_counts = counts_io.rows(0, 1).view({size, 2}), recv_counts = counts_io.rows(1, 2).view({size, 2});
  mt::ep_pack_counts(row_counts, expert_offsets, per, sent_counts);
  const std::vector<int64_t> twos(static_cast<size_t>(size), 2);
  ep.all_to_all_v(sent_counts.view({2 * size}), twos, recv_counts.view({2 * size}), twos);
  // The one read of a dropless plan: what the host needs to size every exchange.
  std::vector<int32_t> counts(static_cast<size_t>(4 * size));
  mt::read_counts({counts_io}, counts.data());
  for (int64_t r = 0; r < size; ++r) {
    p.sent_rows_to.push_back(counts[2 * r]);
    p.slots_to.push_back(counts[2 * r + 1]);
    p.recv_rows_from.push_back(counts[2 * (size + r)]);
    p.slots_from.push_back(counts[2 * (size + r) + 1]);
  }
  const int64_t sent = p.sent_rows(), received = p.received_rows(), local = p.local_rows();
  p.sent_slot = p.sent_slot.rows(0, sent);

  // The receiver: each row's expert ids as its local experts (-1: another rank's), its
  // copies sorted by local expert (capped by the capacity), then the xs rows sorted by
  // source rank, the order in which the outputs go back.
  Tensor send_buckets, recv_buckets, local_counts, return_buckets, return_counts, return_offsets;
  Carve keep_r(p.device), temp_r(p.device);
  keep_r.add(p.order, {local});
  keep_r.add(p.local_slot_row, {received * k});
  keep_r.add(p.offsets, {per + 1});
  keep_r.add(p.return_row, {local});
  keep_r.add(p.return_pos, {local});
  temp_r.add(send_buckets, {sent, k});
  temp_r.add(recv_buckets, {received, k});
  temp_r.add(local_counts, {per});
  temp_r.add(return_buckets, {local, 1});
  temp_r.add(return_counts, {size});
  temp_r.add(return_offsets, {size + 1});
  p.storage.push_back(keep_r.allocate().storage);
  const Buffer receiver_temp = temp_r.allocate();
  mt::ep_send_buckets(idx, p.sent_slot, per, send_buckets);
  ep.all_to_all_v(send_buckets, times(p.sent_rows_to, k), recv_buckets, times(p.recv_rows_from, k));
  mt::dispatch_sort(recv_buckets, per, capacity, local_counts, p.offsets, p.order, p.local_slot_row);
  mt::ep_return_buckets(p.order, p.offsets, recv_counts, k, return_buckets.view({local}));
  mt::dispatch_sort(return_buckets, size, 0, return_counts, return_offsets, p.return_row, p.return_pos);

  if (capacity > 0) {
    // Each sender learns which of its slots were kept (the receiver's xs row of every
    // slot of every row it sent, -1 for dropped), and sorts the kept ones by expert
    // again: the rows of `back` renumbered over the kept slots, dropped ones -1.
    Tensor kept_rows, kept_buckets, kept_offsets, kept_order;
    Carve temp_c(p.device);
    temp_c.add(kept_rows, {sent * k});
    temp_c.add(kept_buckets, {n, k});
    temp_c.add(kept_offsets, {num_experts + 1});
    temp_c.add(kept_order, {slots});
    const Buffer capacity_temp = temp_c.allocate();
    ep.all_to_all_v(p.local_slot_row, times(p.recv_rows_from, k), kept_rows, times(p.sent_rows_to, k));
    mt::ep_kept_buckets(idx, p.token_rows, kept_rows, per, kept_buckets);
    mt::dispatch_sort(kept_buckets, num_experts, 0, p.expert_counts, kept_offsets, kept_order, p.slot_row);
    // The second read: kept slots per rank, sent and received.
    std::vector<int32_t> kept(static_cast<size_t>(num_experts + 1 + size));
    mt::read_counts({kept_offsets, return_counts}, kept.data());
    for (int64_t r = 0; r < size; ++r) {
      p.slots_to[r] = kept[(r + 1) * per] - kept[r * per];
      p.slots_from[r] = kept[num_experts + 1 + r];
    }
    p.dropped = slots - p.returned_rows();
    const int64_t kept_here = p.local_rows();
    p.order = p.order.rows(0, kept_here);
    p.return_row = p.return_row.rows(0, kept_here);
    p.return_pos = p.return_pos.rows(0, kept_here);
  }
  return p;
}

}  // namespace

EpExchange ep_dispatch_forward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& x) {
  const char* op = "ep_dispatch_forward";
  const int64_t d = width_of(x, op, "x");
  check_device(plan, {&x}, op);
  check_tensor(x, "ep dispatch x", row_dtype(plan), {plan.tokens, d});
  Buffer send = rows_buffer(plan, plan.sent_rows(), d), recv = rows_buffer(plan, plan.received_rows(), d);
  mt::dispatch_forward(x, plan.sent_slot, plan.top_k, send.t);
  return start(ep, EpExchange::Kind::dispatch_forward, std::move(send), recv.t, recv.storage, plan.sent_rows_to,
               plan.recv_rows_from);
}

void ep_dispatch_forward_finish(EpExchange& ex, const EpPlan& plan, const Tensor& xs) {
  const char* op = "ep_dispatch_forward_finish";
  join(ex, EpExchange::Kind::dispatch_forward, op);
  check_device(plan, {&xs}, op);
  check_tensor(xs, "ep dispatch xs", row_dtype(plan), {plan.local_rows(), ex.received.dim(1)});
  mt::dispatch_forward(ex.received, plan.order, plan.top_k, xs);
  ex = EpExchange();
}

EpExchange ep_dispatch_backward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& dxs) {
  const char* op = "ep_dispatch_backward";
  const int64_t d = width_of(dxs, op, "dxs");
  check_device(plan, {&dxs}, op);
  check_tensor(dxs, "ep dispatch dxs", row_dtype(plan), {plan.local_rows(), d});
  Buffer drecv = rows_buffer(plan, plan.received_rows(), d), dsend = rows_buffer(plan, plan.sent_rows(), d);
  // A received row's copies (one per local expert) add up here, so one row per
  // (token, rank) travels back, and the token's rank adds the ranks' rows.
  mt::dispatch_backward(dxs, plan.local_slot_row, drecv.t);
  return start(ep, EpExchange::Kind::dispatch_backward, std::move(drecv), dsend.t, dsend.storage,
               plan.recv_rows_from, plan.sent_rows_to);
}

void ep_dispatch_backward_finish(EpExchange& ex, const EpPlan& plan, const Tensor& dx) {
  const char* op = "ep_dispatch_backward_finish";
  join(ex, EpExchange::Kind::dispatch_backward, op);
  check_device(plan, {&dx}, op);
  check_tensor(dx, "ep dispatch dx", row_dtype(plan), {plan.tokens, ex.received.dim(1)});
  mt::dispatch_backward(ex.received, plan.token_rows, dx);
  ex = EpExchange();
}

EpExchange ep_combine_forward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& ys,
                                    const Tensor& back) {
  const char* op = "ep_combine_forward";
  const int64_t d = width_of(ys, op, "ys");
  check_device(plan, {&ys, &back}, op);
  check_tensor(ys, "ep combine ys", row_dtype(plan), {plan.local_rows(), d});
  check_tensor(back, "ep combine back", row_dtype(plan), {plan.returned_rows(), d});
  Buffer ret = rows_buffer(plan, plan.local_rows(), d);
  mt::dispatch_forward(ys, plan.return_row, 1, ret.t);
  return start(ep, EpExchange::Kind::combine_forward, std::move(ret), back, nullptr, plan.slots_from,
               plan.slots_to);
}

void ep_combine_forward_finish(EpExchange& ex, const EpPlan& plan, const Tensor& weight, const Tensor& y) {
  const char* op = "ep_combine_forward_finish";
  join(ex, EpExchange::Kind::combine_forward, op);
  check_device(plan, {&weight, &y}, op);
  check_tensor(weight, "ep combine weight", DType::f32, {plan.tokens, plan.top_k});
  check_tensor(y, "ep combine y", row_dtype(plan), {plan.tokens, ex.received.dim(1)});
  mt::combine_forward(ex.received, weight, plan.slot_row, y);
  ex = EpExchange();
}

EpExchange ep_combine_backward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& back,
                                     const Tensor& weight, const Tensor& dy, const Tensor& dweight) {
  const char* op = "ep_combine_backward";
  const int64_t d = width_of(dy, op, "dy");
  check_device(plan, {&back, &weight, &dy, &dweight}, op);
  check_tensor(back, "ep combine back", row_dtype(plan), {plan.returned_rows(), d});
  check_tensor(dy, "ep combine dy", row_dtype(plan), {plan.tokens, d});
  Buffer dback = rows_buffer(plan, plan.returned_rows(), d), dret = rows_buffer(plan, plan.local_rows(), d);
  mt::combine_backward(back, weight, plan.slot_row, dy, dback.t, dweight);
  return start(ep, EpExchange::Kind::combine_backward, std::move(dback), dret.t, dret.storage, plan.slots_to,
               plan.slots_from);
}

void ep_combine_backward_finish(EpExchange& ex, const EpPlan& plan, const Tensor& dys) {
  const char* op = "ep_combine_backward_finish";
  join(ex, EpExchange::Kind::combine_backward, op);
  check_device(plan, {&dys}, op);
  check_tensor(dys, "ep combine dys", row_dtype(plan), {plan.local_rows(), ex.received.dim(1)});
  mt::dispatch_forward(ex.received, plan.return_pos, 1, dys);
  ex = EpExchange();
}

RoutedMark mark_routed([[maybe_unused]] const Tensor& idx) {
  RoutedMark m;
#ifdef MOETRAIN_WITH_CUDA
  if (idx.device == Device::cuda) m.event = std::make_shared<cuda::Event>(cuda::Event::record(cuda::stream()));
#endif
  return m;
}

EpPlan ep_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts, int64_t capacity,
               [[maybe_unused]] const RoutedMark& routed) {
#ifdef MOETRAIN_WITH_CUDA
  if (idx.device == Device::cuda) {
    static const cudaStream_t plan_stream = [] {
      int least = 0, greatest = 0;
      CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      cudaStream_t s = nullptr;
      CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
      return s;
    }();
    const cudaStream_t caller = cuda::stream();
    if (routed.event)
      static_cast<const cuda::Event*>(routed.event.get())->wait(plan_stream);
    else
      cuda::join(plan_stream, caller);
    EpPlan p = [&] {
      cuda::StreamScope scope(plan_stream);
      return build_plan(ep, idx, num_experts, capacity);
    }();
    cuda::join(caller, plan_stream);
    return p;
  }
#endif
  return build_plan(ep, idx, num_experts, capacity);
}

}  // namespace mt::parallel
