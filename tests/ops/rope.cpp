#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>

#include "kernels/rope.h"
#include "ops/cases.h"

namespace mt::test {

namespace {

// The rope settings of the presets, as the models' config.json files give them.
cpu::RopeConfig preset(RopeScaling scaling, int64_t rotary_dim) {
  cpu::RopeConfig c;
  c.rotary_dim = rotary_dim;
  switch (scaling) {
    case RopeScaling::none:
      break;
    case RopeScaling::yarn_gpt_oss:
      c.theta = 150000.0;
      c.yarn = true;
      c.factor = 32.0;
      c.beta_fast = 32.0;
      c.beta_slow = 1.0;
      c.original_max_position = 4096.0;
      c.truncate = false;
      break;
    case RopeScaling::yarn_deepseek:
      c.theta = 10000.0;
      c.yarn = true;
      c.factor = 40.0;
      c.beta_fast = 32.0;
      c.beta_slow = 1.0;
      c.original_max_position = 4096.0;
      // DeepSeek ships equal values (a ratio of 1); unequal ones make the ratio visible.
      c.mscale = 1.0;
      c.mscale_all_dim = 0.707;
      c.truncate = true;
      break;
  }
  return c;
}

const char* scaling_name(RopeScaling s) {
  switch (s) {
    case RopeScaling::none: return "default";
    case RopeScaling::yarn_gpt_oss: return "yarn_gpt_oss";
    case RopeScaling::yarn_deepseek: return "yarn_deepseek";
  }
  return "?";
}

// float64 frequencies from the published formulas: theta^(-2i/dim), and for YaRN
// (Peng et al. 2023) the blend of theta^(-2i/dim) and theta^(-2i/dim)/factor over the
// pairs whose rotation count in the original context lies between beta_slow and beta_fast.
Vec inv_freq_f64(const cpu::RopeConfig& c) {
  const int64_t half = c.rotary_dim / 2;
  Vec inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv[i] = std::pow(c.theta, -2.0 * static_cast<double>(i) / c.rotary_dim);
  if (!c.yarn) return inv;
  // Pair i turns original_max_position * theta^(-2i/dim) / (2 pi) times; solve for i.
  auto pair_turning = [&](double turns) {
    return std::log(c.original_max_position / (2.0 * std::numbers::pi * turns)) / std::log(c.theta) * c.rotary_dim /
           2.0;
  };
  double lo = pair_turning(c.beta_fast), hi = pair_turning(c.beta_slow);
  if (c.truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(c.rotary_dim) - 1.0);
  if (hi == lo) hi += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    double w = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);  // 1: fully interpolated
    inv[i] = (1.0 - w) * inv[i] + w * inv[i] / c.factor;
  }
  return inv;
}

double attention_scaling_f64(const cpu::RopeConfig& c) {
  if (!c.yarn) return 1.0;
  if (c.attention_factor != 0.0) return c.attention_factor;
  auto temperature = [&](double m) { return c.factor <= 1.0 ? 1.0 : 1.0 + 0.1 * m * std::log(c.factor); };
  if (c.mscale != 0.0 && c.mscale_all_dim != 0.0) return temperature(c.mscale) / temperature(c.mscale_all_dim);
  return temperature(1.0);
}

}  // namespace

OpCase rope_case(const RopeSpec& s) {
  const int64_t b = s.batch, t = static_cast<int64_t>(s.positions.size()), h = s.heads, dh = s.head_dim;
  const int64_t half = s.rotary_dim / 2;
  const Shape shape{b, t, h, dh};
  const cpu::RopeConfig cfg = preset(s.scaling, s.rotary_dim);
  const std::vector<int32_t> positions = s.positions;
  const bool interleaved = s.interleaved;
  std::ostringstream name;
  name << "rope " << scaling_name(s.scaling) << (interleaved ? " interleaved" : " halves") << " B=" << b
       << " T=" << t << " H=" << h << " Dh=" << dh << " R=" << s.rotary_dim << " pos";
  for (int32_t p : positions) name << "_" << p;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", shape}};
  c.outputs = {{"y"}};
  c.reference = [=](const Vecs& in) {
    const Vec inv = inv_freq_f64(cfg);
    const double scaling = attention_scaling_f64(cfg);
    Vec y = in[0];
    for (int64_t r = 0; r < b * t; ++r)
      for (int64_t head = 0; head < h; ++head) {
        const double* x = in[0].data() + (r * h + head) * dh;
        double* out = y.data() + (r * h + head) * dh;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = positions[r % t] * inv[i];
          const double co = scaling * std::cos(angle), si = scaling * std::sin(angle);
          // Complex multiplication of (x_i0 + i x_i1) by scaling * e^(i angle).
          const int64_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
          out[i0] = x[i0] * co - x[i1] * si;
          out[i1] = x[i0] * si + x[i1] * co;
        }
      }
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    const cpu::RopeFreqs f = cpu::rope_freqs(cfg);
    auto pos = HostTensor::i32({t}, positions);
    auto cos = HostTensor::zeros({t, half}), sin = HostTensor::zeros({t, half});
    cpu::rope_tables(f, pos.t, cos.t, sin.t);
    // In place, as the models call it.
    auto x = HostTensor::f32(shape, in[0]);
    cpu::rope_forward(x.t, cos.t, sin.t, interleaved, x.t);
    return Vecs{x.vec()};
  };
  c.backward = [=](const Vecs&, const Vecs& dout) {
    const cpu::RopeFreqs f = cpu::rope_freqs(cfg);
    auto pos = HostTensor::i32({t}, positions);
    auto cos = HostTensor::zeros({t, half}), sin = HostTensor::zeros({t, half});
    cpu::rope_tables(f, pos.t, cos.t, sin.t);
    auto dy = HostTensor::f32(shape, dout[0]), dx = HostTensor::zeros(shape);
    cpu::rope_backward(dy.t, cos.t, sin.t, interleaved, dx.t);
    return Vecs{dx.vec()};
  };
  // fp32 angles (as transformers computes them) err by ~pos * 2^-23, ~1e-7 at the rows' positions.
  c.fwd_tol = 5e-5;
  return c;
}

