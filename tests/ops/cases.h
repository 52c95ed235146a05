// Builders for the rows of the op table, one file per kernel family.
#pragma once

#include <vector>

#include "ops/op_case.h"

namespace mt::test {

// gemm.cpp: c = op(a) op(b) + beta * c0 with c = [M,N], contraction K.
OpCase gemm_case(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, float beta);
// embedding.cpp: vocabulary V, width D, N tokens (ids repeat).
OpCase embedding_case(int64_t vocab, int64_t dim, int64_t tokens);
// rmsnorm.cpp
OpCase rmsnorm_case(int64_t rows, int64_t dim, float eps);
// cross_entropy.cpp: `ignored` of the N labels are the ignore index.
OpCase cross_entropy_case(int64_t rows, int64_t vocab, int64_t ignored);
// adamw.cpp: one update at 1-based step t (no backward: outputs are not differentiable).
OpCase adamw_case(int64_t step, float weight_decay);

// grouped_gemm.cpp: DECL-GROUPED-GEMM
// swiglu.cpp: DECL-SWIGLU
// router.cpp: DECL-ROUTER
// dispatch.cpp: DECL-DISPATCH
// rope.cpp: DECL-ROPE
// attention.cpp: DECL-ATTENTION

}  // namespace mt::test
