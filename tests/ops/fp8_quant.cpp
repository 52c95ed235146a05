// Blockwise FP8 quantization (kernels/fp8_quant.h) on the CPU against a reference written
// here in double precision: every tile's amax and scale, every element's e4m3 code from
// an encoder that searches the 127 finite values for the nearest (ties to the even code),
// and dequantize(quantize(x)) within half an e4m3 ulp. Edge cases are planted in the first
// tiles: an all-zero tile with a negative zero, a tile with one huge value (its small
// values become e4m3 subnormals), negative zeros; the shapes are ragged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/fp8_quant.h"

namespace mt::test {
namespace {

// Value of an e4m3 code from its fields: 1 sign, 4 exponent (bias 7), 3 mantissa bits.
double e4m3_value(int code) {
  const int e = (code >> 3) & 15, man = code & 7;
  const double v = e == 0 ? man * std::ldexp(1.0, -9) : (1.0 + man / 8.0) * std::ldexp(1.0, e - 7);
  return code & 0x80 ? -v : v;
}

// Nearest finite e4m3 value, ties to the even code; beyond 448 that is 448 (satfinite).
uint8_t e4m3_code(double v) {
  if (std::isnan(v)) return 0x7f;
  static const std::vector<double> value = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7e; ++c) t.push_back(e4m3_value(c));
    return t;
  }();
  const double a = std::fabs(v);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(value[c] - a), db = std::fabs(value[best] - a);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(std::signbit(v) ? best | 0x80 : best);
}

// amax / 448 rounded once to f32 (double then f32 rounds a quotient correctly), or the
// smallest power of two at or above it and at or above 2^-126.
float ref_scale(double amax, bool pow2) {
  if (amax == 0.0) return 1.0f;
  const float s = static_cast<float>(amax / 448.0);
  if (!pow2) return s;
  double p = std::ldexp(1.0, -126);
  while (p < s) p *= 2;
  return static_cast<float>(p);
}

using Get = std::function<double(int64_t, int64_t)>;
using CodeAt = std::function<uint8_t(int64_t, int64_t)>;
using ScaleAt = std::function<float(int64_t, int64_t)>;

// Checks [rows, cols] quantized in th x tw tiles; returns how many codes are subnormal.
int64_t check_tiles(const char* what, const Get& x, int64_t rows, int64_t cols, int64_t th, int64_t tw, bool pow2,
                    const CodeAt& code, const ScaleAt& scale) {
  int64_t subnormal = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += th)
    for (int64_t c0 = 0; c0 < cols; c0 += tw) {
      double amax = 0;
      for (int64_t r = r0; r < std::min(rows, r0 + th); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + tw); ++c) amax = std::max(amax, std::fabs(x(r, c)));
      const float s = ref_scale(amax, pow2);
      EXPECT_EQ(scale(r0 / th, c0 / tw), s) << what << " tile (" << r0 / th << ", " << c0 / tw << ") amax " << amax;
      EXPECT_LE(amax / s, 448.0 * (1 + 1e-7)) << what;
      for (int64_t r = r0; r < std::min(rows, r0 + th); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + tw); ++c) {
          const uint8_t want = e4m3_code(static_cast<float>(x(r, c) / s)), got = code(r, c);
          if (got != want) {
            ADD_FAILURE() << what << " (" << r << ", " << c << ") x " << x(r, c) << " scale " << s << ": code "
                          << int{got} << ", want " << int{want};
            return subnormal;
          }
          subnormal += (got & 0x78) == 0 && (got & 7) != 0;
          // Half an ulp: 2^-4 relative for normals, 2^-10 scale for subnormals, plus the
          // f32 roundings of x / s and of the dequantized product.
          const double back = e4m3_value(got) * s, err = std::fabs(back - x(r, c));
          EXPECT_LE(err, (std::fabs(x(r, c)) / 16 + s / 1024.0) * (1 + 1e-6)) << what << " (" << r << ", " << c << ")";
        }
    }
  return subnormal;
}

