#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <sstream>

#include "kernels/dispatch.h"
#include "ops/cases.h"

namespace mt::test {

namespace {

// Each token picks k distinct experts at random; with ends_empty, experts 0 and E-1 are
// never picked, so the first and the last segment are empty.
std::vector<int32_t> random_routes(uint64_t seed, int64_t tokens, int64_t experts, int64_t k, bool ends_empty) {
  std::vector<int32_t> pool(static_cast<size_t>(ends_empty ? experts - 2 : experts));
  std::iota(pool.begin(), pool.end(), ends_empty ? 1 : 0);
  MT_CHECK(k <= static_cast<int64_t>(pool.size())) << "k=" << k << " from " << pool.size() << " experts";
  std::vector<int32_t> draws = random_ints(seed, tokens * k, 0, 1 << 30), idx;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> p = pool;
    for (int64_t j = 0; j < k; ++j) {
      std::swap(p[j], p[j + draws[t * k + j] % (p.size() - j)]);
      idx.push_back(p[j]);
    }
  }
  return idx;
}

struct Plan {
  std::vector<int32_t> counts, offsets, order, slot_row;
  int64_t dropped = 0;
};

// Independent of the kernel's counting sort: a stable sort of the slots by expert, then
// each expert's run cut at the capacity.
Plan reference_plan(const std::vector<int32_t>& idx, int64_t experts, int64_t capacity) {
  std::vector<int32_t> by_expert(idx.size());
  std::iota(by_expert.begin(), by_expert.end(), 0);
  std::stable_sort(by_expert.begin(), by_expert.end(), [&](int32_t a, int32_t b) { return idx[a] < idx[b]; });
  Plan p;
  p.counts.assign(experts, 0);
  p.slot_row.assign(idx.size(), -1);
  for (int32_t s : by_expert) {
    if (capacity > 0 && p.counts[idx[s]] == capacity) {
      ++p.dropped;
      continue;
    }
    ++p.counts[idx[s]];
    p.slot_row[s] = static_cast<int32_t>(p.order.size());
    p.order.push_back(s);
  }
  p.offsets = {0};
  for (int32_t n : p.counts) p.offsets.push_back(p.offsets.back() + n);
  return p;
}

Plan kernel_plan(const std::vector<int32_t>& idx, int64_t tokens, int64_t k, int64_t experts, int64_t capacity) {
  auto it = HostTensor::i32({tokens, k}, idx), counts = HostTensor::i32({experts});
  auto offsets = HostTensor::i32({experts + 1}), order = HostTensor::i32({tokens * k});
  auto slot_row = HostTensor::i32({tokens * k});
  Plan p;
  p.dropped = cpu::dispatch_plan(it.t, experts, capacity, counts.t, offsets.t, order.t, slot_row.t);
  p.counts = counts.i;
  p.offsets = offsets.i;
  p.order.assign(order.i.begin(), order.i.begin() + p.offsets.back());
  p.slot_row = slot_row.i;
  return p;
}

std::string case_name(const char* op, int64_t tokens, int64_t experts, int64_t k, int64_t dim, int64_t capacity,
                      bool ends_empty) {
  std::ostringstream s;
  s << op << " N=" << tokens << " E=" << experts << " k=" << k << " D=" << dim << " capacity=" << capacity
    << " ends_empty=" << ends_empty;
  return s.str();
}

}  // namespace

OpCase dispatch_case(int64_t tokens, int64_t experts, int64_t k, int64_t dim, int64_t capacity, bool ends_empty) {
  std::vector<int32_t> idx = random_routes(tokens * 131 + experts, tokens, experts, k, ends_empty);
  Plan ref = reference_plan(idx, experts, capacity);
  OpCase c;
  c.name = case_name("dispatch", tokens, experts, k, dim, capacity, ends_empty);
  c.inputs = {{"x", {tokens, dim}}};
  c.outputs = {{"xs"}, {"counts", false}, {"dropped", false}};
  c.reference = [=](const Vecs& in) {
    Vec xs;
    for (int32_t s : ref.order) xs.insert(xs.end(), in[0].begin() + s / k * dim, in[0].begin() + (s / k + 1) * dim);
    return Vecs{xs, Vec(ref.counts.begin(), ref.counts.end()), Vec{static_cast<double>(ref.dropped)}};
  };
  c.forward = [=](const Vecs& in) {
    Plan p = kernel_plan(idx, tokens, k, experts, capacity);
    int64_t rows = p.offsets.back();
    auto x = HostTensor::f32({tokens, dim}, in[0]), order = HostTensor::i32({rows}, p.order);
    auto xs = HostTensor::f32({rows, dim});
    cpu::dispatch_forward(x.t, order.t, k, xs.t);
    return Vecs{xs.vec(), Vec(p.counts.begin(), p.counts.end()), Vec{static_cast<double>(p.dropped)}};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    Plan p = kernel_plan(idx, tokens, k, experts, capacity);
    int64_t rows = p.offsets.back();
    auto dxs = HostTensor::f32({rows, dim}, dout[0]), slot_row = HostTensor::i32({tokens * k}, p.slot_row);
    auto dx = HostTensor::f32({tokens, dim}, in[0]);
    cpu::dispatch_backward(dxs.t, slot_row.t, dx.t);
    return Vecs{dx.vec()};
  };
  return c;
}

