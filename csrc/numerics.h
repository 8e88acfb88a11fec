// Host + device math shared by every ddpcomm kernel.
//
// Everything that decides a bit of output (block magnitudes, code maps, rounding, the
// counter-based RNG) lives here as inline functions, so the CPU and CUDA kernels produce
// bitwise identical payloads. ddpcomm/reference.py restates the same math in torch.
//
// Floating point here must not be contracted into FMAs: the CPU build passes
// -ffp-contract=off and the CUDA build --fmad=false.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#if defined(__CUDACC__)
#define DDPC_HD __host__ __device__ __forceinline__
#else
#define DDPC_HD inline
#endif

namespace ddpcomm {

DDPC_HD uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}

DDPC_HD float bits_float(uint32_t u) {
  float v;
  memcpy(&v, &u, sizeof(v));
  return v;
}

// ---------------------------------------------------------------------------------------
// Canonical NaN. IEEE 754 leaves a NaN result's sign and payload to the hardware: an x86 core
// returns an operand's NaN (any payload, quieted) and makes 0xFFC00000 for Inf - Inf or
// 0 * Inf, a GPU returns 0x7FFFFFFF, and float -> half conversions pass payloads on or not.
// So every float a kernel computes and stores goes through canonical(), on CPU and GPU alike,
// and a NaN is written as one bit pattern per dtype: the quiet NaN of std::numeric_limits<T>
// for T = float, c10::Half, c10::BFloat16 -- exactly what c10's conversions on the CPU make
// of the canonical float NaN. Values are canonicalized where they are formed (e = x + r) and
// before every store.
// ---------------------------------------------------------------------------------------

constexpr uint32_t kCanonicalNanF32 = 0x7FC00000u;
constexpr uint16_t kCanonicalNanF16 = 0x7E00u;
constexpr uint16_t kCanonicalNanBF16 = 0x7FC0u;

DDPC_HD bool is_nan(float v) { return v != v; }

DDPC_HD float canonical_nan() { return bits_float(kCanonicalNanF32); }

DDPC_HD float canonical(float v) { return is_nan(v) ? canonical_nan() : v; }

// ---------------------------------------------------------------------------------------
// Packed quantized payload layout (little-endian), for `numel` elements, bits b, block B:
//
//   nblocks = ceil(numel / B); every block is one record of (4 + B*b/8) bytes:
//     [ float32 m (block magnitude, below) ][ B*b/8 code bytes ]
//   Codes are packed LSB-first: element j of the block sits in byte (j*b)/8 at bit
//   offset (j*b)%8. Elements past `numel` in the last block are encoded as zero.
//
// Because records are per block, a block-aligned slice of a tensor quantizes to a
// contiguous slice of the payload; the two-phase all-reduce relies on this.
// ---------------------------------------------------------------------------------------

constexpr int kScaleBytes = 4;

DDPC_HD int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

// The ops' bits argument names the 1.5-bit code (q1.5, below) by 3: its records hold 3/16
// of a byte per element. No 3-bit code exists.
constexpr int kSparseBits = 3;

DDPC_HD int64_t code_bytes_per_block(int64_t block, int bits) {
  return bits == kSparseBits ? block * 3 / 16 : block * bits / 8;
}

// q1.5's records carry their magnitude as bfloat16 (sparse_m_bits, below).
constexpr int kSparseScaleBytes = 2;

DDPC_HD int64_t record_bytes(int64_t block, int bits) {
  return (bits == kSparseBits ? kSparseScaleBytes : kScaleBytes) +
         code_bytes_per_block(block, bits);
}

DDPC_HD int64_t payload_bytes(int64_t numel, int64_t block, int bits) {
  return num_blocks(numel, block) * record_bytes(block, bits);
}

