// CPU implementations of the quantizer ops: quantize_into, dequantize_sum_into (which is also
// ops.dequantize) and dequantize_sum_requantize_into. Every bit of output comes from
// csrc/numerics.h.
//
// Work is split over blocks with at::parallel_for. Encoding is plain per-element loops over a
// block that gcc vectorizes; decoding works on groups of 8 elements in gcc's vector
// extensions (see Lanes below), because gcc vectorizes no loop that unpacks codes from their
// bits.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../numerics.h"
#include "dispatch.h"

#if DDPCOMM_HAVE_AVX2
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

// Everything below, not the headers above, is compiled for x86-64-v3 in the AVX2 variant
// (avx2/quantize.cpp; see dispatch.h).
#if defined(DDPCOMM_ISA_AVX2)
#pragma GCC target("arch=x86-64-v3")
#endif

// The 32-byte vectors below never cross a call (every helper is inlined, in an anonymous
// namespace), so gcc's note that passing them without AVX changed ABI in gcc 4.6 is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ddpcomm::DDPCOMM_ISA {
namespace {

// Runs task(next) on every thread of the pool (at most one per chunk), where next(b0, b1)
// claims the next chunk of blocks [b0, b1) of [0, nb), or returns false when none is left.
// Chunks of 64K elements are claimed one at a time rather than split in one fixed range per
// thread (at::parallel_for): when another process holds one of the cores, the other thread
// takes over the rest of the work instead of waiting for the held-up one's half.
template <class Task>
void parallel_blocks(int64_t nb, int64_t B, Task&& task) {
  const int64_t chunk = std::max<int64_t>(1, (1 << 16) / B), chunks = (nb + chunk - 1) / chunk;
  std::atomic<int64_t> claimed{0};
  auto next = [&](int64_t& b0, int64_t& b1) {
    const int64_t c = claimed.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return false;
    b0 = c * chunk;
    b1 = std::min(nb, b0 + chunk);
    return true;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { task(next); });
}

// Every loop reads its block's inputs a few times over (magnitude, then codes); from memory,
// the hardware prefetcher alone kept one thread waiting: quantize at 64 MB took 0.63 ns an
// element for q1 and q2 (0.26-0.32 with the prefetches below, the same as from L2). So each
// block first asks for what the block kPrefetchElems elements further on will read.
constexpr int64_t kPrefetchElems = 1024;

int64_t prefetch_ahead(int64_t B) { return std::max<int64_t>(1, kPrefetchElems / B); }

void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

// ---------------------------------------------------------------------------------------
// Lanes: 8 elements in gcc's vector extensions. Each operator is the scalar IEEE (or integer)
// operation applied lane by lane, so a lane computes the bits the scalar code gives; in the
// x86-64-v3 variant each is one AVX2 instruction, in the baseline a pair of SSE2 ones (or
// scalar code where SSE2 has no such instruction, as for per-lane shifts). Written out because
// gcc vectorizes no loop that takes codes out of their bits: it unrolled the 1-bit one into
// scalar code or a 32-wide tangle of vpermd (dequantize_sum q1 at 22-32% of a copy).
// ---------------------------------------------------------------------------------------

// Every helper on vectors is force-inlined: gcc left the 4-bit decode out of line (a call per
// 32 elements, with its vectors spilled around it: dequantize_sum q4 at 0.5 ns an element).
#define LANES_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 8;
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

LANES_INLINE f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

LANES_INLINE void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }

// Float comparisons lane by lane, as 0 / -1 masks. Without AVX gcc makes an 8-lane float
// comparison a scalar compare and set per lane (q1 quantize at 2.2 ns an element on one
// thread, 9x the x86-64-v3 kernels' time), so there each half is one SSE compare.
#if DDPCOMM_HAVE_AVX2
LANES_INLINE i32x8 lt8(f32x8 a, f32x8 b) { return a < b; }
LANES_INLINE i32x8 ne8(f32x8 a, f32x8 b) { return a != b; }
#else
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

// The 8 lanes of two 4-lane halves.
template <class Half>
LANES_INLINE u32x8 join8(Half lo, Half hi) {
  const Half h[2] = {lo, hi};
  u32x8 v;
  std::memcpy(&v, h, sizeof(v));
  return v;
}

template <class Compare>
LANES_INLINE i32x8 by_halves(f32x8 a, f32x8 b, Compare compare) {
  f32x4 ha[2], hb[2];
  std::memcpy(ha, &a, sizeof(a));
  std::memcpy(hb, &b, sizeof(b));
  return (i32x8)join8(compare(ha[0], hb[0]), compare(ha[1], hb[1]));
}
LANES_INLINE i32x8 lt8(f32x8 a, f32x8 b) {
  return by_halves(a, b, [](f32x4 x, f32x4 y) { return x < y; });
}
LANES_INLINE i32x8 ne8(f32x8 a, f32x8 b) {
  return by_halves(a, b, [](f32x4 x, f32x4 y) { return x != y; });
}
#endif
LANES_INLINE i32x8 gt8(f32x8 a, f32x8 b) { return lt8(b, a); }

// canonical() lane by lane.
LANES_INLINE f32x8 canonical8(f32x8 v) {
  const f32x8 nan = (f32x8)((u32x8){} + kCanonicalNanF32);
#if DDPCOMM_HAVE_AVX2
  return ne8(v, v) ? nan : v;
#else
  // Without AVX gcc makes an 8-lane select a test and branch per lane (dequantize_sum q1 at
  // 41 ms for 64 MB on one thread): the lanes are picked with and, andnot and or instead.
  const u32x8 is_nan = (u32x8)ne8(v, v);
  return (f32x8)((is_nan & (u32x8)nan) | (~is_nan & (u32x8)v));
#endif
}

// A block record's magnitude and packed codes.
struct Record {
  float m;
  const uint8_t* codes;
  explicit Record(const uint8_t* r) : codes(r + kScaleBytes) { std::memcpy(&m, r, sizeof(m)); }
};