// Random values over 25 binades, with the edge cases planted in the first tiles.
std::vector<float> make_input(int64_t m, int64_t k, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-12, 12);
  std::vector<float> x(m * k);
  for (float& v : x) v = std::ldexp(u(rng), e(rng));
  for (int64_t c = 0; c < std::min<int64_t>(k, 128); ++c) x[c] = c == 1 ? -0.0f : 0.0f;  // a zero tile
  if (m > 1 && k > 6) {
    for (int64_t c = 0; c < std::min<int64_t>(k, 128); ++c) x[k + c] = std::ldexp(u(rng), -4);
    x[k + 5] = 30000.0f;  // one huge value: the rest of the tile is subnormal or zero
    x[k + 6] = -0.0f;
  }
  if (dtype == DType::bf16)
    for (float& v : x) v = f32_from_bf16(bf16_from_f32(v));
  return x;
}

// The input as the kernel reads it: f32, or the bf16 bits of the same (rounded) values.
struct Input {
  std::vector<float> f;
  std::vector<uint16_t> b;
  Tensor t;
  Input(std::vector<float> v, DType dtype, Shape s) : f(std::move(v)) {
    if (dtype == DType::bf16) {
      for (float x : f) b.push_back(bf16_from_f32(x));
      t = Tensor(b.data(), s, DType::bf16);
    } else {
      t = Tensor(f.data(), s, DType::f32);
    }
  }
};

TEST(Fp8Quant, RowsMatchFloat64Reference) {
  struct Case {
    int64_t m, k;
  };
  int64_t subnormal = 0;
  uint64_t seed = 1;
  for (Case c : {Case{1, 128}, Case{3, 300}, Case{130, 256}, Case{5, 1}, Case{257, 129}})
    for (DType dtype : {DType::f32, DType::bf16})
      for (bool pow2 : {true, false}) {
        SCOPED_TRACE(testing::Message() << "M=" << c.m << " K=" << c.k << " " << dtype_name(dtype) << " pow2=" << pow2);
        const int64_t m = c.m, k = c.k, tk = fp8::tiles(k);
        Input x(make_input(m, k, dtype, ++seed), dtype, {m, k});
        std::vector<uint8_t> q(m * k);
        std::vector<float> s(tk * m);
        cpu::quantize_rows(x.t, Tensor(q.data(), {m, k}, DType::f8e4m3), Tensor(s.data(), {tk, m}, DType::f32), pow2);
        const Get get = [&](int64_t r, int64_t col) { return double{x.f[r * k + col]}; };
        subnormal += check_tiles(
            "rows", get, m, k, 1, 128, pow2, [&](int64_t r, int64_t col) { return q[r * k + col]; },
            [&](int64_t tr, int64_t tc) { return s[tc * m + tr]; });
        // dequantize_rows is f32(q) * scale, one rounding.
        std::vector<float> back(m * k);
        cpu::dequantize_rows(Tensor(q.data(), {m, k}, DType::f8e4m3), Tensor(s.data(), {tk, m}, DType::f32), Tensor(back.data(), {m, k}, DType::f32));
        for (int64_t i = 0; i < m * k; ++i)
          ASSERT_EQ(back[i], static_cast<float>(e4m3_value(q[i]) * s[i % k / 128 * m + i / k])) << i;
        // The zero tile: scale 1, codes +-0, and -0 comes back as -0.
        EXPECT_EQ(s[0], 1.0f);
        if (k > 1) {
          EXPECT_EQ(q[1], 0x80);
          EXPECT_TRUE(std::signbit(back[1]));
        }
        if (m > 1 && k > 6) {
          EXPECT_EQ(q[k + 6], 0x80);
        }
      }
  EXPECT_GT(subnormal, 0) << "no tile reached e4m3's subnormal range";
}