// Calls f(std::integral_constant<int, b>{}) for bits b in {1, 2, 4, 8} (the caller has
// checked bits): the one switch that turns a runtime bit width into the template argument
// of a kernel, on CPU and CUDA alike. Host code only.
template <class F>
decltype(auto) with_bits(int bits, F&& f) {
  switch (bits) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

// Largest code magnitude of the symmetric b-bit quantizer (b >= 2): codes lie in
// [-L, L] and are stored as code + L. q8: 127, q4: 7, q2: 1 (ternary).
constexpr DDPC_HD int max_level(int bits) { return (1 << (bits - 1)) - 1; }

DDPC_HD bool is_finite(float x) { return x - x == 0.0f; }

// 1 for Inf and NaN (exponent all ones), else 0: an integer test, for OR-reductions that
// compilers vectorize.
DDPC_HD uint32_t non_finite(float x) { return (float_bits(x) & 0x7F800000u) == 0x7F800000u; }

// The float stored in a block record is the block's magnitude m:
//   b >= 4 and stochastic 1-, 2-bit: m = max |x| (quantization step m / L);
//   deterministic 1-bit:            m = mean |x| over the block's valid elements;
//   deterministic 2-bit:            m = min(max |x|, 1.5 mean |x|), clipped (below).
// A block holding a non-finite value gets m = NaN, so all its dequantized values are NaN.
// Dequantization is m * (k / L) for signed code k, so the extreme codes give back exactly
// +-m and a constant block round-trips losslessly.

// What takes x to code units: v = (x * pre) * inv, with inv = L / (m * pre) (b >= 2) or
// 1 / (m * pre) (1-bit). pre is 1 for every block with m >= 2^-64, so v = x * (L / m). Below
// that (a denormal absmax, say) L / m would overflow to Inf and turn codes into garbage, so
// x and m are first scaled by pre = 2^64: exact for values this small, so the codes are the
// ones an unbounded exponent would give and the half-step bound holds.
struct BlockInv {
  float inv;
  float pre;
};

constexpr float kTinyMagnitude = 0x1p-64f;

DDPC_HD BlockInv block_inv(float m, int bits) {
  const float pre = m < kTinyMagnitude ? 0x1p64f : 1.0f;
  return BlockInv{(bits == 1 ? 1.0f : (float)max_level(bits)) / (m * pre), pre};
}

// Deterministic 1-bit magnitude from the pairwise-tree sum of |x| (see block_tree_sum).
DDPC_HD float meanabs(float abs_sum, int64_t valid) { return abs_sum / (float)valid; }

// Whether the block magnitude needs the tree sum of |x|: deterministic 1- and 2-bit.
DDPC_HD bool uses_mean(int bits, bool stochastic) { return bits <= 2 && !stochastic; }

// The ternary (2-bit) code rounds x / m to -1, 0 or +1. With m = max |x| every value below
// max/2 becomes 0; clipping m at 1.5 mean |x| (values above m code +-1, error feedback
// keeps the rest) puts the threshold near 0.6 sigma for Gaussian-like blocks, the
// least-squares ternary one. Measured on a GPT's gradients (B = 256): the relative L2
// error of one rank's q2 falls from 0.78 to 0.40-0.42. Two roundings (divide, multiply)
// and a compare: no FMA can form, so CPU and CUDA agree bitwise.
constexpr float kTernaryClip = 1.5f;

// Magnitude of a block whose |x| sums to abs_sum (tree order) and peaks at absmax.
DDPC_HD float mean_magnitude(int bits, float absmax, float abs_sum, int64_t valid) {
  const float mean = meanabs(abs_sum, valid);
  if (bits == 1) return mean;
  const float clipped = kTernaryClip * mean;
  return clipped < absmax ? clipped : absmax;
}

// k / L for signed code k = code - L; kernels tabulate it once per launch.
constexpr DDPC_HD float level_value(uint32_t code, int bits) {
  return (float)((int)code - max_level(bits)) / (float)max_level(bits);
}

// ---------------------------------------------------------------------------------------
// Counter-based RNG: a uniform float in [0, 1) that is a pure function of
// (seed, step, index). splitmix64's finalizer on a mixed 64-bit key.
// ---------------------------------------------------------------------------------------

DDPC_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 24 random bits scaled to [0, 1): exact in fp32.
DDPC_HD float uniform24(uint64_t r) { return (float)(r >> 40) * (1.0f / 16777216.0f); }

// The (seed, step) part of the key, hoisted out of per-element loops.
DDPC_HD uint64_t rng_key(uint64_t seed, uint64_t step) {
  return mix64(mix64(seed + 0x9E3779B97F4A7C15ull) ^ (step + 0x632BE59BD9B4E019ull));
}

// Element `index`'s 64 random bits; its uniform is uniform24(rng_u64_keyed(key, index)).
DDPC_HD uint64_t rng_u64_keyed(uint64_t key, uint64_t index) { return mix64(key ^ index); }

// ---------------------------------------------------------------------------------------
// Rounding without libm calls, so loops vectorize on any x86-64 and the GPU agrees.
// Valid for |v| < 2^22, which code-unit values (|v| <= 128) always are.
// ---------------------------------------------------------------------------------------

// Round half to even (IEEE default mode), as rintf and torch.round.
DDPC_HD float round_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;
}