// Elements per group: every block size (a power of two >= 32) is a whole number of groups,
// so no loop over a block has a remainder to peel, and the codes of a group fill whole
// 32-bit words (4 * kBits bytes).
constexpr int64_t kGroup = 32;
constexpr int kSub = kGroup / kLanes;

#if !DDPCOMM_HAVE_AVX2 && defined(__SSE2__)
// m * v. gcc copies m into the 8 lanes with eight stores and two 16-byte loads, which stall on
// store forwarding (dequantize_sum q2 at 23 ms for 64 MB on one thread, 6x AVX2).
LANES_INLINE f32x8 times8(float m, f32x8 v) {
  const __m128 h = _mm_set1_ps(m);
  return (f32x8)join8(h, h) * v;
}
#else
LANES_INLINE f32x8 times8(float m, f32x8 v) { return m * v; }
#endif

#if !DDPCOMM_HAVE_AVX2 && defined(__SSE2__)
// level_value of each 2- or 4-bit code of a byte, low bits first.
template <int kBits>
alignas(16) constexpr auto kByteLevels = [] {
  constexpr int per_byte = 8 / kBits;
  std::array<std::array<float, per_byte>, 256> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    for (int i = 0; i < per_byte; ++i) {
      t[b][i] = level_value((b >> (kBits * i)) & ((1u << kBits) - 1u), kBits);
    }
  }
  return t;
}();
#endif

// Lane t of 8 unsigned bytes.
LANES_INLINE u32x8 widen8(const uint8_t* p) {
#if DDPCOMM_HAVE_AVX2
  // gcc lowers __builtin_convertvector from 8 bytes to 8 scalar moves and inserts (q8's
  // dequantize_sum at 30% of a copy); vpmovzxbd is one instruction.
  return (u32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE2__)
  // A shift per lane by its own count is scalar code in SSE2 (q8's dequantize_sum at 47 ms
  // for 64 MB on one thread, 10x AVX2): the bytes are unpacked against zero instead.
  const __m128i zero = _mm_setzero_si128();
  const __m128i w16 = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), zero);
  return join8(_mm_unpacklo_epi16(w16, zero), _mm_unpackhi_epi16(w16, zero));
#else
  uint32_t w[2];
  std::memcpy(w, p, sizeof(w));
  const u32x8 word = {w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1]};
  return (word >> (u32x8){0, 8, 16, 24, 0, 8, 16, 24}) & 0xFFu;
#endif
}

// Entry c of the table lo ++ hi, for the code in the low kBits (<= 4) bits of c; the bits above
// are ignored. vpermps looks up the low 3 bits; for 4-bit codes a second one looks up hi and
// bit 3, shifted to the sign, picks between them (gcc's own two-table shuffle masks and
// compares bit 3 first: 2 more instructions per 8 lanes).
template <int kBits>
LANES_INLINE f32x8 lookup16(f32x8 lo, f32x8 hi, u32x8 c) {
  if constexpr (kBits == 2) {
    return __builtin_shuffle(lo, (i32x8)(c & 3u));
  } else {
#if DDPCOMM_HAVE_AVX2
    const __m256 from_lo = _mm256_permutevar8x32_ps((__m256)lo, (__m256i)c);
    const __m256 from_hi = _mm256_permutevar8x32_ps((__m256)hi, (__m256i)c);
    return (f32x8)_mm256_blendv_ps(from_lo, from_hi, (__m256)(c << 28));
#else
    return __builtin_shuffle(lo, hi, (i32x8)c);
#endif
  }
}

// The values of elements kGroup * q .. kGroup * q + 31 of a record, 8 per vector:
// dequantize_one(c, m, level_value(c, kBits), kBits) lane by lane. 1-bit: m or -m, that is
// m with its sign bit flipped where the code is 0 (NaN m included): each lane shifts its bit
// of the group's 32-bit word up to bit 31. 2- and 4-bit: a lane shifts its code out of the
// 32-bit word holding its 8-lane group, and takes level_value from a table of the 4 or 16
// levels (numerics.h's "kernels tabulate it": one or two vpermps where computing it costs a
// divide per element). 8-bit: (c - L) / L, a divide (a 255-entry table needs a gather,
// which measured slower here; so did k * (1/L) corrected by two FMAs, the same bits for all
// 256 codes: dequantize_sum q8 from L2 at 0.27-0.35 ns an element against 0.26).
template <int kBits>
LANES_INLINE void decode_group(const Record& r, int64_t q, f32x8 (&v)[kSub]) {
  const uint8_t* p = r.codes + q * (kGroup * kBits / 8);
  if constexpr (kBits == 1) {
    uint32_t w;
    std::memcpy(&w, p, sizeof(w));
#if !DDPCOMM_HAVE_AVX2 && defined(__SSE2__)
    // A shift per lane by its own count is scalar code in SSE2 (dequantize_sum q1 at 47 ms
    // for 64 MB on one thread, 20x AVX2): each lane tests its bit with an and and a compare.
    // (gcc makes the 8-lane compare scalar too, hence the halves.)
    const __m128i word = _mm_set1_epi32((int)w), m = _mm_set1_epi32((int)float_bits(r.m));
    auto half = [&](int first) {
      const __m128i bit = _mm_slli_epi32(_mm_setr_epi32(1, 2, 4, 8), first);
      const __m128i clear = _mm_cmpeq_epi32(_mm_and_si128(word, bit), _mm_setzero_si128());
      return _mm_xor_si128(m, _mm_and_si128(clear, _mm_set1_epi32((int)0x80000000u)));
    };
    for (int s = 0; s < kSub; ++s) v[s] = (f32x8)join8(half(8 * s), half(8 * s + 4));
#else
    const u32x8 up = {31, 30, 29, 28, 27, 26, 25, 24};
    for (int s = 0; s < kSub; ++s) {
      const u32x8 flip = ~(w << (up - 8 * s)) & 0x80000000u;
      v[s] = (f32x8)(float_bits(r.m) ^ flip);
    }
#endif
  } else if constexpr (kBits == 8) {
    for (int s = 0; s < kSub; ++s) {
      const i32x8 k = (i32x8)widen8(p + kLanes * s) - max_level(kBits);
      v[s] = times8(r.m, __builtin_convertvector(k, f32x8) / (float)max_level(kBits));
    }
  } else {
#if !DDPCOMM_HAVE_AVX2 && defined(__SSE2__)
    // Per-lane shifts and variable shuffles are scalar code in SSE2 (dequantize_sum q4 at
    // 122 ms for 64 MB on one thread, 24x AVX2): each byte of codes loads its levels from a
    // table instead, 4 (2-bit) or 2 (4-bit) lanes at a time.
    auto levels = [](uint8_t b) {
      const float* t = kByteLevels<kBits>[b].data();
      return kBits == 2 ? _mm_castps_si128(_mm_load_ps(t))
                        : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t));
    };
    auto half = [&](const uint8_t* b) {
      return kBits == 2 ? levels(b[0]) : _mm_unpacklo_epi64(levels(b[0]), levels(b[1]));
    };
    for (int s = 0; s < kSub; ++s) {
      const uint8_t* b = p + kBits * s;
      v[s] = times8(r.m, (f32x8)join8(half(b), half(b + kBits / 2)));
    }
