#include "models/gated_deltanet.h"

#include <cmath>

#include "comm/communicator.h"
#include "core/check.h"
#include "kernels/deltanet.h"
#include "kernels/elementwise.h"
#include "kernels/gated_delta.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "models/linear.h"

namespace mt {

namespace {

// One layer's activations for one micro-batch: N tokens, C = 2 Hk Dk + Hv Dv channels.
struct DeltaActs : AttentionActs {
  // Kept from the forward for B (per layer).
  Tensor qkv_pre, a, b;            // projections [N, C], [N, Hv] x2
  Tensor q, k, v, rstd_q, rstd_k;  // conv output split [N, Hk Dk] x2, [N, Hv Dv]; L2 norms' rstd
  Tensor qr, kr;                   // normed, repeated to the value heads [N Hv, Dk]
  Tensor g, beta;                  // [N, Hv]
  Tensor o, rstd_o, zo;            // the rule's output [N Hv, Dv], its norm's rstd, [z | normed] [N Hv, 2 Dv]
  // Read by W (per layer).
  Tensor d_qkv_pre, d_z, d_a, d_b;
  // Shared by the layers.
  Tensor qkv, qn, kn, h, wq, wk;  // conv output, normed key heads, the gated norm's output, L2 weights
  Tensor d_h, d_zo, d_on, d_o, d_qr, d_kr, d_v, d_g, d_beta, d_qn, d_kn, d_q, d_k, d_qkv;
};

class GatedDeltaNet final : public Attention {
 public:
  GatedDeltaNet(const GatedDeltaNetSpec& s, int64_t layers) : s_(s), w_(static_cast<size_t>(layers)) {
    MT_CHECK(s.key_heads > 0 && s.value_heads % s.key_heads == 0)
        << "linear_num_value_heads " << s.value_heads << " must be a multiple of linear_num_key_heads "
        << s.key_heads;
    MT_CHECK(s.key_dim > 0 && s.value_dim > 0 && s.conv_kernel > 0)
        << "linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim must be positive";
  }

  const char* hf_module() const override { return "linear_attn."; }

  void add_params(int64_t l, const std::string& p, std::vector<Param>& params) override {
    const int64_t D = s_.hidden_size, C = channels(), Hv = s_.value_heads, V = Hv * s_.value_dim;
    Index& x = w_[static_cast<size_t>(l)];
    x.qkv = add_param(params, p + "in_qkv", {C, D});
    x.z = add_param(params, p + "in_z", {V, D});
    x.b = add_param(params, p + "in_b", {Hv, D});
    x.a = add_param(params, p + "in_a", {Hv, D});
    x.conv = add_param(params, p + "conv", {C, 1, s_.conv_kernel});
    params[static_cast<size_t>(x.conv)].matrix = false;  // f32 and never decayed, as the norms
    x.dt_bias = add_param(params, p + "dt_bias", {Hv});
    x.a_log = add_param(params, p + "A_log", {Hv});
    x.norm = add_param(params, p + "gated_norm", {s_.value_dim});
    x.out = add_param(params, p + "out", {D, V});
  }

  void hf_tensors(int64_t l, const std::string& p, std::vector<Param>& params, float out_scale,
                  std::vector<HfTensor>& out) const override {
    const Index& x = w_[static_cast<size_t>(l)];
    out.push_back(hf_tensor(p + "in_proj_qkv.weight", params[x.qkv]));
    out.push_back(hf_tensor(p + "in_proj_z.weight", params[x.z]));
    out.push_back(hf_tensor(p + "in_proj_b.weight", params[x.b]));
    out.push_back(hf_tensor(p + "in_proj_a.weight", params[x.a]));
    out.push_back(hf_tensor(p + "conv1d.weight", params[x.conv]));
    out.push_back(hf_tensor(p + "dt_bias", params[x.dt_bias], 0.0f, 1.0f));  // transformers' ones
    out.push_back(hf_tensor(p + "A_log", params[x.a_log], 0.0f, 0.0f));      // A = 1
    out.push_back(hf_tensor(p + "norm.weight", params[x.norm], 0.0f, 1.0f));
    out.push_back(hf_tensor(p + "out_proj.weight", params[x.out], out_scale));
  }

  std::unique_ptr<AttentionActs> make_acts() const override { return std::make_unique<DeltaActs>(); }