DDPC_HD float floor_small(float v) {
  float r = round_even(v);
  return r > v ? r - 1.0f : r;
}

// ---------------------------------------------------------------------------------------
// Quantize / dequantize one element of a block with magnitude m > 0 (finite).
// `inv` is block_inv(m, bits); `u` the uniform draw (ignored when !stochastic).
// Blocks with m == 0 or m == NaN store degenerate_code(bits) everywhere.
// ---------------------------------------------------------------------------------------

DDPC_HD bool block_is_degenerate(float m) { return !(m > 0.0f) || !is_finite(m); }

// The code of +0.
DDPC_HD uint32_t degenerate_code(int bits) { return bits == 1 ? 1u : (uint32_t)max_level(bits); }

DDPC_HD uint32_t quantize_one(float x, BlockInv inv, int bits, bool stochastic, float u) {
  const float v = (x * inv.pre) * inv.inv;
  if (bits == 1) {
    if (!stochastic) return x >= 0.0f ? 1u : 0u;
    // P(+m) = (1 + x/m) / 2 makes E[deq] = x for |x| <= m.
    return u < 0.5f * (1.0f + v) ? 1u : 0u;
  }
  // The rounded value is a whole number far inside int range (x is finite and |x| <= B * m,
  // so |v| <= B * L), so clamping it as an int gives the code that clamping the float would.
  // The integer clamp is what vectorizes: gcc turned a float clamp into compare masks and
  // byte blends (objdump of the CPU's 8-bit encode loop: vpblendvb and stack spills, 62% of
  // a copy), the integer one into vpminsd + vpmaxsd.
  const int lmax = max_level(bits);
  int k = (int)(stochastic ? floor_small(v + u) : round_even(v));
  k = k > lmax ? lmax : k;
  k = k < -lmax ? -lmax : k;
  return (uint32_t)(k + lmax);
}

// `level` is level_value(code, bits) (unused for 1-bit).
DDPC_HD float dequantize_one(uint32_t code, float m, float level, int bits) {
  if (bits == 1) return code ? m : -m;
  return m * level;
}

// Pairwise-tree sum used for the 1-bit mean |x|: level by level, element i adds
// element i + w/2 (w = B, B/2, ... 2). The CUDA kernel reduces in the same pairing.
// `buf` holds B values and is destroyed.
DDPC_HD float block_tree_sum(float* buf, int64_t block) {
  for (int64_t w = block / 2; w >= 1; w /= 2) {
    for (int64_t i = 0; i < w; ++i) buf[i] = buf[i] + buf[i + w];
  }
  return buf[0];
}