#else
    uint32_t w[kBits];
    std::memcpy(w, p, sizeof(w));
    const u32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    f32x8 lo, hi;
    for (int t = 0; t < kLanes; ++t) {
      lo[t] = level_value((uint32_t)t, kBits);
      hi[t] = level_value((uint32_t)t + kLanes, kBits);
    }
    for (int s = 0; s < kSub; ++s) {
      const uint32_t word = w[s * kLanes * kBits / 32];
      const u32x8 c = word >> ((lane + kLanes * s) * kBits % 32);  // code in the low kBits
      v[s] = r.m * lookup16<kBits>(lo, hi, c);
    }
#endif
  }
}

// The same value for one element, in numerics.h's own terms (the partial last group).
template <int kBits>
float code_value(const uint8_t* packed, int64_t j, float m) {
  constexpr int per_byte = 8 / kBits;
  const uint32_t c = (packed[j / per_byte] >> (j % per_byte * kBits)) & ((1u << kBits) - 1u);
  return dequantize_one(c, m, kBits == 1 ? 0.0f : level_value(c, kBits), kBits);
}

// ---------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------

LANES_INLINE u32x8 abs_bits8(f32x8 v) { return (u32x8)v & 0x7FFFFFFFu; }

LANES_INLINE u32x8 max8(u32x8 a, u32x8 b) { return a > b ? a : b; }

LANES_INLINE uint32_t max_lane(u32x8 a) {
  uint32_t m = 0;
  for (int t = 0; t < kLanes; ++t) m = a[t] > m ? a[t] : m;
  return m;
}

LANES_INLINE u32x8 min8(u32x8 a, u32x8 b) { return a < b ? a : b; }

LANES_INLINE uint32_t min_lane(u32x8 a) {
  uint32_t m = 0xFFFFFFFFu;
  for (int t = 0; t < kLanes; ++t) m = a[t] < m ? a[t] : m;
  return m;
}

// The largest |x| of a block, as its bit pattern: for non-negative floats the integer order
// is the float order, and an integer max is exact in any order, so it runs as 4 independent
// maxima of 8 lanes (gcc keeps a float max's NaN semantics without -ffast-math and left the
// old float loop scalar). A value is non-finite exactly when its |x| bits are >= 0x7F800000,
// so the same max says whether the block has one.
uint32_t absmax_bits(const float* e, int64_t B) {
  u32x8 m0 = {}, m1 = {}, m2 = {}, m3 = {};
  for (int64_t j = 0; j < B; j += kGroup) {
    m0 = max8(m0, abs_bits8(load8(e + j)));
    m1 = max8(m1, abs_bits8(load8(e + j + 8)));
    m2 = max8(m2, abs_bits8(load8(e + j + 16)));
    m3 = max8(m3, abs_bits8(load8(e + j + 24)));
  }
  return max_lane(max8(max8(m0, m1), max8(m2, m3)));
}

// numerics.h block_tree_sum of tree[0, w) (w >= 16), 8 lanes at a time down to 8 values,
// then within one vector: lane i adds lane i + 4, i + 2, i + 1. As block_tree_sum's loops,
// with their aliasing checks and scalar tails, the 2-bit magnitude alone took 0.2 ns per
// element. Its stores and reloads cost nothing measurable: the tree kept in registers
// (blocks of 128-512) or two levels added a pass timed the same on q2's quantize and
// q1.5's, from L2 and from memory (the levels run beside the next block's loads).
LANES_INLINE float tree_sum(float* tree, int64_t w) {
  for (w /= 2; w >= kLanes; w /= 2) {
    for (int64_t i = 0; i < w; i += kLanes) store8(tree + i, load8(tree + i) + load8(tree + i + w));
  }
  const f32x8 a = load8(tree);
  const f32x8 a4 = a + __builtin_shuffle(a, (i32x8){4, 5, 6, 7, 4, 5, 6, 7});
  const f32x8 a2 = a4 + __builtin_shuffle(a4, (i32x8){2, 3, 2, 3, 2, 3, 2, 3});
  return a2[0] + a2[1];
}

// block_tree_sum of |e| over the block (the pairs of numerics.h, added in the same order), and
// the largest |x| bits, in one pass over e: level B/2 adds |e[i]| + |e[i + B/2]| as it takes
// |x|, the rest is tree_sum.
float abs_tree_sum(const float* e, int64_t B, float* tree, uint32_t* mbits) {
  const int64_t half = B / 2;
  u32x8 m0 = {}, m1 = {};
  for (int64_t i = 0; i < half; i += kLanes) {
    const u32x8 a = abs_bits8(load8(e + i)), b = abs_bits8(load8(e + i + half));
    m0 = max8(m0, a);
    m1 = max8(m1, b);
    store8(tree + i, (f32x8)a + (f32x8)b);
  }
  *mbits = max_lane(max8(m0, m1));
  return tree_sum(tree, half);
}

