#include "core/rng.h"

#include <cmath>

namespace mt {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k[0] += kW0;
      k[1] += kW1;
    }
    uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
  }
  return c;
}

namespace {

std::array<uint32_t, 4> block(uint64_t seed, uint64_t stream, uint64_t i) {
  return philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(stream),
                        static_cast<uint32_t>(stream >> 32)},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

// (0, 1]: never 0, so log() in Box-Muller is finite.
double unit(uint32_t x) { return (static_cast<double>(x) + 1.0) * (1.0 / 4294967296.0); }

}  // namespace

void fill_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {
    auto r = block(seed, stream, static_cast<uint64_t>(b));
    for (int j = 0; j < 4 && 4 * b + j < n; ++j) out[4 * b + j] = static_cast<float>(lo + (hi - lo) * unit(r[j]));
  }
}

void fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, float mean, float std) {
  constexpr double kTwoPi = 6.283185307179586;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {
    auto r = block(seed, stream, static_cast<uint64_t>(b));
    for (int pair = 0; pair < 2; ++pair) {
      double radius = std::sqrt(-2.0 * std::log(unit(r[2 * pair])));
      double angle = kTwoPi * unit(r[2 * pair + 1]);
      int64_t i = 4 * b + 2 * pair;
      if (i < n) out[i] = static_cast<float>(mean + std * radius * std::cos(angle));
      if (i + 1 < n) out[i + 1] = static_cast<float>(mean + std * radius * std::sin(angle));
    }
  }
}

uint64_t stream_of(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace mt