TEST(Fp8Quant, BlocksMatchFloat64Reference) {
  struct Case {
    int64_t n, k;
  };
  int64_t subnormal = 0;
  uint64_t seed = 100;
  for (Case c : {Case{1, 128}, Case{130, 300}, Case{256, 640}, Case{7, 5}})
    for (DType dtype : {DType::f32, DType::bf16})
      for (bool pow2 : {true, false}) {
        SCOPED_TRACE(testing::Message() << "N=" << c.n << " K=" << c.k << " " << dtype_name(dtype) << " pow2=" << pow2);
        const int64_t n = c.n, k = c.k, tn = fp8::tiles(n), ld = fp8::block_scale_cols(k);
        ASSERT_EQ(ld % 4, 0);
        Input w(make_input(n, k, dtype, ++seed), dtype, {n, k});
        std::vector<uint8_t> q(n * k);
        std::vector<float> s(tn * ld, -1.0f);
        cpu::quantize_blocks(w.t, Tensor(q.data(), {n, k}, DType::f8e4m3), Tensor(s.data(), {tn, ld}, DType::f32), pow2);
        subnormal += check_tiles(
            "blocks", [&](int64_t r, int64_t col) { return double{w.f[r * k + col]}; }, n, k, 128, 128, pow2,
            [&](int64_t r, int64_t col) { return q[r * k + col]; }, [&](int64_t tr, int64_t tc) { return s[tr * ld + tc]; });
        for (int64_t tr = 0; tr < tn; ++tr) {
          for (int64_t tc = fp8::tiles(k); tc < ld; ++tc) EXPECT_EQ(s[tr * ld + tc], 0.0f) << "padding";
        }
        std::vector<float> back(n * k);
        cpu::dequantize_blocks(Tensor(q.data(), {n, k}, DType::f8e4m3), Tensor(s.data(), {tn, ld}, DType::f32), Tensor(back.data(), {n, k}, DType::f32));
        for (int64_t i = 0; i < n * k; ++i)
          ASSERT_EQ(back[i], static_cast<float>(e4m3_value(q[i]) * s[i / k / 128 * ld + i % k / 128])) << i;
      }
  EXPECT_GT(subnormal, 0);
}

// A layer's experts [E, N, K] block by block, with the transposed copy [E, K, N] that the
// input gradient reads: each checked against the reference as its own matrix.
TEST(Fp8Quant, ExpertBlocksAndTheirTransposeMatchFloat64Reference) {
  const int64_t e = 3, n = 130, k = 200, tn = fp8::tiles(n), tk = fp8::tiles(k);
  const int64_t ld = fp8::block_scale_cols(k), ldt = fp8::block_scale_cols(n);
  for (bool pow2 : {true, false}) {
    Input w(make_input(e * n, k, DType::bf16, pow2 ? 11 : 12), DType::bf16, {e, n, k});
    std::vector<uint8_t> q(e * n * k), qt(e * n * k);
    std::vector<float> s(e * tn * ld, -1.0f), st(e * tk * ldt, -1.0f);
    cpu::quantize_blocks(w.t, Tensor(q.data(), {e, n, k}, DType::f8e4m3), Tensor(s.data(), {e, tn, ld}, DType::f32),
                         pow2, Tensor(qt.data(), {e, k, n}, DType::f8e4m3), Tensor(st.data(), {e, tk, ldt}, DType::f32));
    for (int64_t b = 0; b < e; ++b) {
      SCOPED_TRACE(testing::Message() << "expert " << b << " pow2=" << pow2);
      const Get get = [&](int64_t r, int64_t c) { return double{w.f[(b * n + r) * k + c]}; };
      check_tiles(
          "blocks", get, n, k, 128, 128, pow2, [&](int64_t r, int64_t c) { return q[(b * n + r) * k + c]; },
          [&](int64_t tr, int64_t tc) { return s[(b * tn + tr) * ld + tc]; });
      check_tiles(
          "transposed blocks", [&](int64_t r, int64_t c) { return get(c, r); }, k, n, 128, 128, pow2,
          [&](int64_t r, int64_t c) { return qt[(b * k + r) * n + c]; },
          [&](int64_t tr, int64_t tc) { return st[(b * tk + tr) * ldt + tc]; });
      for (int64_t tr = 0; tr < tk; ++tr)
        for (int64_t tc = tn; tc < ldt; ++tc) EXPECT_EQ(st[(b * tk + tr) * ldt + tc], 0.0f) << "padding";
    }
  }
}

