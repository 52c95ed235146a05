// src/core: number formats (exhaustively), tensors, arenas, checks and the RNG.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/arena.h"
#include "core/check.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"

#ifdef MOETRAIN_TEST_CUDA_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

namespace mt {
namespace {

// ---- independent references, in double ------------------------------------------

// Value of a bf16 bit pattern from its fields.
double bf16_value(uint16_t b) {
  int sign = b >> 15, exp = (b >> 7) & 0xff, man = b & 0x7f;
  double mag = exp == 0 ? std::ldexp(man, -133) : std::ldexp(128 + man, exp - 134);
  if (exp == 0xff) mag = man ? std::nan("") : INFINITY;
  return sign ? -mag : mag;
}

// Value of an e4m3 bit pattern from its fields.
double e4m3_value(uint8_t b) {
  int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7) return std::nan("");
  double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -mag : mag;
}

// Nearest of a sorted list of non-negative representable magnitudes, ties to the
// code with an even mantissa; beyond the top, `overflow` decides.
template <typename Code>
Code nearest(double mag, const std::vector<std::pair<double, Code>>& grid) {
  auto hi = std::lower_bound(grid.begin(), grid.end(), mag, [](const auto& g, double m) { return g.first < m; });
  if (hi == grid.begin()) return hi->second;
  auto lo = hi - 1;
  double dl = mag - lo->first, dh = hi->first - mag;
  if (dl < dh) return lo->second;
  if (dh < dl) return hi->second;
  return (lo->second & 1) == 0 ? lo->second : hi->second;
}

uint16_t bf16_reference(float f) {
  static const std::vector<std::pair<double, uint16_t>> grid = [] {
    std::vector<std::pair<double, uint16_t>> g;
    for (uint32_t b = 0; b <= 0x7f80; ++b) g.push_back({bf16_value(static_cast<uint16_t>(b)), static_cast<uint16_t>(b)});
    return g;  // ends with +inf (0x7f80): overflow past max+half-ulp rounds to it
  }();
  if (std::isnan(f)) return 0x7fff;
  double mag = std::fabs(static_cast<double>(f));
  uint16_t code;
  if (std::isinf(mag)) {
    code = 0x7f80;
  } else {
    // Past the largest finite value the next step would be 2^128: round against that.
    double max = bf16_value(0x7f7f), next = std::ldexp(1.0, 128);
    if (mag >= max) code = (mag - max < next - mag) ? 0x7f7f : 0x7f80;
    else code = nearest(mag, grid);
  }
  return std::signbit(f) ? static_cast<uint16_t>(code | 0x8000) : code;
}

uint8_t e4m3_reference(float f) {
  static const std::vector<std::pair<double, uint8_t>> grid = [] {
    std::vector<std::pair<double, uint8_t>> g;
    for (uint32_t b = 0; b <= 0x7e; ++b) g.push_back({e4m3_value(static_cast<uint8_t>(b)), static_cast<uint8_t>(b)});
    return g;
  }();
  if (std::isnan(f)) return 0x7f;
  double mag = std::fabs(static_cast<double>(f));
  uint8_t code = mag >= 448.0 ? 0x7e : nearest(mag, grid);  // satfinite
  return std::signbit(f) ? static_cast<uint8_t>(code | 0x80) : code;
}

// ---- bf16 ---------------------------------------------------------------------------

TEST(Bf16, EveryValueDecodesAndRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    uint16_t h = static_cast<uint16_t>(b);
    float f = f32_from_bf16(h);
    double want = bf16_value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
      ASSERT_EQ(bf16_from_f32(f), 0x7fff) << std::hex << b;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << std::hex << b;
    ASSERT_EQ(bf16_from_f32(f), h) << std::hex << b;
  }
}

