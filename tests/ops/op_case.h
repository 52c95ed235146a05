// One row of the op table: an op at one shape, checked three ways.
//
//   1. forward (fp32 kernel) against `reference` (float64, written independently here),
//   2. backward (fp32 kernel) against central finite differences of `reference` in
//      float64, for the scalar L = sum over outputs of dout . out with random dout,
//   3. both on random inputs drawn by the harness (never zeros), with integer inputs
//      (token ids, expert indices) captured by the case's lambdas.
//
// Adding an op means writing a builder in tests/ops/<family>.cpp and adding rows to
// the table in tests/test_ops.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt::test {

using Vec = std::vector<double>;
using Vecs = std::vector<Vec>;

struct Input {
  std::string name;
  Shape shape;
  double lo = -1.0, hi = 1.0;  // uniform range the harness draws from
  bool differentiable = true;
};

struct Output {
  std::string name;
  bool differentiable = true;  // false: compared in the forward, no upstream gradient
};

struct OpCase {
  std::string name;  // "rmsnorm N=1 D=5": unique within the table
  std::vector<Input> inputs;
  std::vector<Output> outputs;
  // float64 reference: one flat Vec per input -> one flat Vec per output.
  std::function<Vecs(const Vecs& in)> reference;
  // The fp32 kernels: same contract. backward gets the upstream gradient of every
  // output (zeros for non-differentiable ones) and returns one gradient per input
  // (an empty Vec for a non-differentiable input).
  std::function<Vecs(const Vecs& in)> forward;
  std::function<Vecs(const Vecs& in, const Vecs& dout)> backward;
  double fwd_tol = 1e-5;  // elementwise, relative; see close_enough() in test_ops.cpp
  double bwd_tol = 1e-4;
  // Relative step of the central differences. 1e-4 balances truncation (h^2 f'''/6)
  // against round-off (~1e-16 |L| / h) for losses summed over many elements; ops
  // with kinks (clamps, top-k) may want a smaller one.
  double fd_step = 1e-4;
  uint64_t seed = 1;
};

// gtest prints a failing row by its name rather than as bytes.
inline void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

// Helpers for case builders: fp32 tensors over a std::vector, and back to double.
struct HostTensor {
  std::vector<float> f;
  std::vector<int32_t> i;
  Tensor t;
  HostTensor() = default;
  HostTensor(const HostTensor&) = delete;  // t points into the vectors: move only
  HostTensor(HostTensor&&) = default;
  static HostTensor f32(Shape s, const Vec& values = {});
  static HostTensor zeros(Shape s) { return f32(s); }
  static HostTensor i32(Shape s, const std::vector<int32_t>& values = {});
  Vec vec() const;  // f32 data as doubles
};

// Deterministic integers for a case (token ids, labels): uniform in [lo, hi].
std::vector<int32_t> random_ints(uint64_t seed, int64_t n, int32_t lo, int32_t hi);

}  // namespace mt::test