// The frequencies themselves, the part of rope that no row's tolerance sees closely.
TEST(RopeFreqs, MatchFloat64Formulas) {
  for (RopeScaling s : {RopeScaling::none, RopeScaling::yarn_gpt_oss, RopeScaling::yarn_deepseek})
    for (int64_t dim : {2, 8, 16, 64}) {
      const cpu::RopeConfig cfg = preset(s, dim);
      const cpu::RopeFreqs f = cpu::rope_freqs(cfg);
      const Vec want = inv_freq_f64(cfg);
      ASSERT_EQ(f.inv_freq.size(), want.size());
      // fp32 pow, reciprocal and blend, as transformers computes them: a few ulps.
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_NEAR(f.inv_freq[i], want[i], 1e-6 * want[i]) << scaling_name(s) << " dim " << dim << " pair " << i;
      EXPECT_NEAR(f.attention_scaling, attention_scaling_f64(cfg), 1e-6) << scaling_name(s) << " dim " << dim;
    }
}

// The attention factor in closed form: get_mscale(32) for GPT-OSS, the mscale ratio for
// DeepSeek, an explicit factor as given, and no temperature without stretching.
TEST(RopeFreqs, YarnAttentionFactor) {
  EXPECT_NEAR(cpu::rope_freqs(preset(RopeScaling::yarn_gpt_oss, 64)).attention_scaling, 1.0 + 0.1 * std::log(32.0),
              1e-6);
  EXPECT_NEAR(cpu::rope_freqs(preset(RopeScaling::yarn_deepseek, 64)).attention_scaling,
              (1.0 + 0.1 * std::log(40.0)) / (1.0 + 0.0707 * std::log(40.0)), 1e-6);
  cpu::RopeConfig explicit_factor = preset(RopeScaling::yarn_gpt_oss, 64);
  explicit_factor.attention_factor = 0.5;
  EXPECT_EQ(cpu::rope_freqs(explicit_factor).attention_scaling, 0.5f);
  cpu::RopeConfig no_stretch = preset(RopeScaling::yarn_gpt_oss, 64);
  no_stretch.factor = 1.0;
  EXPECT_EQ(cpu::rope_freqs(no_stretch).attention_scaling, 1.0f);
}

// The correction range the presets produce, worked out by hand: GPT-OSS keeps the
// fractional range (untruncated), DeepSeek's is widened to whole pairs.
TEST(RopeFreqs, YarnRampEnds) {
  // dim 8, theta 10000: range [1.31, 2.81] truncates to [1, 3]: pair 0 keeps its
  // frequency, pair 3 is fully divided by 40, pair 2 half-way.
  const cpu::RopeFreqs ds = cpu::rope_freqs(preset(RopeScaling::yarn_deepseek, 8));
  EXPECT_NEAR(ds.inv_freq[0], 1.0, 1e-7);
  EXPECT_NEAR(ds.inv_freq[1], 0.1, 1e-7);
  EXPECT_NEAR(ds.inv_freq[2], 0.5 * 0.01 + 0.5 * 0.01 / 40, 1e-8);
  EXPECT_NEAR(ds.inv_freq[3], 0.001 / 40, 1e-10);
  // dim 64, theta 150000: range [8.09, 17.40]; pair 8 untouched, pair 18 fully scaled.
  const cpu::RopeFreqs go = cpu::rope_freqs(preset(RopeScaling::yarn_gpt_oss, 64));
  EXPECT_NEAR(go.inv_freq[8], std::pow(150000.0, -16.0 / 64), 1e-6 * go.inv_freq[8]);
  EXPECT_NEAR(go.inv_freq[18], std::pow(150000.0, -36.0 / 64) / 32, 1e-6 * go.inv_freq[18]);
  EXPECT_GT(go.inv_freq[9], std::pow(150000.0, -18.0 / 64) / 32 * 1.01);
  EXPECT_LT(go.inv_freq[9], std::pow(150000.0, -18.0 / 64) * 0.99);
}

}  // namespace mt::test