// The magnitude m a block record stores (numerics.h), NaN for a block with a non-finite
// value.
template <int kBits, bool kStochastic>
float block_magnitude(const float* e, int64_t valid, int64_t B, float* tree) {
  if (uses_mean(kBits, kStochastic)) {
    uint32_t mbits;
    const float sum = abs_tree_sum(e, B, tree, &mbits);
    if (mbits >= 0x7F800000u) return canonical_nan();
    return mean_magnitude(kBits, bits_float(mbits), sum, valid);
  } else {
    const uint32_t mbits = absmax_bits(e, B);
    return mbits >= 0x7F800000u ? canonical_nan() : bits_float(mbits);
  }
}

// Codes of B values, one per byte, kGroup at a time (a fixed-length inner loop that gcc
// vectorizes whole: no aliasing check, no remainder). pre is a compile-time 1 for every
// block but the tiny-magnitude ones, so x * pre folds away (x is finite here: a block with
// a non-finite value is degenerate).
template <int kBits, bool kStochastic>
void block_codes(const float* __restrict e, int64_t B, float m, uint64_t key, int64_t index0,
                 uint8_t* __restrict codes) {
  if (block_is_degenerate(m)) {
    const uint8_t code = (uint8_t)degenerate_code(kBits);
    for (int64_t j = 0; j < B; ++j) codes[j] = code;
    return;
  }
  const BlockInv inv = block_inv(m, kBits);
  auto encode = [&](BlockInv bi) {
    for (int64_t j0 = 0; j0 < B; j0 += kGroup) {
      for (int64_t t = 0; t < kGroup; ++t) {
        const int64_t j = j0 + t;
        const float u = kStochastic ? uniform24(rng_u64_keyed(key, index0 + j)) : 0.0f;
        codes[j] = (uint8_t)quantize_one(e[j], bi, kBits, kStochastic, u);
      }
    }
  };
  if (inv.pre == 1.0f) {
    encode(BlockInv{inv.inv, 1.0f});
  } else {
    encode(inv);
  }
}

// Packs B codes (one per byte, each < 2^kBits) LSB-first: the 8 / kBits code bytes of one
// output byte are read as one little-endian word and shifted onto each other (bits that land
// above the byte are dropped), a loop over whole words that vectorizes. 1-bit codes are
// gathered by a multiply: byte t's bit lands at bit 56 + t, and no two partial products
// overlap, so nothing carries.
template <int kBits>
void pack_codes(const uint8_t* codes, int64_t B, uint8_t* out) {
  constexpr int per_byte = 8 / kBits;
  for (int64_t k = 0; k < B / per_byte; ++k) {
    if constexpr (kBits == 4) {
      uint16_t w;
      std::memcpy(&w, codes + 2 * k, sizeof(w));
      out[k] = (uint8_t)(w | (w >> 4));
    } else if constexpr (kBits == 2) {
      uint32_t w;
      std::memcpy(&w, codes + 4 * k, sizeof(w));
      out[k] = (uint8_t)(w | (w >> 6) | (w >> 12) | (w >> 18));
    } else {
      uint64_t w;
      std::memcpy(&w, codes + 8 * k, sizeof(w));
      out[k] = (uint8_t)((w * 0x0102040810204080ull) >> 56);
    }
  }
}

// Bit t set where lane t of a comparison's result is true (all ones).
LANES_INLINE uint32_t lane_mask(i32x8 c) {
#if DDPCOMM_HAVE_AVX2
  return (uint32_t)_mm256_movemask_ps((__m256)c);
#elif defined(__SSE2__)
  __m128 half[2];
  std::memcpy(half, &c, sizeof(half));
  return (uint32_t)(_mm_movemask_ps(half[0]) | _mm_movemask_ps(half[1]) << 4);
#else
  uint32_t m = 0;
  for (int t = 0; t < kLanes; ++t) m |= (uint32_t)(c[t] != 0) << t;
  return m;
#endif
}

#if !DDPCOMM_HAVE_AVX2
// Bit t of an 8-bit mask moved to bit 2t of 16 (the 2-bit codes without AVX2).
constexpr std::array<uint16_t, 256> kSpread = [] {
  std::array<uint16_t, 256> t{};
  for (int v = 0; v < 256; ++v) {
    for (int b = 0; b < 8; ++b) t[v] |= (uint16_t)(((v >> b) & 1) << (2 * b));
  }
  return t;
}();
#endif

// The packed codes of deterministic 1- and 2-bit blocks (finite m > 0, pre = 1), straight
// from comparisons: lane masks are the code bits, with no code bytes to pack (64 MB, in
// runs taking turns with the byte codes: quantize q1 5.18 -> 4.02 ms on one thread, 2.73 ->
// 2.32 on two; q2 6.20 -> 5.16 and 3.54 -> 2.84). 1-bit: code 1 where x >= 0, that is where x
// < 0 is false (x is finite). 2-bit: round_even(v) clamped to [-1, 1], v = x * inv, is +1
// exactly where v > 0.5 and -1 where v < -0.5 (0.5 itself rounds to even 0): codes 2 (bits
// 10), 0 (00) and 1 (01) between.
template <int kBits>
void mask_codes(const float* __restrict e, int64_t B, float inv, uint8_t* __restrict out) {
  if constexpr (kBits == 1) {
    for (int64_t j = 0; j < B; j += kGroup) {
      uint32_t neg = 0;
      for (int s = 0; s < kSub; ++s)
        neg |= lane_mask(lt8(load8(e + j + kLanes * s), f32x8{})) << (8 * s);
      const uint32_t w = ~neg;
      std::memcpy(out + j / 8, &w, sizeof(w));
    }
  } else {
#if DDPCOMM_HAVE_AVX2
    // Codes as 32-bit lanes (1 - [v > 0.5] + [v < -0.5], the masks being -1), narrowed to
    // bytes, then multiply-added pairwise into 4-bit and 8-bit fields: half the instructions
    // of the masks and table below, which took 6.2 ms for a 64 MB quantize on one thread
    // against 4.3 (same hour, not in turns).
    for (int64_t j = 0; j < B; j += kGroup) {
      __m256i c[kSub];
      for (int s = 0; s < kSub; ++s) {
        const f32x8 v = load8(e + j + kLanes * s) * inv;
        c[s] = (__m256i)(1 - (v > 0.5f) + (v < -0.5f));
      }
      // Byte t of 128-bit half h: the code of element 8 * (t / 4) + 4 * h + t % 4.
      const __m256i bytes =
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      const __m256i nibbles = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401));
      const __m256i fours = _mm256_madd_epi16(nibbles, _mm256_set1_epi32(0x00100001));
      // The low byte of each 32-bit lane (4 elements' codes), then the halves interleaved.
      const __m256i low = _mm256_shuffle_epi8(
          fours, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4,
                                  8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
      const __m128i w =
          _mm_unpacklo_epi8(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j / 4), w);
    }
