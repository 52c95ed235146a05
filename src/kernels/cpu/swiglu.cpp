#include "kernels/swiglu.h"

#include <algorithm>
#include <cmath>

namespace mt::cpu {

namespace {

// gu [N, 2I] and the [N, I] tensors that go with it; returns I.
int64_t check_gated(const char* op, const Tensor& gu, const Tensor& half, const char* half_name) {
  MT_CHECK(gu.ndim() == 2 && gu.dim(1) % 2 == 0) << op << " input should be [N,2I], got " << gu.str();
  int64_t n = gu.dim(0), i = gu.dim(1) / 2;
  check_tensor(gu, op, DType::f32, {n, 2 * i});
  check_tensor(half, half_name, DType::f32, {n, i});
  return i;
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

void swiglu_forward(const Tensor& gu, const Tensor& h) {
  int64_t i = check_gated("swiglu gu", gu, h, "swiglu h");
  int64_t n = gu.dim(0);
  const float* in = gu.f32();
  float* out = h.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in + r * 2 * i;
    const float* up = gate + i;
    for (int64_t c = 0; c < i; ++c) out[r * i + c] = gate[c] * sigmoid(gate[c]) * up[c];
  }
}

void swiglu_backward(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  int64_t i = check_gated("swiglu gu", gu, dh, "swiglu dh");
  int64_t n = gu.dim(0);
  check_tensor(dgu, "swiglu dgu", DType::f32, gu.shape);
  const float* in = gu.f32();
  const float* g = dh.f32();
  float* out = dgu.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in + r * 2 * i;
    const float* up = gate + i;
    float* dgate = out + r * 2 * i;
    float* dup = dgate + i;
    for (int64_t c = 0; c < i; ++c) {
      float s = sigmoid(gate[c]), d = g[r * i + c];
      // silu'(x) = s + x s (1 - s)
      dgate[c] = d * up[c] * s * (1.0f + gate[c] * (1.0f - s));
      dup[c] = d * gate[c] * s;
    }
  }
}

// std::min/max rather than fmin/fmax: a NaN input stays NaN, as with torch.clamp.
void clamped_swiglu_forward(const Tensor& gu, float limit, float alpha, const Tensor& h) {
  int64_t i = check_gated("clamped_swiglu gu", gu, h, "clamped_swiglu h");
  int64_t n = gu.dim(0);
  const float* in = gu.f32();
  float* out = h.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* row = in + r * 2 * i;
    for (int64_t c = 0; c < i; ++c) {
      float gate = std::min(row[2 * c], limit);
      float up = std::max(std::min(row[2 * c + 1], limit), -limit);
      out[r * i + c] = (up + 1.0f) * gate * sigmoid(alpha * gate);
    }
  }
}

void clamped_swiglu_backward(const Tensor& gu, float limit, float alpha, const Tensor& dh, const Tensor& dgu) {
  int64_t i = check_gated("clamped_swiglu gu", gu, dh, "clamped_swiglu dh");
  int64_t n = gu.dim(0);
  check_tensor(dgu, "clamped_swiglu dgu", DType::f32, gu.shape);
  const float* in = gu.f32();
  const float* g = dh.f32();
  float* out = dgu.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* row = in + r * 2 * i;
    float* drow = out + r * 2 * i;
    for (int64_t c = 0; c < i; ++c) {
      float graw = row[2 * c], uraw = row[2 * c + 1];
      float gate = std::min(graw, limit);
      float up = std::max(std::min(uraw, limit), -limit);
      float s = sigmoid(alpha * gate), d = g[r * i + c];
      // torch.clamp passes the gradient where min <= x <= max, boundaries included.
      drow[2 * c] = graw <= limit ? d * (up + 1.0f) * s * (1.0f + alpha * gate * (1.0f - s)) : 0.0f;
      drow[2 * c + 1] = (uraw >= -limit && uraw <= limit) ? d * gate * s : 0.0f;
    }
  }
}

// v [N, C]; s [N, C] or [N, 1]: returns s's columns.
static int64_t check_sigmoid_gate(const Tensor& v, const Tensor& s) {
  MT_CHECK(v.ndim() == 2) << "sigmoid_gate v should be [N,C], got " << v.str();
  check_tensor(v, "sigmoid_gate v", DType::f32, v.shape);
  MT_CHECK(s.ndim() == 2 && s.dim(0) == v.dim(0) && (s.dim(1) == v.dim(1) || s.dim(1) == 1))
      << "sigmoid_gate s should be [N,C] or [N,1] for v " << v.str() << ", got " << s.str();
  check_tensor(s, "sigmoid_gate s", DType::f32, s.shape);
  return s.dim(1);
}

void sigmoid_gate_forward(const Tensor& v, const Tensor& s, const Tensor& out) {
  const int64_t gc = check_sigmoid_gate(v, s), n = v.dim(0), c = v.dim(1);
  check_tensor(out, "sigmoid_gate out", DType::f32, v.shape);
  const float *vp = v.f32(), *sp = s.f32();
  float* o = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < c; ++j) o[r * c + j] = vp[r * c + j] * sigmoid(sp[r * gc + (gc == 1 ? 0 : j)]);
}

void sigmoid_gate_backward(const Tensor& v, const Tensor& s, const Tensor& dout, const Tensor& dv, const Tensor& ds) {
  const int64_t gc = check_sigmoid_gate(v, s), n = v.dim(0), c = v.dim(1);
  check_tensor(dout, "sigmoid_gate dout", DType::f32, v.shape);
  check_tensor(dv, "sigmoid_gate dv", DType::f32, v.shape);
  check_tensor(ds, "sigmoid_gate ds", DType::f32, s.shape);
  const float *vp = v.f32(), *sp = s.f32(), *g = dout.f32();
  float *dvp = dv.f32(), *dsp = ds.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float row = 0.0f;
    for (int64_t j = 0; j < c; ++j) {
      const float sg = sigmoid(sp[r * gc + (gc == 1 ? 0 : j)]), d = g[r * c + j];
      const float d_s = d * vp[r * c + j] * sg * (1.0f - sg);
      if (gc == 1) row += d_s;
      else dsp[r * c + j] = d_s;
      dvp[r * c + j] = sg * d;  // after dout's read: dv may be dout
    }
    if (gc == 1) dsp[r] = row;
  }
}

}  // namespace mt::cpu