  void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType act, int64_t B, int64_t S) const override {
    const int64_t N = B * S, C = channels(), Hk = s_.key_heads, Hv = s_.value_heads, Dk = s_.key_dim,
                  Dv = s_.value_dim, K = Hk * Dk, V = Hv * Dv;
    auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
    auto at = [&](Shape sh) { return a.alloc(act, sh); };
    const bool repeat = Hv != Hk;
    const Tensor qkv = at({N, C}), qn = repeat ? at({N * Hk, Dk}) : Tensor(), kn = repeat ? at({N * Hk, Dk}) : Tensor(),
                 h = at({N, V}), wq = f32({Dk}), wk = f32({Dk});
    const Tensor d_h = at({N, V}), d_zo = at({N * Hv, 2 * Dv}), d_on = at({N * Hv, Dv}), d_o = at({N * Hv, Dv}),
                 d_qr = at({N * Hv, Dk}), d_kr = at({N * Hv, Dk}), d_v = at({N, V}), d_g = f32({N, Hv}),
                 d_beta = f32({N, Hv}), d_qn = repeat ? at({N * Hk, Dk}) : d_qr,
                 d_kn = repeat ? at({N * Hk, Dk}) : d_kr, d_q = at({N, K}), d_k = at({N, K}), d_qkv = at({N, C});
    for (AttentionActs* base : layers) {
      auto& x = static_cast<DeltaActs&>(*base);
      x.qkv_pre = at({N, C});
      x.a = at({N, Hv});
      x.b = at({N, Hv});
      x.q = at({N, K});
      x.k = at({N, K});
      x.v = at({N, V});
      x.rstd_q = f32({N * Hk});
      x.rstd_k = f32({N * Hk});
      x.qr = at({N * Hv, Dk});
      x.kr = at({N * Hv, Dk});
      x.g = f32({N, Hv});
      x.beta = f32({N, Hv});
      x.o = at({N * Hv, Dv});
      x.rstd_o = f32({N * Hv});
      x.zo = at({N * Hv, 2 * Dv});
      x.d_qkv_pre = at({N, C});
      x.d_z = at({N, V});
      x.d_a = at({N, Hv});
      x.d_b = at({N, Hv});
      x.qkv = qkv;
      x.qn = repeat ? qn : x.qr;
      x.kn = repeat ? kn : x.kr;
      x.h = h;
      x.wq = wq;
      x.wk = wk;
      x.d_h = d_h;
      x.d_zo = d_zo;
      x.d_on = d_on;
      x.d_o = d_o;
      x.d_qr = d_qr;
      x.d_kr = d_kr;
      x.d_v = d_v;
      x.d_g = d_g;
      x.d_beta = d_beta;
      x.d_qn = d_qn;
      x.d_kn = d_kn;
      x.d_q = d_q;
      x.d_k = d_k;
      x.d_qkv = d_qkv;
    }
  }

