#include "kernels/dispatch.h"

#include <algorithm>
#include <vector>

namespace mt::cpu {

namespace {

// 1-D i32 with at least `need` entries.
void check_index_tensor(const Tensor& t, const char* name, int64_t need) {
  MT_CHECK(t.dtype == DType::i32 && t.ndim() == 1 && t.dim(0) >= need)
      << name << " should be i32 with at least " << need << " entries, got " << t.str();
  MT_CHECK(t.data != nullptr || need == 0) << name << " " << t.str() << " has no storage";
}

// slot_row [N*k] for x/y [N,D]: every entry a row of the [R,D] expert-ordered tensor or
// -1. Checked once up front so the parallel loops can trust it. Returns k.
int64_t check_slot_row(const Tensor& slot_row, int64_t tokens, int64_t rows) {
  MT_CHECK(slot_row.dtype == DType::i32 && slot_row.ndim() == 1 &&
           (tokens == 0 ? slot_row.dim(0) == 0 : slot_row.dim(0) % tokens == 0))
      << "slot_row should be i32 [N*k] with N=" << tokens << ", got " << slot_row.str();
  const int32_t* sr = slot_row.i32();
  int64_t slots = slot_row.dim(0);
  int64_t k = tokens == 0 ? 0 : slots / tokens;
  for (int64_t s = 0; s < slots; ++s)
    MT_CHECK(sr[s] >= -1 && sr[s] < rows) << "slot_row[" << s << "] (token " << s / k << ", slot " << s % k << ") is "
                                          << sr[s] << ", expected -1 or a row in [0, " << rows << ")";
  return k;
}

// The counting sort of dispatch_plan and dispatch_sort; `lowest` is 0 (every slot has a
// bucket, and order room for every slot) or -1 (a slot may go nowhere). Returns the slots
// the capacity dropped.
int64_t counting_sort(const Tensor& idx, int64_t num_buckets, int64_t capacity, int32_t lowest, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2) << "dispatch idx should be i32 [N,k], got " << idx.str();
  MT_CHECK(num_buckets > 0 && capacity >= 0) << "dispatch wants at least one expert and capacity >= 0, got "
                                             << num_buckets << " experts, capacity " << capacity;
  int64_t n = idx.dim(0), k = idx.dim(1), slots = n * k;
  check_tensor(counts, "dispatch counts", DType::i32, {num_buckets});
  check_tensor(offsets, "dispatch offsets", DType::i32, {num_buckets + 1});
  check_index_tensor(order, "dispatch order", lowest == 0 ? slots : 0);
  check_tensor(slot_row, "dispatch slot_row", DType::i32, {slots});
  const int32_t* ip = idx.i32();
  int32_t* cnt = counts.i32();
  int32_t* off = offsets.i32();
  int32_t* ord = order.i32();
  int32_t* sr = slot_row.i32();

  // Counting sort: histogram, capped histogram, exclusive prefix sum, then one stable
  // pass in slot order so rows within an expert follow (token, j).
  std::vector<int64_t> wanted(static_cast<size_t>(num_buckets), 0);
  for (int64_t s = 0; s < slots; ++s) {
    MT_CHECK(ip[s] >= lowest && ip[s] < num_buckets)
        << "dispatch idx of token " << s / k << " slot " << s % k << " is " << ip[s] << ", outside [" << lowest
        << ", " << num_buckets << ")";
    if (ip[s] >= 0) ++wanted[ip[s]];
  }
  off[0] = 0;
  for (int64_t e = 0; e < num_buckets; ++e) {
    cnt[e] = static_cast<int32_t>(capacity > 0 ? std::min(wanted[e], capacity) : wanted[e]);
    off[e + 1] = off[e] + cnt[e];
  }
  check_index_tensor(order, "dispatch order", off[num_buckets]);
  std::vector<int32_t> next(off, off + num_buckets);
  int64_t dropped = 0;
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ip[s];
    sr[s] = -1;
    if (e < 0) continue;
    if (next[e] == off[e + 1]) {
      ++dropped;
      continue;
    }
    ord[next[e]] = static_cast<int32_t>(s);
    sr[s] = next[e]++;
  }
  return dropped;
}

// out[t] = the sum over token t's kept slots j of w[t*k+j] * rows[slot_row[t*k+j]], in
// slot order; a null w weighs every slot 1 (dispatch's backward is an unweighted combine).
void sum_slots(const float* rows, const float* w, const int32_t* slot_row, int64_t n, int64_t k, int64_t d,
               float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* o = out + t * d;
    std::fill_n(o, d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = slot_row[t * k + j];
      if (r < 0) continue;
      const float wj = w != nullptr ? w[t * k + j] : 1.0f;
      for (int64_t c = 0; c < d; ++c) o[c] += wj * rows[r * d + c];
    }
  }
}

}  // namespace