// ---------------------------------------------------------------------------------------
// q1.5: a ternary code with a dead zone, sent as a bitmap and signs (ops' bits = 3).
//
// Record of a block of B values (B >= 32, a power of two), 2 + 3B/16 bytes:
//   [ bfloat16 m ][ B/8 bitmap bytes ][ B/16 sign bytes ]
// Bit j of the bitmap (LSB first) is set when element j is kept; the kept elements' signs
// follow in element order, one bit each (1 = negative) from the first sign byte's LSB, room
// for B/2 of them, the rest zero. Element j decodes to m * k with k = +-1 if kept, else 0:
// m, -m, or 0 (NaN everywhere in a block whose m is NaN, as q2's zero codes). Set bits past
// the B/2-th read as positive: only payloads quantize never makes have them.
//
// Kept: |e| > t = kDeadZone * RMS(e) over the block's valid elements (0.675 sigma: half of a
// Gaussian block); when more than B/2 are, the B/2 of largest |e| instead (ties to the
// lower index), the cap the record has room for. m is the mean |e| of those kept, 0 if none:
// the least-squares magnitude for that support. A block holding a non-finite value keeps
// nothing and gets m = NaN. At 0.675 sigma a GPT's normalized gradients keep 46% (a
// heavier tail than Gaussian's), so the cap binds in few blocks.
//
// Sums of squares and of kept |e| run in the pairwise tree order of block_tree_sum, on
// values scaled by sparse_pre (a power of two, exact) so that squares neither overflow nor
// vanish: sqrt, divides and compares are correctly rounded on CPU and GPU alike.
// ---------------------------------------------------------------------------------------

constexpr float kDeadZone = 0.675f;

DDPC_HD int64_t sparse_cap(int64_t block) { return block / 2; }

// Scale for a block whose largest |e| is absmax (finite): pre = 2^-k for 2^k <= absmax <
// 2^(k+1), k clamped to [-126, 126], so e * pre is exact and below 2: squares, and their sum
// over any block (below 4 * 65536), neither overflow nor vanish for elements within 2^-60
// of absmax. 1 / pre = 2^k is exact too.
DDPC_HD float sparse_pre(float absmax) {
  int k = (int)(float_bits(absmax) >> 23) - 127;  // a denormal or 0 absmax: -127
  k = k < -126 ? -126 : (k > 126 ? 126 : k);
  return bits_float((uint32_t)(127 - k) << 23);
}

// Dead-zone threshold in pre-scaled units, from the tree sum of (e * pre)^2.
DDPC_HD float dead_zone(float sum_squares, int64_t valid) {
  return kDeadZone * sqrtf(sum_squares / (float)valid);
}

// m from the tree sum of the kept (e * pre)'s |.|, count of them and pre.
DDPC_HD float sparse_magnitude(float kept_sum, int64_t count, float pre) {
  return count == 0 ? 0.0f : (kept_sum / (float)count) * (1.0f / pre);
}