  void forward(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[static_cast<size_t>(l)];
    auto& x = static_cast<DeltaActs&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, C = channels(), Hk = s_.key_heads, Hv = s_.value_heads,
                  Dk = s_.key_dim, Dv = s_.value_dim, K = Hk * Dk, V = Hv * Dv;
    // z through h (free until the gated norm writes it) into each head's half of zo.
    io.linear->forward(io.xn, {{P[w.qkv], x.qkv_pre}, {P[w.z], x.h}, {P[w.b], x.b}, {P[w.a], x.a}});
    mt::copy_columns(x.zo, 0, x.h.view({N * Hv, Dv}), 0, Dv, false);
    causal_conv1d_silu_forward(x.qkv_pre.view({B, S, C}), P[w.conv].value.view({C, s_.conv_kernel}),
                               x.qkv.view({B, S, C}));
    mt::copy_columns(x.q, 0, x.qkv, 0, K, false);
    mt::copy_columns(x.k, 0, x.qkv, K, K, false);
    mt::copy_columns(x.v, 0, x.qkv, 2 * K, V, false);
    // L2 norms as rmsnorm (the header): k / |k| and q / |q| / sqrt(Dk).
    const float eps = static_cast<float>(kL2Eps / static_cast<double>(Dk));
    mt::fill(x.wk, static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk))));
    mt::fill(x.wq, static_cast<float>(1.0 / static_cast<double>(Dk)));
    rmsnorm_forward(x.q.view({N * Hk, Dk}), x.wq, eps, x.qn, x.rstd_q);
    rmsnorm_forward(x.k.view({N * Hk, Dk}), x.wk, eps, x.kn, x.rstd_k);
    if (Hv != Hk) {  // each key head over its value heads: head h of Hv reads h / (Hv / Hk)
      mt::copy_columns(x.qr, 0, x.qn, 0, Dk, false);
      mt::copy_columns(x.kr, 0, x.kn, 0, Dk, false);
    }
    deltanet_gates_forward(x.a, x.b, P[w.a_log].value, P[w.dt_bias].value, x.g, x.beta);
    gated_delta_forward(x.qr.view({B, S, Hv, Dk}), x.kr.view({B, S, Hv, Dk}), x.v.view({B, S, Hv, Dv}),
                        x.g.view({B, S, Hv}), x.beta.view({B, S, Hv}), Tensor(), x.o.view({B, S, Hv, Dv}), Tensor());
    // The gated RMSNorm: [z | rmsnorm(o)] per head, then silu(z) * normed.
    const Tensor normed = x.d_on;  // B's buffer, free in the forward
    rmsnorm_forward(x.o, P[w.norm].value, static_cast<float>(s_.rms_norm_eps), normed, x.rstd_o);
    mt::copy_columns(x.zo, Dv, normed, 0, Dv, false);
    swiglu_forward(x.zo, x.h.view({N * Hv, Dv}));
    io.linear->forward(x.h, {{P[w.out], io.hm, 1.0f}});
  }

  void backward_input(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[static_cast<size_t>(l)];
    auto& x = static_cast<DeltaActs&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, C = channels(), Hk = s_.key_heads, Hv = s_.value_heads,
                  Dk = s_.key_dim, Dv = s_.value_dim, K = Hk * Dk, V = Hv * Dv;
    io.linear->backward_input(io.d_hm, P[w.out], x.d_h);
    swiglu_backward(x.zo, x.d_h.view({N * Hv, Dv}), x.d_zo);
    mt::copy_columns(x.d_z.view({N * Hv, Dv}), 0, x.d_zo, 0, Dv, false);
    mt::copy_columns(x.d_on, 0, x.d_zo, Dv, Dv, false);
    rmsnorm_backward(x.o, P[w.norm].value, x.rstd_o, x.d_on, x.d_o, grad_zeroed(P[w.norm]));
    gated_delta_backward(x.qr.view({B, S, Hv, Dk}), x.kr.view({B, S, Hv, Dk}), x.v.view({B, S, Hv, Dv}),
                         x.g.view({B, S, Hv}), x.beta.view({B, S, Hv}), Tensor(), x.d_o.view({B, S, Hv, Dv}), Tensor(),
                         x.d_qr.view({B, S, Hv, Dk}), x.d_kr.view({B, S, Hv, Dk}), x.d_v.view({B, S, Hv, Dv}),
                         x.d_g.view({B, S, Hv}), x.d_beta.view({B, S, Hv}), Tensor());
    deltanet_gates_backward(x.a, x.b, P[w.a_log].value, P[w.dt_bias].value, x.d_g, x.d_beta, x.d_a, x.d_b,
                            grad_zeroed(P[w.a_log]), grad_zeroed(P[w.dt_bias]));
    if (Hv != Hk) {  // the repeat's backward: each key head sums its value heads' gradients
      mt::copy_columns(x.d_qn, 0, x.d_qr, 0, Dk, false);
      mt::copy_columns(x.d_kn, 0, x.d_kr, 0, Dk, false);
    }
    rmsnorm_backward(x.q.view({N * Hk, Dk}), x.wq, x.rstd_q, x.d_qn, x.d_q.view({N * Hk, Dk}), Tensor());
    rmsnorm_backward(x.k.view({N * Hk, Dk}), x.wk, x.rstd_k, x.d_kn, x.d_k.view({N * Hk, Dk}), Tensor());
    mt::copy_columns(x.d_qkv, 0, x.d_q, 0, K, false);
    mt::copy_columns(x.d_qkv, K, x.d_k, 0, K, false);
    mt::copy_columns(x.d_qkv, 2 * K, x.d_v, 0, V, false);
    causal_conv1d_silu_backward(x.qkv_pre.view({B, S, C}), P[w.conv].value.view({C, s_.conv_kernel}),
                                x.d_qkv.view({B, S, C}), x.d_qkv_pre.view({B, S, C}),
                                grad_zeroed(P[w.conv]).view({C, s_.conv_kernel}));
    io.linear->backward_input(x.d_qkv_pre, P[w.qkv], io.d_xn);
    io.linear->backward_input(x.d_z, P[w.z], io.d_xn, 1.0f);
    io.linear->backward_input(x.d_b, P[w.b], io.d_xn, 1.0f);
    io.linear->backward_input(x.d_a, P[w.a], io.d_xn, 1.0f);
  }

  void backward_weight(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[static_cast<size_t>(l)];
    auto& x = static_cast<DeltaActs&>(base);
    const int64_t N = io.batch * io.seq, Hv = s_.value_heads, Dv = s_.value_dim;
    swiglu_forward(x.zo, x.h.view({N * Hv, Dv}));  // shared by the layers: made again
    io.linear->backward_weight(x.h, {{io.d_hm, P[w.out]}});
    io.linear->backward_weight(io.xn, {{x.d_qkv_pre, P[w.qkv]}, {x.d_z, P[w.z]}, {x.d_b, P[w.b]}, {x.d_a, P[w.a]}});
  }

 private:
  static constexpr double kL2Eps = 1e-6;  // transformers' l2norm
  struct Index {
    int qkv = -1, z = -1, b = -1, a = -1, conv = -1, dt_bias = -1, a_log = -1, norm = -1, out = -1;
  };
  int64_t channels() const { return 2 * s_.key_heads * s_.key_dim + s_.value_heads * s_.value_dim; }
  GatedDeltaNetSpec s_;
  std::vector<Index> w_;
};

}  // namespace

std::shared_ptr<Attention> make_gated_deltanet(const GatedDeltaNetSpec& spec, int64_t num_layers,
                                               const ModelOptions& options) {
  MT_CHECK(options.cp == nullptr || options.cp->size() == 1)
      << "gated DeltaNet layers (layer_types linear_attention) with parallelism.cp > 1 are not built yet: their state "
      << "would pass from each rank's chunk to the next (issue 61)";
  return std::make_shared<GatedDeltaNet>(spec, num_layers);
}

}  // namespace mt