int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  return counting_sort(idx, num_experts, capacity, 0, counts, offsets, order, slot_row);
}

void dispatch_sort(const Tensor& buckets, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                   const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  counting_sort(buckets, num_buckets, capacity, -1, counts, offsets, order, slot_row);
}

void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs) {
  MT_CHECK(x.ndim() == 2 && xs.ndim() == 2 && k >= 1)
      << "dispatch wants x [N,D], xs [R,D] and k >= 1, got x " << x.str() << ", xs " << xs.str() << ", k " << k;
  int64_t n = x.dim(0), d = x.dim(1), rows = xs.dim(0);
  check_tensor(x, "dispatch x", DType::f32, {n, d});
  check_tensor(xs, "dispatch xs", DType::f32, {rows, d});
  check_index_tensor(order, "dispatch order", rows);
  const int32_t* ord = order.i32();
  for (int64_t r = 0; r < rows; ++r)
    MT_CHECK(ord[r] >= 0 && ord[r] < n * k)
        << "dispatch order[" << r << "] is " << ord[r] << ", expected a slot in [0, " << n * k << ")";
  const float* xp = x.f32();
  float* out = xs.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) std::copy_n(xp + ord[r] / k * d, d, out + r * d);
}

void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx) {
  MT_CHECK(dxs.ndim() == 2 && dx.ndim() == 2)
      << "dispatch backward wants dxs [R,D] and dx [N,D], got dxs " << dxs.str() << ", dx " << dx.str();
  int64_t rows = dxs.dim(0), d = dxs.dim(1), n = dx.dim(0);
  check_tensor(dxs, "dispatch dxs", DType::f32, {rows, d});
  check_tensor(dx, "dispatch dx", DType::f32, {n, d});
  int64_t k = check_slot_row(slot_row, n, rows);
  sum_slots(dxs.f32(), nullptr, slot_row.i32(), n, k, d, dx.f32());
}

void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && y.ndim() == 2)
      << "combine wants ys [R,D], weight [N,k], y [N,D], got ys " << ys.str() << ", weight " << weight.str() << ", y "
      << y.str();
  int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_tensor(ys, "combine ys", DType::f32, {rows, d});
  check_tensor(weight, "combine weight", DType::f32, {n, k});
  check_tensor(y, "combine y", DType::f32, {n, d});
  check_tensor(slot_row, "combine slot_row", DType::i32, {n * k});
  check_slot_row(slot_row, n, rows);
  sum_slots(ys.f32(), weight.f32(), slot_row.i32(), n, k, d, y.f32());
}

void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && dy.ndim() == 2)
      << "combine backward wants ys [R,D], weight [N,k], dy [N,D], got ys " << ys.str() << ", weight " << weight.str()
      << ", dy " << dy.str();
  int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_tensor(ys, "combine ys", DType::f32, {rows, d});
  check_tensor(dy, "combine dy", DType::f32, {n, d});
  check_tensor(dys, "combine dys", DType::f32, {rows, d});
  check_tensor(dweight, "combine dweight", DType::f32, {n, k});
  check_tensor(slot_row, "combine slot_row", DType::i32, {n * k});
  check_slot_row(slot_row, n, rows);
  const int32_t* sr = slot_row.i32();
  const float* yp = ys.f32();
  const float* wp = weight.f32();
  const float* g = dy.f32();
  float* dyp = dys.f32();
  float* dwp = dweight.f32();
  // Each kept slot owns one row of dys, so tokens write disjoint rows.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const float* gt = g + t * d;
    for (int64_t j = 0; j < k; ++j) {
      int32_t r = sr[t * k + j];
      if (r < 0) {
        dwp[t * k + j] = 0.0f;
        continue;
      }
      float w = wp[t * k + j], dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) {
        dot += gt[c] * yp[r * d + c];
        dyp[r * d + c] = w * gt[c];
      }
      dwp[t * k + j] = dot;
    }
  }
}

