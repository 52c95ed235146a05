// The gated delta rule's rows of the op table (tests/ops/gated_delta.cpp): the fp32
// kernel, chunked, against the float64 step-by-step recurrence and its finite differences.
#pragma once

#include "ops/op_case.h"

namespace mt::test {

// q [B,T,H,Dk], k with |k| <= 1 (what L2-normalised keys satisfy), v [B,T,H,Dv], g in
// [-2, -0.01], beta in [0.05, 0.95]; initial_state: S_0 is an input; final_state: S_T is
// an output (so the backward takes its gradient).
struct GatedDeltaSpec {
  int64_t batch = 1, tokens = 1, heads = 1, dk = 4, dv = 3, chunk = 64;
  bool initial_state = false, final_state = false;
};
OpCase gated_delta_case(const GatedDeltaSpec& s);

}  // namespace mt::test