// The grouped product from the codes, in float64 here: the forward (and input gradient)
// per segment against its expert's blocks, empty and one-row experts included.
TEST(Fp8Quant, GroupedProductMatchesFloat64OfTheCodes) {
  const int64_t r = 300, k = 160, o = 136;
  const std::vector<int32_t> off = {0, 0, 1, 130, 130, 300};
  const int64_t e = static_cast<int64_t>(off.size()) - 1;
  const Tensor offsets(const_cast<int32_t*>(off.data()), {e + 1}, DType::i32);
  std::vector<float> x = make_input(r, k, DType::f32, 31), w = make_input(e * o, k, DType::f32, 32);
  std::vector<uint8_t> qx(r * k), qw(e * o * k), qwt(e * o * k);
  std::vector<float> sx(fp8::tiles(k) * r), sw(e * fp8::tiles(o) * fp8::block_scale_cols(k)),
      swt(e * fp8::tiles(k) * fp8::block_scale_cols(o));
  cpu::quantize_rows(Tensor(x.data(), {r, k}, DType::f32), Tensor(qx.data(), {r, k}, DType::f8e4m3),
                     Tensor(sx.data(), {fp8::tiles(k), r}, DType::f32), true);
  const Tensor tw(qw.data(), {e, o, k}, DType::f8e4m3), tsw(sw.data(), {e, fp8::tiles(o), fp8::block_scale_cols(k)}, DType::f32);
  cpu::quantize_blocks(Tensor(w.data(), {e, o, k}, DType::f32), tw, tsw, true,
                       Tensor(qwt.data(), {e, k, o}, DType::f8e4m3),
                       Tensor(swt.data(), {e, fp8::tiles(k), fp8::block_scale_cols(o)}, DType::f32));
  std::vector<float> y(r * o, NAN);
  cpu::grouped_gemm_fp8(Tensor(qx.data(), {r, k}, DType::f8e4m3), Tensor(sx.data(), {fp8::tiles(k), r}, DType::f32), tw,
                        tsw, offsets, Tensor(y.data(), {r, o}, DType::f32));
  const int64_t ld = fp8::block_scale_cols(k);
  double worst = 0, norm = 0;
  for (int64_t g = 0; g < e; ++g)
    for (int64_t i = off[g]; i < off[g + 1]; ++i)
      for (int64_t j = 0; j < o; ++j) {
        double want = 0;
        for (int64_t t = 0; t < k; ++t)
          want += e4m3_value(qx[i * k + t]) * sx[t / 128 * r + i] * e4m3_value(qw[(g * o + j) * k + t]) *
                  sw[(g * fp8::tiles(o) + j / 128) * ld + t / 128];
        worst = std::max(worst, std::fabs(y[i * o + j] - want));
        norm = std::max(norm, std::fabs(want));
      }
  EXPECT_LT(worst, 1e-5 * norm);
}