TEST(Bf16, TiesAndNeighboursOfEveryMidpoint) {
  // Between consecutive finite codes c and c+1 (same sign) the midpoint is exact in
  // fp32; it must go to the even code, and one fp32 ulp either side to the nearer.
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t c = 0; c < 0x7f7f; ++c) {
      float lo = f32_from_bf16(static_cast<uint16_t>(sign | c)), hi = f32_from_bf16(static_cast<uint16_t>(sign | (c + 1)));
      float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
      uint16_t even = static_cast<uint16_t>(sign | ((c & 1) ? c + 1 : c));
      ASSERT_EQ(bf16_from_f32(mid), even) << std::hex << c;
      ASSERT_EQ(bf16_from_f32(std::nextafter(mid, lo)), sign | c) << std::hex << c;
      ASSERT_EQ(bf16_from_f32(std::nextafter(mid, hi)), sign | (c + 1)) << std::hex << c;
    }
  }
}

TEST(Bf16, SpecialValues) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bf16_from_f32(inf), 0x7f80);
  EXPECT_EQ(bf16_from_f32(-inf), 0xff80);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the top
  EXPECT_EQ(bf16_from_f32(std::nanf("")), 0x7fff);
  EXPECT_EQ(bf16_from_f32(-std::nanf("")), 0x7fff);
  EXPECT_EQ(bf16_from_f32(f32_from_bits(0x7f800001u)), 0x7fff);  // a signalling NaN must not become inf
  EXPECT_EQ(bf16_from_f32(0.0f), 0x0000);
  EXPECT_EQ(bf16_from_f32(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(bf16_from_f32(f32_from_bits(0x00018000u)), 0x0002);  // subnormal tie, odd below: up
  EXPECT_EQ(bf16_from_f32(f32_from_bits(0x00008000u)), 0x0000);  // subnormal tie, even below: down
  EXPECT_EQ(bf16_from_f32(1.0f + 1.0f / 256), 0x3f80);  // exact tie at 1: even is 1.0
}

TEST(Bf16, MatchesDoubleReferenceOnAFp32Sweep) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    float f = f32_from_bits(static_cast<uint32_t>(u));
    ASSERT_EQ(bf16_from_f32(f), bf16_reference(f)) << std::hex << u;
  }
}

// ---- e4m3 ---------------------------------------------------------------------------

TEST(E4m3, EveryValueDecodesAndRoundTrips) {
  int nans = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    uint8_t q = static_cast<uint8_t>(b);
    float f = f32_from_e4m3(q);
    double want = e4m3_value(q);
    if (std::isnan(want)) {
      ++nans;
      ASSERT_TRUE(std::isnan(f));
      ASSERT_EQ(e4m3_from_f32(f), 0x7f);
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << b;
    ASSERT_EQ(e4m3_from_f32(f), q) << b;
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(f32_from_e4m3(0x7e), 448.0f);
  EXPECT_EQ(f32_from_e4m3(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_from_e4m3(0x08), std::ldexp(1.0f, -6));
}

TEST(E4m3, TiesAndNeighboursOfEveryMidpoint) {
  for (uint32_t sign : {0u, 0x80u}) {
    for (uint32_t c = 0; c < 0x7e; ++c) {
      float lo = f32_from_e4m3(static_cast<uint8_t>(sign | c)), hi = f32_from_e4m3(static_cast<uint8_t>(sign | (c + 1)));
      float mid = (lo + hi) / 2;  // exact: e4m3 has 3 mantissa bits
      uint8_t even = static_cast<uint8_t>(sign | ((c & 1) ? c + 1 : c));
      ASSERT_EQ(e4m3_from_f32(mid), even) << c;
      ASSERT_EQ(e4m3_from_f32(std::nextafter(mid, lo)), sign | c) << c;
      ASSERT_EQ(e4m3_from_f32(std::nextafter(mid, hi)), sign | (c + 1)) << c;
    }
  }
}

TEST(E4m3, SaturatesAndKeepsNaN) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(e4m3_from_f32(inf), 0x7e);
  EXPECT_EQ(e4m3_from_f32(-inf), 0xfe);
  EXPECT_EQ(e4m3_from_f32(448.0f), 0x7e);
  EXPECT_EQ(e4m3_from_f32(463.99f), 0x7e);
  EXPECT_EQ(e4m3_from_f32(464.0f), 0x7e);  // the tie with the NaN code saturates
  EXPECT_EQ(e4m3_from_f32(1e30f), 0x7e);
  EXPECT_EQ(e4m3_from_f32(-1e30f), 0xfe);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(e4m3_from_f32(std::nanf("")), 0x7f);
  EXPECT_EQ(e4m3_from_f32(-std::nanf("")), 0x7f);
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(e4m3_from_f32(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(e4m3_from_f32(-std::ldexp(3.0f, -10)), 0x82);  // 1.5 quanta: tie to even 2
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(e4m3_from_f32(-0.0f), 0x80);
}

TEST(E4m3, MatchesDoubleReferenceOnAFp32Sweep) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    float f = f32_from_bits(static_cast<uint32_t>(u));
    ASSERT_EQ(e4m3_from_f32(f), e4m3_reference(f)) << std::hex << u;
  }
  // Densely where e4m3 has values: every fp32 with a magnitude in [2^-11, 512).
  for (uint32_t u = 0x3a000000u; u < 0x44000000u; u += 61) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      float f = f32_from_bits(u | sign);
      ASSERT_EQ(e4m3_from_f32(f), e4m3_reference(f)) << std::hex << (u | sign);
    }
  }
}

