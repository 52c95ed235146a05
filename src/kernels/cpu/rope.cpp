#include "kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace mt::cpu {

namespace {

// transformers' get_mscale: YaRN's attention temperature for a context stretched by `scale`.
double yarn_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// Rotates the first 2 * cos.dim(1) dims of every head of x [B,T,H,Dh] into y. The
// backward is the transposed rotation, which is the same map with sin negated.
void rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, float sin_sign, const Tensor& y,
            const char* what) {
  MT_CHECK(x.ndim() == 4) << "rope " << what << " should be [B,T,H,Dh], got " << x.str();
  const int64_t b = x.dim(0), t = x.dim(1), h = x.dim(2), dh = x.dim(3);
  MT_CHECK(cos.ndim() == 2) << "rope cos should be [T, rotary_dim/2], got " << cos.str();
  const int64_t half = cos.dim(1);
  check_tensor(x, what, DType::f32, {b, t, h, dh});
  check_tensor(cos, "rope cos", DType::f32, {t, half});
  check_tensor(sin, "rope sin", DType::f32, {t, half});
  check_tensor(y, "rope output", DType::f32, {b, t, h, dh});
  MT_CHECK(x.device == Device::cpu && y.device == Device::cpu) << "cpu rope got " << x.str() << " -> " << y.str();
  MT_CHECK(2 * half <= dh) << "rotary_dim " << 2 * half << " exceeds head_dim " << dh;
  const float* xp = x.f32();
  const float* cp = cos.f32();
  const float* sp = sin.f32();
  float* yp = y.f32();
  // Pair p of a head: (p, p + half) for rotate_half, (2p, 2p + 1) when interleaved.
  const int64_t first_stride = interleaved ? 2 : 1;
  const int64_t second_offset = interleaved ? 1 : half;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < b * t; ++row) {
    const float* c = cp + (row % t) * half;
    const float* s = sp + (row % t) * half;
    for (int64_t head = 0; head < h; ++head) {
      const float* xi = xp + (row * h + head) * dh;
      float* yi = yp + (row * h + head) * dh;
      for (int64_t p = 0; p < half; ++p) {
        // Both values are read before either is written, so y may alias x.
        const int64_t i0 = p * first_stride, i1 = i0 + second_offset;
        const float a = xi[i0], e = xi[i1], sn = sin_sign * s[p];
        yi[i0] = a * c[p] - e * sn;
        yi[i1] = e * c[p] + a * sn;
      }
      if (yi != xi) std::copy(xi + 2 * half, xi + dh, yi + 2 * half);
    }
  }
}

}  // namespace

// Computed in fp32 where transformers computes in fp32 (the frequencies and the YaRN
// ramp), in double where it computes in Python floats (the correction range, the
// attention factor), so the tables match what the checkpoints were trained with.
RopeFreqs rope_freqs(const RopeConfig& cfg) {
  MT_CHECK(cfg.rotary_dim > 0 && cfg.rotary_dim % 2 == 0) << "rope rotary_dim must be positive and even, got "
                                                          << cfg.rotary_dim;
  MT_CHECK(cfg.theta > 1.0) << "rope theta must exceed 1, got " << cfg.theta;
  const int64_t half = cfg.rotary_dim / 2;
  const float base = static_cast<float>(cfg.theta);
  const float dim = static_cast<float>(cfg.rotary_dim);
  // pos_freq[i] = theta^(2i/dim), the wavelength over 2 pi of pair i.
  std::vector<float> pos_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) pos_freq[i] = std::pow(base, static_cast<float>(2 * i) / dim);

  RopeFreqs f;
  f.inv_freq.resize(static_cast<size_t>(half));
  if (!cfg.yarn) {
    for (int64_t i = 0; i < half; ++i) f.inv_freq[i] = 1.0f / pos_freq[i];
    return f;
  }

  MT_CHECK(cfg.factor > 0 && cfg.beta_fast > 0 && cfg.beta_slow > 0 && cfg.original_max_position > 0)
      << "YaRN needs positive factor, beta_fast, beta_slow and original_max_position; got factor " << cfg.factor
      << ", beta_fast " << cfg.beta_fast << ", beta_slow " << cfg.beta_slow << ", original_max_position "
      << cfg.original_max_position;
  // The (fractional) pair index whose wavelength fits `rotations` times in the original context.
  auto correction_dim = [&](double rotations) {
    return cfg.rotary_dim * std::log(cfg.original_max_position / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(cfg.theta));
  };
  double low = correction_dim(cfg.beta_fast), high = correction_dim(cfg.beta_slow);
  if (cfg.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(cfg.rotary_dim - 1));
  if (low == high) high += 0.001;  // as transformers does, to avoid dividing by zero

  // Pairs below `low` keep their frequency (extrapolate), pairs above `high` are
  // divided by factor (interpolate), with a linear ramp in between.
  const float factor = static_cast<float>(cfg.factor);
  const float low_f = static_cast<float>(low), range_f = static_cast<float>(high - low);
  for (int64_t i = 0; i < half; ++i) {
    const float ramp = std::clamp((static_cast<float>(i) - low_f) / range_f, 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float inv_interpolated = 1.0f / (factor * pos_freq[i]);
    const float inv_extrapolated = 1.0f / pos_freq[i];
    f.inv_freq[i] = inv_interpolated * (1.0f - extrapolation) + inv_extrapolated * extrapolation;
  }

  double attention = cfg.attention_factor;
  if (attention == 0.0) {
    attention = cfg.mscale != 0.0 && cfg.mscale_all_dim != 0.0
                    ? yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
                    : yarn_mscale(cfg.factor, 1.0);
  }
  f.attention_scaling = static_cast<float>(attention);
  return f;
}

void rope_tables(const RopeFreqs& f, const Tensor& positions, const Tensor& cos, const Tensor& sin) {
  MT_CHECK(positions.ndim() == 1) << "rope positions should be [T], got " << positions.str();
  const int64_t t = positions.dim(0);
  const int64_t half = static_cast<int64_t>(f.inv_freq.size());
  check_tensor(positions, "rope positions", DType::i32, {t});
  check_tensor(cos, "rope cos", DType::f32, {t, half});
  check_tensor(sin, "rope sin", DType::f32, {t, half});
  MT_CHECK(positions.device == Device::cpu && cos.device == Device::cpu && sin.device == Device::cpu)
      << "cpu rope_tables got " << positions.str() << ", " << cos.str() << ", " << sin.str();
  const int32_t* pos = positions.i32();
  float* cp = cos.f32();
  float* sp = sin.f32();
  for (int64_t j = 0; j < t; ++j)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos[j]) * f.inv_freq[i];
      cp[j * half + i] = std::cos(angle) * f.attention_scaling;
      sp[j * half + i] = std::sin(angle) * f.attention_scaling;
    }
}

void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& y) {
  rotate(x, cos, sin, interleaved, 1.0f, y, "rope x");
}

void rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& dx) {
  rotate(dy, cos, sin, interleaved, -1.0f, dx, "rope dy");
}

}  // namespace mt::cpu