// The FP8 product: c = alpha a b^T + beta c from the codes and scales, in float64 here
// (e4m3_value of each code times its tile's scale), for a weight b (128x128 blocks) and
// for the weight gradient's form (b in 1x128 tiles); and close to the product of the
// unquantized inputs (e4m3 keeps 4 significant bits: a few percent per element).
TEST(Fp8Quant, GemmMatchesFloat64OfTheCodes) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t m = 130, n = 200, k = 384;
  std::vector<float> a(m * k), b(n * k), c0(m * n);
  for (float& v : a) v = normal(rng) * (1.0f + static_cast<float>(&v - a.data()) / k * 0.01f);
  for (float& v : b) v = normal(rng) * 0.05f;
  for (float& v : c0) v = normal(rng);
  std::vector<uint8_t> qa(m * k), qb(n * k);
  std::vector<float> sa(fp8::tiles(k) * m);
  cpu::quantize_rows(Tensor(a.data(), {m, k}, DType::f32), Tensor(qa.data(), {m, k}, DType::f8e4m3),
                     Tensor(sa.data(), {fp8::tiles(k), m}, DType::f32), true);
  for (bool blocks : {true, false}) {
    SCOPED_TRACE(blocks ? "b in blocks" : "b in 1x128 tiles");
    const int64_t sb_rows = blocks ? fp8::tiles(n) : fp8::tiles(k), sb_cols = blocks ? fp8::block_scale_cols(k) : n;
    std::vector<float> sb(sb_rows * sb_cols);
    const Tensor tb(qb.data(), {n, k}, DType::f8e4m3), tsb(sb.data(), {sb_rows, sb_cols}, DType::f32);
    if (blocks)
      cpu::quantize_blocks(Tensor(b.data(), {n, k}, DType::f32), tb, tsb, false);
    else
      cpu::quantize_rows(Tensor(b.data(), {n, k}, DType::f32), tb, tsb, false);
    auto scale_b = [&](int64_t j, int64_t t) { return blocks ? sb[j / 128 * sb_cols + t / 128] : sb[t / 128 * n + j]; };
    std::vector<float> c = c0;
    cpu::gemm_fp8(Tensor(qa.data(), {m, k}, DType::f8e4m3), Tensor(sa.data(), {fp8::tiles(k), m}, DType::f32), tb, tsb,
                  blocks, Tensor(c.data(), {m, n}, DType::f32), 0.5f, 2.0f);
    double worst = 0, worst_plain = 0, norm = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, plain = 0;
        for (int64_t t = 0; t < k; ++t) {
          want += e4m3_value(qa[i * k + t]) * sa[t / 128 * m + i] * e4m3_value(qb[j * k + t]) * scale_b(j, t);
          plain += static_cast<double>(a[i * k + t]) * b[j * k + t];
        }
        want = 0.5 * want + 2.0 * c0[i * n + j];
        plain = 0.5 * plain + 2.0 * c0[i * n + j];
        worst = std::max(worst, std::fabs(c[i * n + j] - want));
        worst_plain = std::max(worst_plain, std::fabs(c[i * n + j] - plain));
        norm = std::max(norm, std::fabs(want));
      }
    EXPECT_LT(worst, 1e-5 * norm);        // f32 accumulation of k = 384 terms
    EXPECT_LT(worst_plain, 0.05 * norm);  // the quantization itself
    EXPECT_GT(worst_plain, 1e-4 * norm);  // and it did quantize
  }
}

// The scale rule at its edges: zero, the smallest and largest amax, exact powers of two.
TEST(Fp8Quant, TileScaleEdges) {
  EXPECT_EQ(fp8::tile_scale(0.0f, true), 1.0f);
  EXPECT_EQ(fp8::tile_scale(0.0f, false), 1.0f);
  EXPECT_EQ(fp8::tile_scale(448.0f, true), 1.0f);
  EXPECT_EQ(fp8::tile_scale(448.5f, true), 2.0f);
  EXPECT_EQ(fp8::tile_scale(224.0f, true), 0.5f);
  EXPECT_EQ(fp8::tile_scale(1e-40f, true), std::ldexp(1.0f, -126));  // reciprocal stays finite
  EXPECT_EQ(fp8::tile_scale(3.4028235e38f, true), std::ldexp(1.0f, 120));
  EXPECT_TRUE(std::isinf(fp8::tile_scale(INFINITY, true)));
  for (float a : {1e-30f, 0.3f, 1.0f, 447.9f, 1e20f}) {
    EXPECT_EQ(fp8::tile_scale(a, false), ref_scale(a, false)) << a;
    EXPECT_EQ(fp8::tile_scale(a, true), ref_scale(a, true)) << a;
  }
}

}  // namespace
}  // namespace mt::test
