// Tables indexed by an 8-lane mask (bit t: lane t), for the AVX2 kernels: top-k's and q1.5's
// compaction of the lanes a mask keeps, and q1.5's sign bits where the CPU runs pdep as
// microcode (sparse_code.h). Included inside a variant's namespace (dispatch.h) where
// DDPCOMM_HAVE_AVX2. Built at compile time: a constructor run at load would be AVX2 code run
// on every CPU.
#pragma once

// Bytes, widened to lanes as they are loaded (vpmovzxbd): 4 KB in all. With 32-bit entries
// (16 KB, half of a Zen 4 core's L1 cache) q1.5's encode with error feedback, whose blocks
// stream through that cache, measured slower: its staging waited longer on memory.
struct LaneTables {
  // The lanes whose bit is set, packed to the front in lane order (then zeros): the
  // permutation that compacts one 8-lane vector with vpermd.
  alignas(8) uint8_t compact[256][8];
  // For each lane, how many set bits precede it: a set lane's place among the mask's.
  alignas(8) uint8_t rank[256][8];

  constexpr LaneTables() : compact{}, rank{} {
    for (int mask = 0; mask < 256; ++mask) {
      int m = 0;
      for (int lane = 0; lane < 8; ++lane) {
        rank[mask][lane] = (uint8_t)m;
        if (mask & (1 << lane)) compact[mask][m++] = (uint8_t)lane;
      }
    }
  }
};
constexpr LaneTables kLaneTables;

// Row `mask` of a table, one lane per byte.
inline __m256i lane_row(const uint8_t (&table)[256][8], uint32_t mask) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(table[mask])));
}