// m (>= 0, or NaN) on the wire: bfloat16, rounded to nearest even (a relative error up to
// 2^-9, which error feedback keeps), saturated at bfloat16's largest finite value where it
// would round to Inf (a mean of values near FLT_MAX can), a NaN as the canonical bfloat16
// NaN. Two bytes a block, not four: 0.031 bits per element at B = 512. Encoding, decoding
// and the residual all use sparse_m_value of these bits.
DDPC_HD uint16_t sparse_m_bits(float m) {
  if (is_nan(m)) return kCanonicalNanBF16;
  const uint32_t u = float_bits(m);
  return (uint16_t)(u >= 0x7F7F8000u ? 0x7F7Fu : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

DDPC_HD float sparse_m_value(uint16_t bits) { return bits_float((uint32_t)bits << 16); }

// Element j's value: bitmap bit `kept`, sign bit `negative`.
DDPC_HD float sparse_value(bool kept, bool negative, float m) {
  return kept ? (negative ? -m : m) : m * 0.0f;
}

// ---------------------------------------------------------------------------------------
// Sparsification (top-k, random-k).
//
// Packed top-k payload for k selected entries, value dtype V (float32 by default):
//   [ k int32 indices, strictly ascending ][ k values as V, in the same order ]
// Total k * (4 + sizeof(V)) bytes; the values start at byte 4k, so they stay aligned.
//
// Selection order: entry i ranks above entry j when magnitude_key(e_i) > magnitude_key(e_j),
// or the keys are equal and i < j. magnitude_key is |e|'s float bit pattern, which orders
// like |e| for finite values and ranks +-Inf above every finite value and NaN above Inf,
// so a bucket holding a non-finite value always sends one (every rank then sees it).
// ---------------------------------------------------------------------------------------

DDPC_HD uint32_t magnitude_key(float v) { return float_bits(v) & 0x7FFFFFFFu; }

// A selected value goes on the wire saturated at its dtype's largest finite value, never
// rounded to Inf: float16 holds only |v| <= 65504 (bfloat16 rounds to Inf just below
// FLT_MAX). With error feedback the residual keeps e - sent, so nothing is lost. A
// non-finite e is sent as it is, so every rank sees it.
constexpr float kMaxFloat16 = 0x1.ffcp15f;   // 65504
constexpr float kMaxBFloat16 = 0x1.fep127f;  // 3.3895314e38
constexpr float kMaxFloat32 = 0x1.fffffep127f;

DDPC_HD float saturate(float e, float max_finite) {
  if (!is_finite(e)) return e;
  return e > max_finite ? max_finite : (e < -max_finite ? -max_finite : e);
}

DDPC_HD int64_t topk_payload_bytes(int64_t k, int64_t value_bytes) { return k * (4 + value_bytes); }

// Threshold sample: S = min(n, 16384) magnitudes of e drawn with replacement at
// topk_sample_index(rng_key(seed, step), j, n), j < S. 53 random bits modulo n: the bias is
// below n / 2^53, and the shift keeps the value a non-negative int64 for the reference.
constexpr int64_t kTopkSampleMax = 16384;

DDPC_HD int64_t topk_sample_count(int64_t n) { return n < kTopkSampleMax ? n : kTopkSampleMax; }

DDPC_HD int64_t topk_sample_index(uint64_t key, int64_t j, int64_t n) {
  return (int64_t)((rng_u64_keyed(key, (uint64_t)j) >> 11) % (uint64_t)n);
}

// Integer square root (floor), for the sample margins below.
DDPC_HD int64_t isqrt64(int64_t m) {
  int64_t root = 0;
  while ((root + 1) * (root + 1) <= m) ++root;
  return root;
}

// Rank (0-based, in the sample sorted by descending key) whose key is the approximate
// threshold: the sample's share of k, m = k*S/n, plus one standard deviation of that
// binomial count, so about 84% of draws keep at least k candidates (and give the exact
// top k) while the rest fill up only a few percent of k. A rank >= S means "threshold 0":
// every entry is a candidate. Approximate mode's output depends on it: integer math.
DDPC_HD int64_t topk_approx_rank(int64_t k, int64_t n, int64_t samples) {
  const int64_t m = k * samples / n;
  return m + isqrt64(m);
}

// Exact mode's output does not depend on its threshold (a miss costs one more pass), so
// this rank only trades candidates kept against the chance of a miss: the expected count
// m plus about 4 standard deviations of a binomial count, plus slack for tiny m.
DDPC_HD int64_t topk_exact_rank(int64_t k, int64_t n, int64_t samples) {
  const int64_t m = k * samples / n;
  return m + 4 * (isqrt64(m) + 1) + 8;
}

// Random-k: k distinct indices in ascending order by stratified sampling. Stratum j is
// [j*n/k, (j+1)*n/k) (integer division) and holds exactly one index, drawn uniformly with
// 32 random bits: lo + floor(u32 * size / 2^32). Strata are disjoint and non-empty for
// k <= n, so indices are distinct and sorted by construction, each index is chosen with
// probability 1/size (~k/n), and every j is independent (one GPU thread each).
DDPC_HD uint64_t randk_key(uint64_t seed, uint64_t step, uint64_t bucket) {
  return mix64(rng_key(seed, step) ^ (bucket + 0xD6E8FEB86659FD93ull));
}

DDPC_HD int64_t randk_index(uint64_t key, int64_t j, int64_t n, int64_t k) {
  const int64_t lo = j * n / k, hi = (j + 1) * n / k;
  const uint64_t u32 = rng_u64_keyed(key, (uint64_t)j) >> 32;
  return lo + (int64_t)((u32 * (uint64_t)(hi - lo)) >> 32);
}

}  // namespace ddpcomm
