#include "kernels/ring_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/elementwise.h"

namespace mt::cpu {

void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse) {
  MT_CHECK(acc.ndim() == 4 && acc.dim(1) % 2 == 0 && b >= 0 && b < acc.dim(0) && (slot == 0 || slot == 1))
      << "ring_merge: block (batch row " << b << ", slot " << slot << ") of " << acc.str()
      << " is not one of a [B,2C,H,Dh] tensor's";
  const int64_t c = acc.dim(1) / 2, h = acc.dim(2), d = acc.dim(3);
  check_tensor(acc, "ring merge acc", DType::f32, acc.shape);
  check_tensor(lse, "ring merge lse", DType::f32, {acc.dim(0), h, 2 * c});
  check_tensor(o, "ring merge block out", DType::f32, {1, c, h, d});
  check_tensor(l, "ring merge block lse", DType::f32, {1, h, c});
  const float* ob = o.f32();
  const float* lb = l.f32();
  float* op = acc.f32();
  float* lp = lse.f32();
  const float minus_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = 0; i < c; ++i) {
      const float l_new = lb[hh * c + i];
      if (l_new == minus_inf) continue;
      float& run = lp[(b * h + hh) * 2 * c + slot * c + i];
      float* out = op + ((b * 2 * c + slot * c + i) * h + hh) * d;
      const float* x = ob + (i * h + hh) * d;
      if (run == minus_inf) {
        std::copy_n(x, d, out);
        run = l_new;
        continue;
      }
      const double m = std::max(run, l_new), w_old = std::exp(run - m), w_new = std::exp(l_new - m), z = w_old + w_new;
      for (int64_t e = 0; e < d; ++e) out[e] = static_cast<float>((w_old * out[e] + w_new * x[e]) / z);
      run = static_cast<float>(m + std::log(z));
    }
}

void accumulate(const Tensor& x, const Tensor& acc) { cpu::add(acc, x, acc); }

}  // namespace mt::cpu