#else
    for (int64_t j = 0; j < B; j += kLanes) {
      const f32x8 v = load8(e + j) * inv;
      const uint32_t pos = lane_mask(gt8(v, (f32x8){} + 0.5f));
      const uint32_t neg = lane_mask(lt8(v, (f32x8){} - 0.5f));
      const uint16_t w = (uint16_t)(kSpread[~(pos | neg) & 0xFFu] | kSpread[pos] << 1);
      std::memcpy(out + j / 4, &w, sizeof(w));
    }
#endif
  }
}

#if DDPCOMM_HAVE_AVX2
// The packed codes of deterministic 4- and 8-bit blocks (finite m = max |x| > 0, pre = 1):
// round_even(v) + L, v = x * inv, in 32-element groups. |x| <= m gives |v| <= L (1 + 2^-23)
// < L + 1/2 (inv = L / m rounded, then the product rounded), so round_even(v) is already
// in [-L, L]: no clamp, and the signed saturating packs to bytes never saturate. vroundps
// rounds half to even as numerics.h round_even does for |v| < 2^22. The packs leave byte t
// of 128-bit half h holding element 8 (t / 4) + 4 h + t % 4 (as in mask_codes): one vpermd
// puts 8-bit codes in element order; 4-bit codes pair up adjacent bytes (elements 2i, 2i + 1)
// in a multiply-add, and their words interleave the halves into element order. Against
// the byte codes, clamps and pack pass (1 MiB from L2, one thread, builds taking turns):
// quantize q8 55-76 -> 38-48 us, q4 62 -> 42-52, with error feedback q8 119-162 -> 101-128.
template <int kBits>
void round_codes(const float* __restrict e, int64_t B, float inv, uint8_t* __restrict out) {
  constexpr int L = max_level(kBits);
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < B; j += kGroup) {
    __m256i k[kSub];
    for (int s = 0; s < kSub; ++s) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(e + j + kLanes * s), scale);
      k[s] = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m256i codes = _mm256_add_epi8(
        _mm256_packs_epi16(_mm256_packs_epi32(k[0], k[1]), _mm256_packs_epi32(k[2], k[3])),
        _mm256_set1_epi8((char)L));
    if constexpr (kBits == 8) {
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                          _mm256_permutevar8x32_epi32(codes, order));
    } else {
      const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x1001));
      const __m256i bytes = _mm256_packus_epi16(pairs, pairs);
      const __m128i w =
          _mm_unpacklo_epi16(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j / 2), w);
    }
  }
}
#endif

// Writes the record of one block `e` (B values, zero past the valid ones) of magnitude m.
// 8-bit codes go straight into the record, narrower ones through `codes` (B bytes).
template <int kBits, bool kStochastic>
void write_record(const float* e, int64_t B, float m, uint64_t key, int64_t index0, uint8_t* record,
                  uint8_t* codes) {
  std::memcpy(record, &m, sizeof(float));
  uint8_t* out = record + kScaleBytes;
  // Deterministic blocks of ordinary magnitude pack their codes as they form them: 1 and 2
  // bits from comparisons, 4 and 8 bits (x86-64-v3) from rounding in registers.
  constexpr bool kDirect = !kStochastic && (kBits <= 2 || (DDPCOMM_HAVE_AVX2 && kBits >= 4));
  if constexpr (kDirect) {
    if (!block_is_degenerate(m)) {
      if (const BlockInv inv = block_inv(m, kBits); inv.pre == 1.0f) {
        if constexpr (kBits <= 2) {
          mask_codes<kBits>(e, B, inv.inv, out);
        } else {
#if DDPCOMM_HAVE_AVX2
          round_codes<kBits>(e, B, inv.inv, out);
#endif
        }
        return;
      }
    }
  }
  block_codes<kBits, kStochastic>(e, B, m, key, index0, kBits == 8 ? out : codes);
  if (kBits != 8) pack_codes<kBits>(codes, B, out);
}

// ---------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------

// x / divisor, as a multiply by 1 / divisor when the divisor is a power of two: both are the
// correctly rounded x * 2^-k, so the bits agree, and a divide per element costs more.
struct Divide {
  float div, inv;
  bool pow2;
  explicit Divide(int64_t divisor)
      : div((float)divisor), inv(1.0f / (float)divisor), pow2((divisor & (divisor - 1)) == 0) {}
  float operator()(float x) const { return pow2 ? x * inv : x / div; }
  f32x8 operator()(f32x8 x) const { return pow2 ? x * inv : x / div; }
};

// What sum_rows writes for each element's row sum a.
enum class SumTo {
  kResult,   // dst = canonical(a / divisor): the fp32 result of dequantize_sum
  kScaled,   // dst = the same times res[j] (a scale), canonical again
  kSum,      // dst = a, for another result dtype to convert
  kRequant,  // dst = S = a (+ res), e = S / divisor: requantize's sum and the values it encodes
};

