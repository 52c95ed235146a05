// cuDNN SDPA graphs for attention (when they apply: attention_cudnn.h): how they are built,
// cached and run. Host code only; the kernels are cuDNN's. cuDNN's tensors are [B,H,S,D]
// by dims; ours are [B,S,H,D] in memory, the same tensor with strides {S*H*D, D, H*D, 1},
// so nothing is transposed. Only bf16 reaches here (attention.cu accepts nothing else), so
// the dtype is not part of a graph's key.
#include "kernels/cuda/attention_cudnn.h"

// The frontend's JSON (de)serialisation of graphs is not used; leaving it out keeps its
// bundled nlohmann::json (a different version from ours) out of the program.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

namespace fe = cudnn_frontend;

// The graphs' tensor ids, for the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSinks };

struct GraphKey {
  int64_t b, tq, tk, hq, hkv, d, d_v;  // d: q and k's head dim, d_v: v and out's
  bool causal;     // else no mask
  int64_t window;  // with causal: key j visible to query i when i - j < window; 0: no window
  bool sinks;      // a per-head sink logit, f32 [Hq], in the softmax's denominator
  bool backward;
  uint32_t scale;  // the bits of the f32 scale, baked into the graph
  auto operator<=>(const GraphKey&) const = default;
};

std::string describe(const GraphKey& k) {
  return std::string(k.backward ? "backward" : "forward") + " B=" + std::to_string(k.b) + " Tq=" +
         std::to_string(k.tq) + " Tk=" + std::to_string(k.tk) + " Hq=" + std::to_string(k.hq) +
         " Hkv=" + std::to_string(k.hkv) + " Dqk=" + std::to_string(k.d) + " Dv=" + std::to_string(k.d_v) +
         (k.causal ? " causal" : " no mask") + (k.window > 0 ? " window=" + std::to_string(k.window) : "") +
         (k.sinks ? " sinks" : "");
}

// A built graph, or none when cuDNN declined this key (then our kernel runs it).
struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

struct State {
  bool enabled = true;
  bool handle_failed = false;  // cudnnCreate failed once: never try again
  cudnnHandle_t handle = nullptr;
  cudaStream_t bound = nullptr;  // the stream the handle was last set to
  std::map<GraphKey, Plan> plans;
  int64_t calls = 0;
};

// Per process, like the cuBLASLt handle.
State& state() {
  static State s = [] {
    State init;
    const char* env = std::getenv("MOETRAIN_ATTENTION_CUDNN");
    init.enabled = env == nullptr || std::strcmp(env, "0") != 0;
    return init;
  }();
  return s;
}

void warn(const std::string& what) {
  std::fprintf(stderr, "moetrain: cuDNN attention: %s; running the built-in attention kernel instead\n", what.c_str());
}

// The handle, set to the current stream; null (reported once) when cuDNN cannot start.
cudnnHandle_t handle() {
  State& s = state();
  if (s.handle == nullptr && !s.handle_failed) {
    cudnnStatus_t st = cudnnCreate(&s.handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      s.handle_failed = true;
      s.handle = nullptr;
      warn(std::string("cudnnCreate failed: ") + cudnnGetErrorString(st) + " (cuDNN " +
           std::to_string(cudnnGetVersion()) + ")");
    }
  }
  if (s.handle != nullptr && s.bound != stream()) {
    const cudnnStatus_t st = cudnnSetStream(s.handle, stream());
    MT_CHECK(st == CUDNN_STATUS_SUCCESS) << "cudnnSetStream to the current stream failed: " << cudnnGetErrorString(st);
    s.bound = stream();
  }
  return s.handle;
}

// A [B,S,H,D] row-major tensor as cuDNN's [B,H,S,D].
std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& g, const char* name, int64_t uid, int64_t b,
                                                   int64_t s, int64_t h, int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, s, d})
                      .set_stride({s * h * d, d, h * d, 1}));
}

void set_bshd(const std::shared_ptr<fe::graph::Tensor_attributes>& t, int64_t uid, int64_t b, int64_t s, int64_t h,
              int64_t d) {
  t->set_output(true).set_uid(uid).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
}

// Our lse [B,Hq,Tq] as cuDNN's Stats [B,Hq,Tq,1], f32.
void set_stats(fe::graph::Tensor_attributes& t, const GraphKey& k) {
  t.set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({k.b, k.hq, k.tq, 1})
      .set_stride({k.hq * k.tq, k.tq, 1, 1});
}

// Our sinks f32 [Hq] as cuDNN's sink token [1,Hq,1,1].
std::shared_ptr<fe::graph::Tensor_attributes> sinks_tensor(fe::graph::Graph& g, const GraphKey& k) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("sinks")
                      .set_uid(kSinks)
                      .set_data_type(fe::DataType_t::FLOAT)
                      .set_dim({1, k.hq, 1, 1})
                      .set_stride({k.hq, 1, 1, 1}));
}

// The mask of a key on either direction's options: causal from the top-left corner, and a
// window as the band's left bound (cuDNN keeps key j for query i when j + window > i).
template <typename Options>
void set_mask(Options& opts, const GraphKey& k) {
  if (!k.causal) return;
  opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  if (k.window > 0) opts.set_diagonal_band_left_bound(static_cast<int>(k.window));
}