#ifdef MOETRAIN_TEST_CUDA_HEADERS
// NVIDIA's own host implementations of the conversions, over every fp32 value.
TEST(Conversions, MatchCudaHeadersOnEveryFp32) {
  int64_t bad_bf16 = 0, bad_e4m3 = 0;
#pragma omp parallel for reduction(+ : bad_bf16, bad_e4m3) schedule(static)
  for (int64_t u = 0; u <= 0xffffffffll; ++u) {
    float f = f32_from_bits(static_cast<uint32_t>(u));
    __nv_bfloat16_raw b = __float2bfloat16_rn(f);
    bad_bf16 += bf16_from_f32(f) != b.x;
    bad_e4m3 += e4m3_from_f32(f) != __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  }
  EXPECT_EQ(bad_bf16, 0);
  EXPECT_EQ(bad_e4m3, 0);
}
#endif

// ---- tensors, arenas, checks ---------------------------------------------------------

TEST(Tensor, ShapesViewsAndRows) {
  std::vector<float> buf(24);
  Tensor t(buf.data(), {2, 3, 4}, DType::f32);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.str(), "f32[2,3,4]@cpu");
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.data, t.data);
  Tensor r = t.rows(1, 2);
  EXPECT_EQ(r.f32(), buf.data() + 12);
  EXPECT_EQ(r.shape, (Shape{1, 3, 4}));
  EXPECT_THROW(t.view({5, 5}), Error);
  EXPECT_THROW(t.rows(1, 3), Error);
  EXPECT_THROW(t.i32(), Error);
}

TEST(Check, MessageNamesStatementPlaceRankAndDetail) {
  set_check_rank(3);
  std::vector<float> buf(6);
  Tensor x(buf.data(), {2, 3}, DType::f32);
  try {
    check_tensor(x, "router logits", DType::f32, {2, 4});
    FAIL() << "no throw";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("src/core/tensor.cpp:"), std::string::npos) << m;
    EXPECT_NE(m.find("on rank 3"), std::string::npos) << m;
    EXPECT_NE(m.find("router logits should be f32[2,4], got f32[2,3]@cpu"), std::string::npos) << m;
    EXPECT_NE(m.find("check `"), std::string::npos) << m;
    // The message leads; where it was raised follows (the CLI prints it with --verbose).
    EXPECT_EQ(e.message, "router logits should be f32[2,4], got f32[2,3]@cpu");
    EXPECT_EQ(m, e.message + " [" + e.where + "]");
    EXPECT_EQ(e.where.rfind("check `", 0), 0u) << e.where;
    EXPECT_NE(e.where.find("src/core/tensor.cpp:"), std::string::npos) << e.where;
  }
  set_check_rank(-1);
  // A check with nothing streamed is an internal invariant: the place is the message.
  try {
    MT_CHECK(buf.size() == 7);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message.rfind("internal error: check `buf.size() == 7` failed at tests/test_core.cpp:", 0), 0u)
        << e.message;
    EXPECT_EQ(e.where, "");
  }
  EXPECT_EQ(closest("lrr", {"seed", "lr", "steps"}), "lr");
  EXPECT_EQ(closest("print_config", {"config", "print-config"}), "print-config");
}

