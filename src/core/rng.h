// Philox4x32-10, the counter-based generator cuRAND and the frameworks use.
//
// A value depends only on (seed, stream, index), never on call order or thread
// count, so random initialisation is identical on any mesh and any device: a
// parameter's stream is derived from its name, element i draws from counter i / 4.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace mt {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Element i of [0, n): uniform in (0, 1] or standard normal (Box-Muller), scaled.
void fill_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, float lo, float hi);
void fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, float mean, float std);

// A stable 64-bit stream id for a name (FNV-1a), e.g. a parameter's HF key.
uint64_t stream_of(std::string_view name);

}  // namespace mt
