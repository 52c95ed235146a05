// Builders for the rows of the op table, one file per kernel family.
#pragma once

#include <vector>

#include "ops/op_case.h"

namespace mt::test {

// gemm.cpp: c = op(a) op(b) + beta * c0 with c = [M,N], contraction K.
OpCase gemm_case(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, float beta);
// embedding.cpp: vocabulary V, width D, N tokens (ids repeat).
OpCase embedding_case(int64_t vocab, int64_t dim, int64_t tokens);
// rmsnorm.cpp; with_residual: x also passes on unchanged (a skip output), whose gradient
// the backward adds to dx through its residual argument; w_offset: zero-centred weights
// (y = x rstd (w + w_offset)).
OpCase rmsnorm_case(int64_t rows, int64_t dim, float eps, bool with_residual = false, float w_offset = 0.0f);
// rmsnorm.cpp: x [B,T,H,Dh] normed per head, then rotated (halves; the first rotary_dim
// dims, theta 1e6 as Qwen3's) at the given positions.
OpCase rmsnorm_rope_case(int64_t batch, int64_t heads, int64_t dim, int64_t rotary_dim,
                         const std::vector<int32_t>& positions, float w_offset = 0.0f);
// cross_entropy.cpp: `ignored` of the N labels are the ignore index.
OpCase cross_entropy_case(int64_t rows, int64_t vocab, int64_t ignored);
// adamw.cpp: one update at 1-based step t (no backward: outputs are not differentiable).
OpCase adamw_case(int64_t step, float weight_decay);
// elementwise.cpp: the helpers between ops, exact against float64 (no backward):
// f32 -> bf16 -> f32, out = a + b in place, x *= s, x = value, sum of squares of a list.
OpCase cast_case(int64_t n);
OpCase add_case(int64_t n, DType dtype);
OpCase scale_case(int64_t n, float s, DType dtype);
OpCase fill_case(int64_t n, float value, DType dtype);
OpCase sum_squares_case(const std::vector<int64_t>& sizes);
// dst[r, dst_col + c] (+)= src[r', src_col + c] (kernels/elementwise.h), with its backward.
OpCase copy_columns_case(Shape dst, int64_t dst_col, Shape src, int64_t src_col, int64_t width, bool accumulate);

// grouped_gemm.cpp: rows per expert given by `counts` (zeros are empty segments), x [N,K],
// w [E,O,K]; accumulate checks that the weight gradient adds to what was there.
OpCase grouped_gemm_case(const std::vector<int32_t>& counts, int64_t k, int64_t o, bool bias, bool accumulate);
// swiglu.cpp: gate/up halves [N,2I] -> [N,I]; the GPT-OSS variant interleaves and clamps.
OpCase swiglu_case(int64_t rows, int64_t inter);
OpCase clamped_swiglu_case(int64_t rows, int64_t inter, float limit, float alpha);
// swiglu.cpp: v [N,C] times sigmoid(s), s [N,C] (elementwise) or [N,1] (a gate a row).
OpCase sigmoid_gate_case(int64_t rows, int64_t cols, bool row_gate);
// deltanet.cpp: Qwen3.5's causal depthwise conv1d + SiLU, x [B,T,C] and w [C,K] (T < K too);
// its gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) from a, b [N,H], with
// a + dt_bias in [-4, 4] or, above_threshold, in [20.5, 24.5] (softplus's identity branch).
OpCase causal_conv1d_silu_case(int64_t batch, int64_t tokens, int64_t channels, int64_t kernel);
OpCase deltanet_gates_case(int64_t rows, int64_t heads, bool above_threshold);
// gated_delta.cpp: the gated delta rule, chunked, against the float64 step-by-step
// recurrence. q [B,T,H,Dk], k with |k| <= 1 (what L2-normalised keys satisfy), v
// [B,T,H,Dv], g in [-2, -0.01], beta in [0.05, 0.95]; initial_state: S_0 is an input;
// final_state: S_T is an output (so the backward takes its gradient).
struct GatedDeltaSpec {
  int64_t batch = 1, tokens = 1, heads = 1, dk = 4, dv = 3, chunk = 64;
  bool initial_state = false, final_state = false;
};
OpCase gated_delta_case(const GatedDeltaSpec& s);
// router.cpp: one routing setup on random logits [rows, experts]. gpt_oss: top-k of the
// logits, then softmax over the k; sigmoid: DeepSeek-V3's sigmoid scores, groups ranked by
// their two best; otherwise softmax, then top-k (DeepSeek-V2 groups when n_group > 1).
// dprobs: probs gets an upstream gradient too (a load-balance loss).
struct RouterRow {
  int64_t rows = 1, experts = 8, top_k = 2;
  bool gpt_oss = false, sigmoid = false, normalize = false;
  float scale = 1.0f;
  int64_t n_group = 1, topk_group = 1;
  bool dprobs = false;
  bool bias = false;  // an expert bias (router_bias_of) ranks the choice: the weights stay unbiased
};
OpCase router_case(const RouterRow& r);
// The bias of router_case's rows with `bias`: 0.3 sin(1.7 e), large enough to move choices.
std::vector<float> router_bias_of(int64_t experts);
// The router z-loss: sum over rows of logsumexp(logits)^2 [1] from logits [rows, experts]
// (router_z_sum), its gradient added to dlogits (router_z_backward).
OpCase router_z_case(int64_t rows, int64_t experts, double range);
// dispatch.cpp: N tokens each routed to k distinct random experts of E (never the first
// or the last with ends_empty), width D; capacity > 0 drops what does not fit.
// dispatch: x -> xs (and the counts and the dropped count); combine: ys, weight -> y.
OpCase dispatch_case(int64_t tokens, int64_t experts, int64_t k, int64_t dim, int64_t capacity, bool ends_empty);
OpCase combine_case(int64_t tokens, int64_t experts, int64_t k, int64_t dim, int64_t capacity, bool ends_empty);
// rope.cpp: x [B,T,H,Dh] rotated at `positions` (T = their count), the first rotary_dim
// dims of each head; tables from the kernel's rope_freqs for one of the presets.
enum class RopeScaling { none, yarn_gpt_oss, yarn_deepseek };
struct RopeSpec {
  RopeScaling scaling = RopeScaling::none;
  bool interleaved = false;
  int64_t batch = 1, heads = 1, head_dim = 8, rotary_dim = 8;
  std::vector<int32_t> positions = {0};
};
OpCase rope_case(const RopeSpec& s);
// attention.cpp: q [B,Tq,Hq,D], k [B,Tk,Hkv,D], v [B,Tk,Hkv,Dv] (dim_v 0: Dv = D); query
// row 0 sits at position q_offset and key row 0 at k_offset; window 0 is full causal; sinks
// adds a per-head logit.
struct AttentionSpec {
  int64_t batch = 1, tq = 1, tk = 1, hq = 1, hkv = 1, dim = 4, window = 0;
  bool sinks = false;
  int64_t q_offset = 0, k_offset = 0, dim_v = 0;
};
OpCase attention_case(const AttentionSpec& s);

}  // namespace mt::test