// Builds a key's forward (O, Stats) or backward (dQ, dK, dV) graph; returns cuDNN's complaint if it cannot.
std::string build(const GraphKey& k, Plan& plan) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const float scale = std::bit_cast<float>(k.scale);
  auto q = bshd(*g, "Q", kQ, k.b, k.tq, k.hq, k.d);
  auto kk = bshd(*g, "K", kK, k.b, k.tk, k.hkv, k.d);
  auto v = bshd(*g, "V", kV, k.b, k.tk, k.hkv, k.d_v);
  if (!k.backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_attn_scale(scale);
    set_mask(opts, k);
    if (k.sinks) opts.set_sink_token(sinks_tensor(*g, k));
    auto [o, stats] = g->sdpa(q, kk, v, opts);
    set_bshd(o, kO, k.b, k.tq, k.hq, k.d_v);
    stats->set_output(true);
    set_stats(*stats, k);
  } else {
    auto o = bshd(*g, "O", kO, k.b, k.tq, k.hq, k.d_v);
    auto dout = bshd(*g, "dO", kDO, k.b, k.tq, k.hq, k.d_v);
    fe::graph::Tensor_attributes stats_in;
    set_stats(stats_in.set_name("Stats"), k);
    auto stats = g->tensor(stats_in);
    auto opts = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale);
    set_mask(opts, k);
    if (k.sinks) opts.set_sink_token(sinks_tensor(*g, k));  // dsinks: attention.cu's own pass, deterministic
    auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, dout, stats, opts);
    set_bshd(dq, kDQ, k.b, k.tq, k.hq, k.d);
    set_bshd(dk, kDK, k.b, k.tk, k.hkv, k.d);
    set_bshd(dv, kDV, k.b, k.tk, k.hkv, k.d_v);
  }
  auto built = g->build(handle(), {fe::HeurMode_t::A});
  if (built.is_bad()) return built.get_message();
  int64_t workspace = 0;
  auto sized = g->get_workspace_size(workspace);
  if (sized.is_bad()) return sized.get_message();
  plan.graph = std::move(g);
  plan.workspace = workspace;
  return "";
}

// The cached plan of a key, built on first use; null when cuDNN declined it (reported once).
Plan* plan_for(const GraphKey& k) {
  State& s = state();
  auto [it, fresh] = s.plans.try_emplace(k);
  if (fresh) {
    std::string why;
    try {
      why = build(k, it->second);
    } catch (const std::exception& e) {  // the frontend throws when no SDPA implementation fits
      why = e.what();
    }
    if (!why.empty()) warn("no plan for " + describe(k) + ": " + why);
  }
  return it->second.graph ? &it->second : nullptr;
}

// Whether cuDNN computes this case exactly as our kernel does (header comment); if so, fills key.
bool applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks, const cpu::AttentionArgs& a,
             GraphKey& key) {
  const int64_t b = q.dim(0), tq = q.dim(1), hq = q.dim(2), d = q.dim(3), tk = k.dim(1), hkv = k.dim(2);
  const int64_t d_v = v.dim(3);
  if (!state().enabled) return false;
  const bool dims = (d == d_v && (d == 64 || d == 128 || d == 256)) || (d == 192 && d_v == 128);
  if (!dims || b == 0 || tq == 0 || tk == 0) return false;
  const bool all_visible = a.k_offset + tk - 1 <= a.q_offset;
  const bool causal = a.q_offset == a.k_offset && tq == tk;
  if (!all_visible && !causal) return false;
  // A window matters only where some query is farther than it from some key it could see.
  const bool windowed = a.window > 0 && (a.q_offset + tq - 1) - a.k_offset >= a.window;
  if (windowed && !causal) return false;
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  key = GraphKey{.b = b, .tq = tq, .tk = tk, .hq = hq, .hkv = hkv, .d = d, .d_v = d_v, .causal = !all_visible,
                 .window = windowed ? a.window : 0, .sinks = has_sinks, .backward = false,
                 .scale = std::bit_cast<uint32_t>(a.scale)};
  return true;
}

// Runs a key's plan on the variant pack; false (nothing written that our kernel will not
// overwrite) when a tensor is not 16-byte aligned, there is no plan or cuDNN refuses to
// execute it.
bool run(const GraphKey& key, std::unordered_map<int64_t, void*>& pack) {
  for (const auto& [uid, data] : pack)
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  if (handle() == nullptr) return false;
  Plan* plan = plan_for(key);
  if (plan == nullptr) return false;
  void* workspace = plan->workspace > 0 ? scratch(static_cast<size_t>(plan->workspace)) : nullptr;
  std::string why;
  try {
    auto ran = plan->graph->execute(handle(), pack, workspace);
    if (ran.is_bad()) why = ran.get_message();
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty()) {
    warn("execute failed for " + describe(key) + ": " + why);
    plan->graph.reset();
    return false;
  }
  ++state().calls;
  return true;
}

}  // namespace

void set_attention_cudnn(bool enabled) { state().enabled = enabled; }

bool attention_cudnn_enabled() { return state().enabled; }

int64_t attention_cudnn_calls() { return state().calls; }

bool cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                             const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  GraphKey key{};
  if (!applies(q, k, v, sinks, a, key)) return false;
  std::unordered_map<int64_t, void*> pack{{kQ, q.data}, {kK, k.data}, {kV, v.data}, {kO, out.data},
                                          {kStats, lse.data}};
  if (key.sinks) pack[kSinks] = sinks.data;
  return run(key, pack);
}

bool cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                              const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  GraphKey key{};
  if (!applies(q, k, v, sinks, a, key)) return false;
  key.backward = true;
  std::unordered_map<int64_t, void*> pack{{kQ, q.data},       {kK, k.data},      {kV, v.data},
                                          {kO, out.data},     {kStats, lse.data}, {kDO, dout.data},
                                          {kDQ, dq.data},     {kDK, dk.data},     {kDV, dv.data}};
  if (key.sinks) pack[kSinks] = sinks.data;
  return run(key, pack);
}

}  // namespace mt::cuda