// Writes what kTo says for the row sums a of elements j .. j + 7 (finish8) or of element j
// (finish1). `res` is the block's residual (kRequant) or its scale (kScaled).
template <SumTo kTo>
LANES_INLINE void finish8(f32x8 a, int64_t j, const Divide& d, const float* res, float* dst,
                          float* e) {
  if constexpr (kTo == SumTo::kResult) {
    store8(dst + j, canonical8(d(a)));
  } else if constexpr (kTo == SumTo::kScaled) {
    store8(dst + j, canonical8(canonical8(d(a)) * load8(res + j)));
  } else if constexpr (kTo == SumTo::kSum) {
    store8(dst + j, a);
  } else {
    const f32x8 S = res != nullptr ? a + load8(res + j) : a;
    store8(dst + j, S);
    store8(e + j, d(S));
  }
}

template <SumTo kTo>
LANES_INLINE void finish1(float a, int64_t j, const Divide& d, const float* res, float* dst,
                          float* e) {
  if constexpr (kTo == SumTo::kResult) {
    dst[j] = canonical(d(a));
  } else if constexpr (kTo == SumTo::kScaled) {
    dst[j] = canonical(canonical(d(a)) * res[j]);
  } else if constexpr (kTo == SumTo::kSum) {
    dst[j] = a;
  } else {
    dst[j] = res != nullptr ? a + res[j] : a;
    e[j] = d(dst[j]);
  }
}

// Sums element j of block `blk` of every payload row in row order in fp32, from 0 (so a lone
// -0 reads +0), for j < valid, and writes what kTo says. A group's sums stay in registers
// across the rows, and requantize's residual add and divide ride on the same pass (as
// separate loops over the block they cost it 0.05 ns an element).
template <int kBits, SumTo kTo>
void sum_rows(const uint8_t* in, int64_t rows, int64_t row_bytes, int64_t blk, int64_t rec,
              int64_t valid, const Divide& divide, const float* res, float* dst, float* e) {
  const Divide d = divide;  // a local copy: the stores to dst cannot change it
  const uint8_t* first = in + blk * rec;
  const int64_t groups = valid / kGroup;
  for (int64_t q = 0; q < groups; ++q) {
    f32x8 a[kSub], v[kSub];
    decode_group<kBits>(Record(first), q, v);
    for (int s = 0; s < kSub; ++s) a[s] = 0.0f + v[s];
    for (int64_t r = 1; r < rows; ++r) {
      decode_group<kBits>(Record(first + r * row_bytes), q, v);
      for (int s = 0; s < kSub; ++s) a[s] = a[s] + v[s];
    }
    for (int s = 0; s < kSub; ++s) finish8<kTo>(a[s], kGroup * q + kLanes * s, d, res, dst, e);
  }
  for (int64_t j = groups * kGroup; j < valid; ++j) {
    float a = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const Record rr(first + r * row_bytes);
      a = a + code_value<kBits>(rr.codes, j, rr.m);
    }
    finish1<kTo>(a, j, d, res, dst, e);
  }
}

#include "sparse_code.h"

using SumRowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           const Divide&, const float*, float*, float*);

SumRowsFn pick_sum_rows(int bits, SumTo to) {
  if (bits == kSparseBits) {
    switch (to) {
      case SumTo::kResult:
        return &sparse_sum_rows<SumTo::kResult>;
      case SumTo::kScaled:
        return &sparse_sum_rows<SumTo::kScaled>;
      case SumTo::kSum:
        return &sparse_sum_rows<SumTo::kSum>;
      default:
        return &sparse_sum_rows<SumTo::kRequant>;
    }
  }
  return with_bits(bits, [&](auto b) -> SumRowsFn {
    constexpr int kBits = decltype(b)::value;
    switch (to) {
      case SumTo::kResult:
        return &sum_rows<kBits, SumTo::kResult>;
      case SumTo::kScaled:
        return &sum_rows<kBits, SumTo::kScaled>;
      case SumTo::kSum:
        return &sum_rows<kBits, SumTo::kSum>;
      default:
        return &sum_rows<kBits, SumTo::kRequant>;
    }
  });
}

// Error feedback after encoding: res[j] = canonical(s[j] - scale * deq[j]), deq[j] the value
// element j of `record` decodes to (scale is 1, or the divisor of the requantize step).
template <int kBits>
void update_residual(const uint8_t* record, const float* s, float scale, int64_t valid,
                     float* res) {
  const Record rec(record);
  const int64_t groups = valid / kGroup;
  for (int64_t q = 0; q < groups; ++q) {
    f32x8 deq[kSub];
    decode_group<kBits>(rec, q, deq);
    for (int i = 0; i < kSub; ++i) {
      const int64_t j = kGroup * q + kLanes * i;
      const f32x8 sj = load8(s + j);
      store8(res + j, canonical8(scale == 1.0f ? sj - deq[i] : sj - scale * deq[i]));
    }
  }
  for (int64_t j = groups * kGroup; j < valid; ++j) {
    const float deq = code_value<kBits>(rec.codes, j, rec.m);
    res[j] = canonical(scale == 1.0f ? s[j] - deq : s[j] - scale * deq);
  }
}

// Per-task scratch: two staged blocks (and for requantize their sums), a tree-sum buffer,
// codes, and the keys q1.5's cap search packs.
struct Scratch {
  std::vector<float> e[2], sum[2], tree;
  std::vector<uint8_t> codes;
  std::vector<uint32_t> band;
  Scratch(int64_t B, bool sums)
      : e{std::vector<float>(B), std::vector<float>(B)}, tree(B), codes(B), band(B) {
    if (sums) sum[0].resize(B), sum[1].resize(B);
  }
};

template <int kBits, bool kStochastic>
void write_block(const float* e, int64_t B, int64_t, float m, uint64_t key, int64_t index0,
                 uint8_t* record, Scratch& s) {
  write_record<kBits, kStochastic>(e, B, m, key, index0, record, s.codes.data());
}

template <int kBits>
void block_residual(const uint8_t* record, int64_t, const float* s, float scale, int64_t valid,
                    float* res) {
  update_residual<kBits>(record, s, scale, valid, res);
}

// q1.5 decides its magnitude and codes together, in its write step.
float no_magnitude(const float*, int64_t, int64_t, float*) { return 0.0f; }