void ep_row_buckets(const Tensor& idx, int64_t per, int64_t num_experts, const Tensor& buckets) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2 && per >= 1 && num_experts % per == 0)
      << "ep_row_buckets wants idx i32 [N,k] and the experts split evenly, got " << idx.str() << ", "
      << num_experts << " experts, " << per << " per rank";
  const int64_t n = idx.dim(0), k = idx.dim(1);
  check_tensor(idx, "ep_row_buckets idx", DType::i32, {n, k});
  check_tensor(buckets, "ep_row_buckets buckets", DType::i32, {n, k});
  const int32_t* ip = idx.i32();
  int32_t* b = buckets.i32();
  for (int64_t s = 0; s < n * k; ++s)
    MT_CHECK(ip[s] >= 0 && ip[s] < num_experts) << "ep_plan: idx of token " << s / k << " slot " << s % k << " is "
                                                << ip[s] << ", outside [0, " << num_experts << ")";
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = ip[t * k + j] / per;
      bool first = true;
      for (int64_t i = 0; i < j && first; ++i) first = ip[t * k + i] / per != r;
      b[t * k + j] = first ? static_cast<int32_t>(r) : -1;
    }
}

void ep_send_buckets(const Tensor& idx, const Tensor& sent_slot, int64_t per, const Tensor& buckets) {
  MT_CHECK(idx.ndim() == 2 && sent_slot.ndim() == 1 && per >= 1)
      << "ep_send_buckets wants idx [N,k] and sent_slot [S], got " << idx.str() << ", " << sent_slot.str() << " ("
      << per << " experts per rank)";
  const int64_t n = idx.dim(0), k = idx.dim(1), rows = sent_slot.dim(0);
  check_tensor(idx, "ep_send_buckets idx", DType::i32, {n, k});
  check_tensor(sent_slot, "ep_send_buckets sent_slot", DType::i32, {rows});
  check_tensor(buckets, "ep_send_buckets buckets", DType::i32, {rows, k});
  const int32_t* ip = idx.i32();
  const int32_t* ss = sent_slot.i32();
  int32_t* b = buckets.i32();
  for (int64_t i = 0; i < rows; ++i) {
    MT_CHECK(ss[i] >= 0 && ss[i] < n * k)
        << "ep_send_buckets: sent_slot[" << i << "] is " << ss[i] << ", expected a slot in [0, " << n * k << ")";
    const int64_t t = ss[i] / k, r = ip[ss[i]] / per;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ip[t * k + j];
      b[i * k + j] = e / per == r ? static_cast<int32_t>(e - r * per) : -1;
    }
  }
}

void ep_pack_counts(const Tensor& row_counts, const Tensor& expert_offsets, int64_t per, const Tensor& out) {
  MT_CHECK(row_counts.ndim() == 1 && per >= 1)
      << "ep_pack_counts wants row_counts [ranks], got " << row_counts.str() << " (" << per << " experts per rank)";
  const int64_t ranks = row_counts.dim(0);
  check_tensor(row_counts, "ep_pack_counts row_counts", DType::i32, {ranks});
  check_tensor(expert_offsets, "ep_pack_counts expert_offsets", DType::i32, {ranks * per + 1});
  check_tensor(out, "ep_pack_counts out", DType::i32, {ranks, 2});
  const int32_t* rc = row_counts.i32();
  const int32_t* off = expert_offsets.i32();
  int32_t* o = out.i32();
  for (int64_t r = 0; r < ranks; ++r) {
    o[2 * r] = rc[r];
    o[2 * r + 1] = off[(r + 1) * per] - off[r * per];
  }
}

void ep_return_buckets(const Tensor& order, const Tensor& local_offsets, const Tensor& recv_counts, int64_t k,
                       const Tensor& buckets) {
  MT_CHECK(order.ndim() == 1 && local_offsets.ndim() == 1 && local_offsets.dim(0) >= 1 &&
           recv_counts.ndim() == 2 && k >= 1)
      << "ep_return_buckets wants order [M], local_offsets [E+1], recv_counts [ranks,2] and k >= 1, got "
      << order.str() << ", " << local_offsets.str() << ", " << recv_counts.str() << ", k " << k;
  const int64_t m = order.dim(0), ranks = recv_counts.dim(0);
  check_tensor(order, "ep_return_buckets order", DType::i32, {m});
  check_tensor(local_offsets, "ep_return_buckets local_offsets", DType::i32, local_offsets.shape);
  check_tensor(recv_counts, "ep_return_buckets recv_counts", DType::i32, {ranks, 2});
  check_tensor(buckets, "ep_return_buckets buckets", DType::i32, {m});
  const int32_t* ord = order.i32();
  const int32_t* rc = recv_counts.i32();
  const int64_t placed = local_offsets.i32()[local_offsets.dim(0) - 1];
  MT_CHECK(placed >= 0 && placed <= m)
      << "ep_return_buckets: " << placed << " rows placed, but order " << order.str() << " holds " << m;
  // ends[p]: rows received from ranks 0..p.
  std::vector<int64_t> ends(static_cast<size_t>(ranks));
  int64_t received = 0;
  for (int64_t p = 0; p < ranks; ++p) ends[p] = received += rc[2 * p];
  int32_t* b = buckets.i32();
  std::fill(b + placed, b + m, -1);
  for (int64_t r = 0; r < placed; ++r) {
    MT_CHECK(ord[r] >= 0 && ord[r] / k < received)
        << "ep_return_buckets: order[" << r << "] is " << ord[r] << ", not a slot of the " << received
        << " rows received";
    b[r] = static_cast<int32_t>(std::upper_bound(ends.begin(), ends.end(), ord[r] / k) - ends.begin());
  }
}