OpCase combine_case(int64_t tokens, int64_t experts, int64_t k, int64_t dim, int64_t capacity, bool ends_empty) {
  std::vector<int32_t> idx = random_routes(tokens * 131 + experts, tokens, experts, k, ends_empty);
  Plan ref = reference_plan(idx, experts, capacity);
  int64_t rows = ref.offsets.back();
  OpCase c;
  c.name = case_name("combine", tokens, experts, k, dim, capacity, ends_empty);
  c.inputs = {{"ys", {rows, dim}}, {"weight", {tokens, k}}};
  c.outputs = {{"y"}};
  c.reference = [=](const Vecs& in) {
    Vec y(tokens * dim, 0.0);
    for (int64_t s = 0; s < tokens * k; ++s) {
      if (ref.slot_row[s] < 0) continue;
      for (int64_t d = 0; d < dim; ++d) y[s / k * dim + d] += in[1][s] * in[0][ref.slot_row[s] * dim + d];
    }
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    Plan p = kernel_plan(idx, tokens, k, experts, capacity);
    auto ys = HostTensor::f32({rows, dim}, in[0]), weight = HostTensor::f32({tokens, k}, in[1]);
    auto slot_row = HostTensor::i32({tokens * k}, p.slot_row), y = HostTensor::f32({tokens, dim});
    cpu::combine_forward(ys.t, weight.t, slot_row.t, y.t);
    return Vecs{y.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    Plan p = kernel_plan(idx, tokens, k, experts, capacity);
    auto ys = HostTensor::f32({rows, dim}, in[0]), weight = HostTensor::f32({tokens, k}, in[1]);
    auto slot_row = HostTensor::i32({tokens * k}, p.slot_row), dy = HostTensor::f32({tokens, dim}, dout[0]);
    auto dys = HostTensor::f32({rows, dim}, in[0]), dweight = HostTensor::f32({tokens, k}, in[1]);
    cpu::combine_backward(ys.t, weight.t, slot_row.t, dy.t, dys.t, dweight.t);
    return Vecs{dys.vec(), dweight.vec()};
  };
  return c;
}

namespace {

void expect_same_plan(const Plan& got, const Plan& want) {
  EXPECT_EQ(got.counts, want.counts);
  EXPECT_EQ(got.offsets, want.offsets);
  EXPECT_EQ(got.order, want.order);
  EXPECT_EQ(got.slot_row, want.slot_row);
  EXPECT_EQ(got.dropped, want.dropped);
}

// Four tokens, two slots each, four experts; expert 3 gets nothing.
TEST(Dispatch, PlanByHand) {
  // slot s = 2t + j:    s0 s1   s2 s3   s4 s5   s6 s7
  std::vector<int32_t> idx{2, 0, 0, 2, 1, 0, 0, 1};
  Plan all;
  all.counts = {4, 2, 2, 0};
  all.offsets = {0, 4, 6, 8, 8};
  all.order = {1, 2, 5, 6, 4, 7, 0, 3};
  all.slot_row = {6, 0, 1, 7, 4, 2, 3, 5};
  {
    SCOPED_TRACE("no capacity");
    expect_same_plan(kernel_plan(idx, 4, 2, 4, 0), all);
  }

  // Capacity 2: expert 0 keeps its two earliest slots (s1, s2) and drops s5 and s6.
  Plan capped;
  capped.counts = {2, 2, 2, 0};
  capped.offsets = {0, 2, 4, 6, 6};
  capped.order = {1, 2, 4, 7, 0, 3};
  capped.slot_row = {4, 0, 1, 5, 2, -1, -1, 3};
  capped.dropped = 2;
  {
    SCOPED_TRACE("capacity 2");
    expect_same_plan(kernel_plan(idx, 4, 2, 4, 2), capped);
  }
}

TEST(Dispatch, PlanMatchesReference) {
  struct Setup {
    int64_t tokens, experts, k, capacity;
    bool ends_empty;
  };
  for (Setup s : {Setup{1, 1, 1, 0, false}, Setup{57, 7, 3, 0, false}, Setup{57, 7, 3, 20, false},
                  Setup{57, 7, 3, 1, false}, Setup{40, 9, 2, 6, true}, Setup{33, 4, 4, 0, false}}) {
    std::vector<int32_t> idx = random_routes(s.tokens + 5, s.tokens, s.experts, s.k, s.ends_empty);
    SCOPED_TRACE(case_name("plan", s.tokens, s.experts, s.k, 0, s.capacity, s.ends_empty));
    expect_same_plan(kernel_plan(idx, s.tokens, s.k, s.experts, s.capacity),
                     reference_plan(idx, s.experts, s.capacity));
  }
}

TEST(Dispatch, RejectsExpertOutOfRange) {
  try {
    kernel_plan({0, 1, 2, 3, 1, 0}, 3, 2, 3, 0);
    ADD_FAILURE() << "expert 3 of 3 accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("idx of token 1 slot 1 is 3, outside [0, 3)"), std::string::npos)
        << err.what();
  }
}

}  // namespace

}  // namespace mt::test