void write_sparse(const float* e, int64_t B, int64_t valid, float, uint64_t, int64_t,
                  uint8_t* record, Scratch& s) {
  sparse_write(e, B, valid, record, s.tree.data(), s.band.data());
}

// The steps of encoding a block, for the bit width and rounding picked at launch.
struct Encoder {
  float (*magnitude)(const float* e, int64_t valid, int64_t B, float* tree);
  void (*write)(const float* e, int64_t B, int64_t valid, float m, uint64_t key, int64_t index0,
                uint8_t* record, Scratch& s);
  void (*residual)(const uint8_t* record, int64_t B, const float* s, float scale, int64_t valid,
                   float* res);

  Encoder(int bits, bool stochastic) {
    if (bits == kSparseBits) {
      magnitude = &no_magnitude;
      write = &write_sparse;
      residual = &sparse_residual;
      return;
    }
    with_bits(bits, [&](auto b) {
      constexpr int kBits = decltype(b)::value;
      magnitude = stochastic ? &block_magnitude<kBits, true> : &block_magnitude<kBits, false>;
      write = stochastic ? &write_block<kBits, true> : &write_block<kBits, false>;
      residual = &block_residual<kBits>;
    });
  }
};

// Encodes blocks [b0, b1) of n values into `out`. stage(blk, slot) returns block blk's B values
// (zero past its valid ones): in place, or staged in scratch slot `slot`; done(blk, slot, e,
// record) runs once the block's record is written. Block blk + 1 is staged and its magnitude
// taken before block blk's codes are written, so that the magnitude's chain of dependent
// steps (a max or tree-sum reduction, then divides) runs alongside the codes loop instead of
// stalling it: 20 ns a block at B = 256 for 2-bit codes, a fifth of the time of encoding it.
template <class Stage, class Done>
void encode_blocks(const Encoder& enc, int64_t b0, int64_t b1, int64_t B, int64_t n, uint8_t* out,
                   int64_t rec, uint64_t key, int64_t rng_offset, Scratch& s, Stage&& stage,
                   Done&& done) {
  auto valid = [&](int64_t blk) { return std::min(B, n - blk * B); };
  const float* e = stage(b0, 0);
  float m = enc.magnitude(e, valid(b0), B, s.tree.data());
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int slot = (int)((blk - b0) & 1);
    const float* e_next = nullptr;
    float m_next = 0.0f;
    if (blk + 1 < b1) {
      e_next = stage(blk + 1, 1 - slot);
      m_next = enc.magnitude(e_next, valid(blk + 1), B, s.tree.data());
    }
    uint8_t* record = out + blk * rec;
    enc.write(e, B, valid(blk), m, key, rng_offset + blk * B, record, s);
    done(blk, slot, e, record);
    e = e_next;
    m = m_next;
  }
}

// normalize's division on the way in (scale_quantize_into): y = x / scale, after the average
// of squares takes x, in the arithmetic of the scale_down reference (its fma is torch's
// addcmul_ on a CPU with FMA; the baseline's libm fma has the same bits).
struct Scaling {
  const float* scale;
  float* average;  // or null
  float keep, take;
};

// quantize_into, and with a Scaling scale_quantize_into: each block is staged as y (+ the
// residual) in the same pass that reads x, so the bucket is not written and read back.
void quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                  const at::Tensor& packed, int64_t bits, int64_t block_size, bool stochastic,
                  int64_t seed, int64_t step, int64_t rng_offset, const Scaling* scaling) {
  const int64_t n = x.numel();
  const at::Tensor xc = x.contiguous();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t B = block_size, nb = num_blocks(n, B), rec = record_bytes(B, (int)bits);
  const Encoder enc((int)bits, stochastic);
  const uint64_t key = rng_key((uint64_t)seed, (uint64_t)step);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    parallel_blocks(nb, B, [&](auto&& next) {
      Scratch s(B, false);
      const int64_t ahead = prefetch_ahead(B);
      const bool tree_first = uses_mean((int)bits, stochastic);
      auto stage = [&](int64_t blk, int slot) -> const float* {
        const int64_t start = blk * B, valid = std::min(B, n - start);
        if (std::is_same_v<scalar_t, float> && res == nullptr && scaling == nullptr && valid == B) {
          // A full fp32 block is read in place (staging it too timed the same). Staging is
          // one streaming pass that the hardware prefetcher keeps up with (quantize_ef lost
          // 15% of a copy to prefetches).
          if (tree_first && blk + ahead < nb)
            prefetch(xp + (blk + ahead) * B, B * (int64_t)sizeof(float));
          return reinterpret_cast<const float*>(xp + start);
        }
        float* e = s.e[slot].data();
        if (scaling != nullptr) {
          const float* sp = scaling->scale + start;
          float* ap = scaling->average != nullptr ? scaling->average + start : nullptr;
          if (ap != nullptr) {
            for (int64_t j = 0; j < valid; ++j) {
              const float v = static_cast<float>(xp[start + j]);
              ap[j] = std::fma(scaling->take * v, v, ap[j] * scaling->keep);
            }
          }
          for (int64_t j = 0; j < valid; ++j) {
            e[j] = static_cast<float>(
                static_cast<scalar_t>(static_cast<float>(xp[start + j]) / sp[j]));
          }
        } else {
          for (int64_t j = 0; j < valid; ++j) e[j] = static_cast<float>(xp[start + j]);
        }
        if (res != nullptr) {
          for (int64_t j = 0; j < valid; ++j) e[j] = e[j] + res[start + j];
        }
        std::fill(e + valid, e + B, 0.0f);
        return e;
      };
      auto done = [&](int64_t blk, int, const float* e, const uint8_t* record) {
        const int64_t start = blk * B;
        if (res != nullptr) enc.residual(record, B, e, 1.0f, std::min(B, n - start), res + start);
      };
      for (int64_t b0, b1; next(b0, b1);) {
        encode_blocks(enc, b0, b1, B, n, out, rec, key, rng_offset, s, stage, done);
      }
    });
  });
}

