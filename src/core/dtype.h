// Element types and the bit-exact float conversions the kernels rely on.
//
// bf16 and fp8-e4m3 are stored as raw bits (uint16_t, uint8_t) so the CPU backend
// can emulate what the GPU computes. Conversions from fp32 round to nearest even;
// e4m3 saturates finite overflow and infinities to +-448 (the `satfinite` mode
// Hopper's cvt instructions use for training) and maps every NaN to the canonical NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>

namespace mt {

enum class DType : uint8_t { f32, bf16, f8e4m3, i32, i64, u8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f8e4m3: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f8e4m3: return "f8e4m3";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

inline uint32_t f32_bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float f32_from_bits(uint32_t u) { return std::bit_cast<float>(u); }

// bf16 is the top half of an fp32. Rounding adds 0x7fff plus the lowest kept bit,
// which is round-to-nearest-even; overflow carries into the exponent and gives inf,
// as the hardware does. Every NaN becomes the canonical 0x7fff, as cvt.rn.bf16.f32
// gives, so truncation can never turn a NaN into an infinity.
inline uint16_t bf16_from_f32(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f32_from_bf16(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// e4m3 (the "fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities; S.1111.111 is NaN, so the largest finite value is 448 = 1.75 * 2^8.
// Subnormals are m * 2^-9 for m in 1..7.
inline float f32_from_e4m3(uint8_t b) {
  uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xfu;
  uint32_t man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return f32_from_bits(sign | 0x7fc00000u);
  if (exp == 0) {
    // m * 2^-9 is exact in fp32; build it from the integer to avoid a lookup table.
    float v = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

inline uint8_t e4m3_from_f32(float f) {
  uint32_t u = f32_bits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fu;  // NaN, sign dropped as cvt does
  // 448 plus half an ulp (16) = 464: from there on (inf included) saturate.
  if (a >= 0x43e80000u) return static_cast<uint8_t>(sign | 0x7eu);
  if (a < 0x3c800000u) {
    // Below 2^-6: subnormal range, quantum 2^-9. Scale to units of the quantum; the
    // product is exact, and nearbyint rounds half to even under the default mode.
    float q = f32_from_bits(a) * 512.0f;
    uint32_t m = static_cast<uint32_t>(__builtin_nearbyintf(q));
    return static_cast<uint8_t>(sign | m);  // m == 8 is exactly the smallest normal
  }
  // Normal: keep 3 mantissa bits of 23, round to nearest even on the 20 dropped.
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t exp = (r >> 23) - 120u;
  uint32_t man = (r >> 20) & 0x7u;
  return static_cast<uint8_t>(sign | (exp << 3) | man);
}

}  // namespace mt