void ep_kept_buckets(const Tensor& idx, const Tensor& token_rows, const Tensor& kept_rows, int64_t per,
                     const Tensor& buckets) {
  MT_CHECK(idx.ndim() == 2 && kept_rows.ndim() == 1 && per >= 1)
      << "ep_kept_buckets wants idx [N,k] and kept_rows [S*k], got " << idx.str() << ", " << kept_rows.str() << " ("
      << per << " experts per rank)";
  const int64_t n = idx.dim(0), k = idx.dim(1), kept_slots = kept_rows.dim(0);
  check_tensor(idx, "ep_kept_buckets idx", DType::i32, {n, k});
  check_tensor(token_rows, "ep_kept_buckets token_rows", DType::i32, {n * k});
  check_tensor(kept_rows, "ep_kept_buckets kept_rows", DType::i32, {kept_slots});
  check_tensor(buckets, "ep_kept_buckets buckets", DType::i32, {n, k});
  const int32_t* ip = idx.i32();
  const int32_t* tr = token_rows.i32();
  const int32_t* kr = kept_rows.i32();
  int32_t* b = buckets.i32();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      // The token's row for this slot's rank is numbered at its first slot to that rank.
      const int64_t r = ip[t * k + j] / per;
      int64_t first = 0;
      while (ip[t * k + first] / per != r) ++first;
      const int64_t row = tr[t * k + first];
      MT_CHECK(row >= 0 && (row + 1) * k <= kept_slots)
          << "ep_kept_buckets: token " << t << " slot " << j << " has row " << row << ", outside the "
          << kept_slots / k << " rows sent";
      b[t * k + j] = kr[row * k + j] >= 0 ? ip[t * k + j] : -1;
    }
}

void ep_route_slots(const Tensor& idx, const Tensor& mine, const Tensor& first, const Tensor& slot,
                    const Tensor& bound, const Tensor& slots) {
  MT_CHECK(idx.ndim() == 2 && mine.ndim() == 1 && first.numel() == mine.numel() + 1 && slot.numel() == bound.numel())
      << "ep_route_slots wants idx [N,k], mine [E], first [E+1], slot and bound [C], got " << idx.str() << ", "
      << mine.str() << ", " << first.str() << ", " << slot.str() << ", " << bound.str();
  const int64_t n = idx.dim(0), k = idx.dim(1), experts = mine.numel();
  check_tensor(idx, "ep_route_slots idx", DType::i32, {n, k});
  check_tensor(slots, "ep_route_slots slots", DType::i32, {n, k});
  check_tensor(bound, "ep_route_slots bound", DType::i64, {slot.numel()});
  const int32_t *ip = idx.i32(), *mp = mine.i32(), *fp = first.i32(), *sp = slot.i32();
  const int64_t* bp = static_cast<const int64_t*>(bound.data);
  int32_t* out = slots.i32();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t u = static_cast<uint32_t>(static_cast<uint64_t>(t) * 2654435769u);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ip[t * k + j];
      MT_CHECK(e >= 0 && e < experts) << "ep_route_slots: idx of token " << t << " slot " << j << " is " << e
                                      << ", outside [0, " << experts << ")";
      int32_t to = mp[e];
      for (int32_t i = fp[e]; to < 0 && i < fp[e + 1]; ++i)
        if (u < bp[i] || i + 1 == fp[e + 1]) to = sp[i];
      out[t * k + j] = to;
    }
  }
}

void read_counts(std::initializer_list<Tensor> arrays, int32_t* out) {
  for (const Tensor& a : arrays) {
    MT_CHECK(a.dtype == DType::i32 && a.device == Device::cpu && a.defined())
        << "read_counts wants i32 arrays with storage, all on the CPU, got " << a.str();
    std::copy_n(a.i32(), a.numel(), out);
    out += a.numel();
  }
}

}  // namespace mt::cpu