TEST(Arena, AlignsCountsAndRefusesOverflow) {
  Arena a("activations", Device::cpu, 4096);
  Tensor x = a.alloc(DType::f32, {3});
  Tensor y = a.alloc(DType::bf16, {5, 7});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data) % Arena::kAlign, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(y.data) % Arena::kAlign, 0u);
  EXPECT_EQ(static_cast<char*>(y.data) - static_cast<char*>(x.data), 256);
  EXPECT_EQ(a.used(), 256u + 70u);
  try {
    a.alloc(DType::f32, {1024});
    FAIL() << "no throw";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("arena 'activations' is full"), std::string::npos) << m;
    EXPECT_NE(m.find("f32[1024] needs 4096 bytes at offset 512 of 4096"), std::string::npos) << m;
  }
  a.reset();
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.peak(), 326u);
  EXPECT_EQ(a.alloc(DType::f32, {1024}).nbytes(), 4096u);
  // Sizes whose products wrap (a config.json's huge dims made arenas too small and the
  // writes went past them): an error, in a counting arena too.
  Arena count = Arena::counting("weights", Device::cpu);
  auto error = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error([&] { count.alloc(DType::f32, {int64_t{1} << 40, int64_t{1} << 30}); })
                .find("has more elements than fit in 64 bits"),
            std::string::npos);
  EXPECT_NE(error([&] { count.alloc(DType::f32, {int64_t{1} << 62}); }).find("needs more bytes than fit in 64 bits"),
            std::string::npos);
  // One block past the machine's memory is refused before it is asked for.
  EXPECT_NE(error([] { Arena huge("weights", Device::cpu, size_t{1} << 60); }).find("more than this machine's"),
            std::string::npos);
}

TEST(Arena, CountingArenaMeasuresWithoutStorage) {
  Arena a = Arena::counting("plan", Device::cuda);
  Tensor x = a.alloc(DType::f32, {1000});
  a.alloc(DType::i64, {10});
  EXPECT_EQ(x.data, nullptr);
  EXPECT_EQ(a.peak(), 4096u + 80u);
}

TEST(Arena, CudaTensorsNeedACudaBuild) {
#ifdef MOETRAIN_WITH_CUDA
  GTEST_SKIP() << "built with CUDA; allocation needs a GPU";
#endif
  EXPECT_THROW(Arena("w", Device::cuda, 16), Error);
}

// ---- Philox ------------------------------------------------------------------------

TEST(Philox, KnownAnswers) {
  // The Random123 known-answer vectors for philox4x32-10.
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, NormalIsDeterministicPrefixStableAndStandard) {
  std::vector<float> a(1 << 20), b(7);
  fill_normal(a.data(), static_cast<int64_t>(a.size()), 42, stream_of("model.embed_tokens.weight"), 0.0f, 1.0f);
  fill_normal(b.data(), 7, 42, stream_of("model.embed_tokens.weight"), 0.0f, 1.0f);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(a[i], b[i]);
  double s = 0, s2 = 0;
  for (float x : a) {
    s += x;
    s2 += static_cast<double>(x) * x;
  }
  double n = static_cast<double>(a.size()), mean = s / n, var = s2 / n - mean * mean;
  // 5 standard errors: mean's is 1/sqrt(n) ~ 1e-3, variance's sqrt(2/n) ~ 1.4e-3.
  EXPECT_NEAR(mean, 0.0, 5e-3);
  EXPECT_NEAR(var, 1.0, 7e-3);
  std::vector<float> c(7);
  fill_normal(c.data(), 7, 42, stream_of("model.norm.weight"), 0.0f, 1.0f);
  EXPECT_NE(c, b);
}

}  // namespace
}  // namespace mt