void quantize_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                       const at::Tensor& packed, int64_t bits, int64_t block_size, bool stochastic,
                       int64_t seed, int64_t step, int64_t rng_offset) {
  check_quantize(x, residual, packed, bits, block_size);
  check_rounding(bits, stochastic, "quantize_into");
  quantize_cpu(x, residual, packed, bits, block_size, stochastic, seed, step, rng_offset, nullptr);
}

void scale_quantize_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& average,
                             const at::Tensor& scale, double beta,
                             const std::optional<at::Tensor>& residual, const at::Tensor& packed,
                             int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
                             int64_t step, int64_t rng_offset) {
  check_scale_quantize(x, average, scale, beta, residual, packed, bits, block_size);
  check_rounding(bits, stochastic, "scale_quantize_into");
  if (x.scalar_type() != at::kFloat) {  // torch's mixed-dtype addcmul_ sets those bits
    return scale_quantize_aten(x, average, scale, beta, residual, packed, bits, block_size,
                               stochastic, seed, step, rng_offset);
  }
  const Scaling scaling{scale.data_ptr<float>(), average ? average->data_ptr<float>() : nullptr,
                        (float)beta, (float)(1.0 - beta)};
  quantize_cpu(x, residual, packed, bits, block_size, stochastic, seed, step, rng_offset, &scaling);
}

void dequantize_sum_into_cpu(const at::Tensor& payloads, const at::Tensor& result, int64_t bits,
                             int64_t block_size, int64_t divisor,
                             const std::optional<at::Tensor>& scale) {
  check_dequantize_sum(payloads, result, bits, block_size, divisor, scale);
  const int64_t numel = result.numel();
  const at::ScalarType dtype = result.scalar_type();
  const at::Tensor pc = payloads.contiguous();
  const int64_t B = block_size, nb = num_blocks(numel, B), rec = record_bytes(B, (int)bits);
  const int64_t rows = pc.size(0), row_bytes = pc.size(1);
  const uint8_t* in = pc.data_ptr<uint8_t>();
  const float* sc = scale ? scale->data_ptr<float>() : nullptr;
  const Divide d(divisor);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dequantize_sum", [&] {
    constexpr bool kFloat = std::is_same_v<scalar_t, float>;
    const SumTo to = !kFloat ? SumTo::kSum : sc != nullptr ? SumTo::kScaled : SumTo::kResult;
    const SumRowsFn sum_rows = pick_sum_rows((int)bits, to);
    scalar_t* op = result.data_ptr<scalar_t>();
    parallel_blocks(nb, B, [&](auto&& next) {
      std::vector<float> acc(kFloat ? 0 : B);
      for (int64_t b0, b1; next(b0, b1);) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t start = blk * B, valid = std::min(B, numel - start);
          const float* s = sc != nullptr ? sc + start : nullptr;
          if (kFloat) {
            float* o = reinterpret_cast<float*>(op + start);
            sum_rows(in, rows, row_bytes, blk, rec, valid, d, s, o, nullptr);
          } else {
            sum_rows(in, rows, row_bytes, blk, rec, valid, d, nullptr, acc.data(), nullptr);
            for (int64_t j = 0; j < valid; ++j) {
              const scalar_t v = static_cast<scalar_t>(canonical(d(acc[j])));
              // Rounded to the dtype, then scaled in fp32 and rounded again, as mul_ would.
              op[start + j] =
                  s != nullptr ? static_cast<scalar_t>(canonical(static_cast<float>(v) * s[j])) : v;
            }
          }
        }
      }
    });
  });
}

void dequantize_sum_requantize_into_cpu(const at::Tensor& payloads,
                                        const std::optional<at::Tensor>& residual,
                                        const at::Tensor& packed, int64_t numel, int64_t bits,
                                        int64_t block_size, int64_t divisor, bool stochastic,
                                        int64_t seed, int64_t step, int64_t rng_offset) {
  check_dequantize_sum_requantize(payloads, residual, packed, numel, bits, block_size, divisor);
  check_rounding(bits, stochastic, "dequantize_sum_requantize_into");
  const at::Tensor pc = payloads.contiguous();
  const int64_t B = block_size, nb = num_blocks(numel, B), rec = record_bytes(B, (int)bits);
  const int64_t rows = pc.size(0), row_bytes = pc.size(1);
  const uint8_t* in = pc.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  const Encoder enc((int)bits, stochastic);
  const uint64_t key = rng_key((uint64_t)seed, (uint64_t)step);
  const Divide d(divisor);
  const SumRowsFn sum_rows = pick_sum_rows((int)bits, SumTo::kRequant);
  parallel_blocks(nb, B, [&](auto&& next) {
    Scratch s(B, true);
    // S = the row sum + residual (kept for the residual update), e = S / divisor.
    auto stage = [&](int64_t blk, int slot) -> const float* {
      const int64_t start = blk * B, valid = std::min(B, numel - start);
      float* S = s.sum[slot].data();
      float* e = s.e[slot].data();
      sum_rows(in, rows, row_bytes, blk, rec, valid, d, res ? res + start : nullptr, S, e);
      std::fill(e + valid, e + B, 0.0f);
      return e;
    };
    auto done = [&](int64_t blk, int slot, const float*, const uint8_t* record) {
      const int64_t start = blk * B;
      if (res != nullptr) {
        enc.residual(record, B, s.sum[slot].data(), d.div, std::min(B, numel - start), res + start);
      }
    };
    for (int64_t b0, b1; next(b0, b1);) {
      encode_blocks(enc, b0, b1, B, numel, out, rec, key, rng_offset, s, stage, done);
    }
  });
}

}  // namespace

void register_quantize(torch::Library& m) {
  m.impl("quantize_into", &quantize_into_cpu);
  m.impl("scale_quantize_into", &scale_quantize_into_cpu);
  m.impl("dequantize_sum_into", &dequantize_sum_into_cpu);
  m.impl("dequantize_sum_requantize_into", &dequantize_sum_requantize_into_cpu);
}

}  // namespace ddpcomm::DDPCOMM_ISA
