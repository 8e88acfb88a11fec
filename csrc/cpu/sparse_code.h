// q1.5 on the CPU (numerics.h): the encoder's write step, the residual and the row sums of
// its records. Included by quantize.cpp inside its namespace, after Divide, SumTo and the
// 8-lane vector helpers. Both directions work on one 32-bit bitmap word (32 elements) at a
// time: on the way out the signs of a word's kept elements are packed in element order, on
// the way in each kept element takes the next of them: BMI2's pext and pdep of the word's
// sign bits under its bitmap word where they run in hardware (fast_bmi2, dispatch.h); else
// with AVX2 8 lanes at a time through lane_tables.h (a permute packs the kept lanes; a
// lane's shift is its rank among them), 1.2x the time of pdep for a decode on Zen 4 but
// no microcode; without AVX2, bit by bit.
#pragma once

#if DDPCOMM_HAVE_AVX2
#include "lane_tables.h"
#endif

constexpr int kWordBits = 32;                 // elements per bitmap word
constexpr int kWordSub = kWordBits / kLanes;  // 8-lane vectors per bitmap word

#if DDPCOMM_HAVE_AVX2
// The lanes of v whose bit is set in mask (< 256), packed to the front in lane order.
LANES_INLINE i32x8 compact8(i32x8 v, uint32_t mask) {
  return (i32x8)_mm256_permutevar8x32_epi32((__m256i)v, lane_row(kLaneTables.compact, mask));
}
#endif

// Bits 8 sub .. 8 sub + 7 of a word broadcast to every lane, lane t testing bit 8 sub + t, as
// 0 / -1 lane masks: an and and a compare, where shifting each lane's bit down took two more
// instructions.
LANES_INLINE i32x8 word_lanes(u32x8 word, int sub) {
  const u32x8 lane_bit = {1u, 2u, 4u, 8u, 16u, 32u, 64u, 128u};
  return (word & (lane_bit << (kLanes * sub))) != 0u;
}

// Packs the lanes of k8 whose bit is set in mask to dst[0 ..), in lane order, and returns how
// many. Up to 8 entries are written: dst must have room for 8.
LANES_INLINE int64_t pack8(uint32_t* dst, u32x8 k8, uint32_t mask) {
#if DDPCOMM_HAVE_AVX2
  const i32x8 packed = compact8((i32x8)k8, mask);
  std::memcpy(dst, &packed, sizeof(packed));
#else
  int64_t c = 0;
  for (int l = 0; l < kLanes; ++l) {
    dst[c] = k8[l];
    c += (mask >> l) & 1u;
  }
#endif
  return __builtin_popcount(mask);
}

// Bit i set where the i-th kept element of the word at e (32 values; bit t of keep: element t
// kept) is negative. bmi2: fast_bmi2().
LANES_INLINE uint32_t kept_signs(const float* e, uint32_t keep, bool bmi2) {
#if DDPCOMM_HAVE_AVX2
  if (!bmi2) {
    uint32_t signs = 0;
    int at = 0;
    for (int sub = 0; sub < kWordSub; ++sub) {
      const uint32_t mask = (keep >> (kLanes * sub)) & 0xFFu;
      const int n = __builtin_popcount(mask);
      const uint32_t packed = lane_mask(compact8(lt8(load8(e + kLanes * sub), f32x8{}), mask));
      signs |= (packed & ((1u << n) - 1u)) << at;
      at += n;
    }
    return signs;
  }
#else
  (void)bmi2;
#endif
  uint32_t neg = 0;
  for (int sub = 0; sub < kWordSub; ++sub) {
    neg |= lane_mask(lt8(load8(e + kLanes * sub), f32x8{})) << (kLanes * sub);
  }
#if DDPCOMM_HAVE_AVX2
  return _pext_u32(neg, keep);
#else
  uint32_t signs = 0;
  for (int i = 0; keep != 0; keep &= keep - 1, ++i) {
    signs |= ((neg >> __builtin_ctz(keep)) & 1u) << i;
  }
  return signs;
#endif
}

// kept_signs' inverse: the sign bit (bit 31) of each of a word's 32 elements, 8 lanes per
// vector, from w, whose bit i is the i-th kept element's; lanes not kept hold anything.
LANES_INLINE void word_signs(uint32_t w, uint32_t keep, bool bmi2, u32x8 (&sign)[kWordSub]) {
#if DDPCOMM_HAVE_AVX2
  if (!bmi2) {
    for (int sub = 0; sub < kWordSub; ++sub) {
      const uint32_t mask = (keep >> (kLanes * sub)) & 0xFFu;
      const u32x8 rank = (u32x8)lane_row(kLaneTables.rank, mask);
      sign[sub] = (((u32x8){} + w) >> rank) << 31;
      w >>= __builtin_popcount(mask);
    }
    return;
  }
  const uint32_t neg = _pdep_u32(w, keep);
#else
  (void)bmi2;
  uint32_t neg = 0;
  for (uint32_t m = keep; m != 0; m &= m - 1, w >>= 1) neg |= (w & 1u) ? (m & (0u - m)) : 0u;
#endif
  const u32x8 negative = (u32x8){} + neg;
  for (int sub = 0; sub < kWordSub; ++sub) {
    sign[sub] = (u32x8)word_lanes(negative, sub) & 0x80000000u;
  }
}

// The lowest n (>= 0) set bits of x.
LANES_INLINE uint32_t lowest_set(uint32_t x, int64_t n) {
  uint32_t r = 0;
  for (; n > 0 && x != 0; --n, x &= x - 1) r |= x & (0u - x);
  return r;
}

// The lanes set in masks summed into c (a set lane is -1).
LANES_INLINE int64_t lanes_set(i32x8 c) {
  int64_t n = 0;
  for (int l = 0; l < kLanes; ++l) n -= c[l];
  return n;
}

// The (d + 1)-th smallest of keys[0, n), d < n, all at most hi: a bisection on the key's
// value, each step a branch-free count of the keys up to the midpoint (8 at a time, over
// keys padded to whole vectors with keys above every key). On blocks of 512 near-equal |e|
// (the cap's key is then the block's median: what normalize makes of a gradient repeated
// step after step), nth_element's compares, mispredicted about half the time, made the
// encode of 16M elements take 129 ms on one thread; with this, 36-43 ms.
inline uint32_t select_key(uint32_t* keys, int64_t n, int64_t d, uint32_t hi) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = n; j < padded; ++j) keys[j] = 0xFFFFFFFFu;
  u32x8 low = (u32x8){} + 0xFFFFFFFFu;
  for (int64_t j = 0; j < padded; j += kLanes) {
    u32x8 k8;
    std::memcpy(&k8, keys + j, sizeof(k8));
    low = min8(low, k8);
  }
  uint32_t lo = min_lane(low);
  // Invariant: at most d keys are below lo, more than d are at most hi.
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    i32x8 c = {};
    for (int64_t j = 0; j < padded; j += kLanes) {
      u32x8 k8;
      std::memcpy(&k8, keys + j, sizeof(k8));
      c += k8 <= mid;
    }
    if (lanes_set(c) > d) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The cap-th largest of the `over` keys above the dead zone (a * pre > t for a = |e|, keys at
// most `top`): the (d + 1)-th smallest of them, d = over - cap, so it sits just above t. The
// keys of a band (t, u] that holds at least d + 1 of them (which then holds the d + 1
// smallest) are packed into `band` (B entries) and select_key picks there: vector compares
// and a permute a group of 8, where a heap over every key above t took a mispredicted branch
// for most of the keys that entered it (Gaussian blocks: 2.4x the time of an uncapped one).
// The band starts 2 (d + 1) / over wide relative to t (on Gaussian blocks, whose |e| just
// above 0.675 sigma hold about 0.86 of the kept share per unit of relative width, about
// twice the keys needed) and widens 4x a try; the last takes every key above t.
inline uint32_t cap_key(const float* e, int64_t B, float pre, float t, int64_t over, int64_t cap,
                        uint32_t top, uint32_t* band) {
  constexpr int kTries = 6;
  const int64_t d = over - cap;
  const float at = t / pre;  // t in |e|'s units (only the band's width depends on it)
  float width = 2.0f * (float)(d + 1) / (float)over;
  auto in_band = [&](int64_t j, uint32_t u) {
    const u32x8 k8 = abs_bits8(load8(e + j));
    return gt8((f32x8)k8 * pre, (f32x8){} + t) & (i32x8)(k8 <= u);
  };
  uint32_t u = top;
  for (int tries = 0; tries < kTries; ++tries, width *= 4.0f) {
    const uint32_t bound = magnitude_key(at * (1.0f + width));
    i32x8 count = {};
    for (int64_t j = 0; j < B; j += kLanes) count += in_band(j, bound);
    if (lanes_set(count) > d) {
      u = bound < top ? bound : top;
      break;
    }
  }
  // At most j entries precede group j, so its 8 stores stay inside band's B.
  int64_t inside = 0;
  for (int64_t j = 0; j < B; j += kLanes) {
    inside += pack8(band + inside, abs_bits8(load8(e + j)), lane_mask(in_band(j, u)));
  }
  // A few dozen keys (Gaussian blocks: about 2 (d + 1)) nth_element sorts out faster.
  if (inside <= 64) {
    std::nth_element(band, band + d, band + inside);
    return band[d];
  }
  return select_key(band, inside, d, u);
}

// The record of block e (B values, `valid` of them real, zeros past them). tree and band are
// scratch of B entries each. Every pass reads e itself: a magnitude key (|e|'s bits) takes one
// bitwise and to form again, and storing the keys cost more than it saved.
inline void sparse_write(const float* e, int64_t B, int64_t valid, uint8_t* record, float* tree,
                         uint32_t* band) {
  uint8_t* bitmap = record + kSparseScaleBytes;
  uint8_t* signs = bitmap + B / 8;
  const int64_t sign_bytes = B / 16;
  const bool bmi2 = fast_bmi2();
  const uint32_t mbits = absmax_bits(e, B);
  if (mbits >= 0x7F800000u) {
    const uint16_t m = sparse_m_bits(canonical_nan());
    std::memcpy(record, &m, sizeof(m));
    std::memset(bitmap, 0, (size_t)(B / 8 + sign_bytes));
    return;
  }
  const float pre = sparse_pre(bits_float(mbits));
  auto scaled = [&](int64_t j) { return (f32x8)abs_bits8(load8(e + j)) * pre; };
  // The tree sum of the squares, its first level (j with j + B/2) added as they are taken.
  const int64_t half = B / 2;
  for (int64_t j = 0; j < half; j += kLanes) {
    const f32x8 a = scaled(j), b = scaled(j + half);
    store8(tree + j, a * a + b * b);
  }
  const float t = dead_zone(tree_sum(tree, half), valid);
  i32x8 above_t = {};
  const f32x8 t8 = (f32x8){} + t;
  for (int64_t j = 0; j < B; j += kLanes) above_t += gt8(scaled(j), t8);
  const int64_t over = lanes_set(above_t);
  // Past the cap: keep keys above the cap-th largest key v, and the first `ties` equal to it.
  const int64_t cap = sparse_cap(B);
  const bool capped = over > cap;
  uint32_t v = 0;
  int64_t ties = 0;
  if (capped) {
    v = cap_key(e, B, pre, t, over, cap, mbits, band);
    i32x8 above_v = {};
    for (int64_t j = 0; j < B; j += kLanes) above_v += abs_bits8(load8(e + j)) > v;
    ties = cap - lanes_set(above_v);
  }
  // Word by word: the bitmap word, the kept |e| into tree, the kept signs appended to `run`.
  uint64_t run = 0;
  int held = 0;
  int64_t count = 0, written = 0;
  for (int64_t j0 = 0; j0 < B; j0 += kWordBits) {
    // Branch-free: whether an element is kept is a coin flip near the threshold.
    uint32_t keep = 0;
    if (capped) {
      // Keys above v, and of those equal to it the first `ties` left: the lowest bits of the
      // word's equal ones (all of them but in the one word where the ties run out).
      uint32_t gt = 0, eq = 0;
      for (int sub = 0; sub < kWordSub; ++sub) {
        const u32x8 k8 = abs_bits8(load8(e + j0 + kLanes * sub));
        gt |= lane_mask(k8 > v) << (kLanes * sub);
        eq |= lane_mask(k8 == v) << (kLanes * sub);
      }
      const int64_t n_eq = __builtin_popcount(eq);
      const int64_t take = ties <= 0 ? 0 : (ties < n_eq ? ties : n_eq);
      keep = gt | (take == n_eq ? eq : lowest_set(eq, take));
      ties -= n_eq;
      const u32x8 kept = (u32x8){} + keep;
      for (int sub = 0; sub < kWordSub; ++sub) {
        const i32x8 a = (i32x8)scaled(j0 + kLanes * sub);
        store8(tree + j0 + kLanes * sub, (f32x8)(a & word_lanes(kept, sub)));
      }
    } else {
      for (int sub = 0; sub < kWordSub; ++sub) {
        const f32x8 a = scaled(j0 + kLanes * sub);
        const i32x8 kept = gt8(a, t8);
        keep |= lane_mask(kept) << (kLanes * sub);
        store8(tree + j0 + kLanes * sub, (f32x8)((i32x8)a & kept));
      }
    }
    std::memcpy(bitmap + j0 / 8, &keep, sizeof(keep));
    const int c = __builtin_popcount(keep);
    run |= (uint64_t)kept_signs(e + j0, keep, bmi2) << held;
    held += c;
    count += c;
    if (held >= 32) {
      const uint32_t out = (uint32_t)run;
      std::memcpy(signs + written, &out, sizeof(out));
      written += 4;
      run >>= 32;
      held -= 32;
    }
  }
  for (; held > 0; held -= 8, run >>= 8) signs[written++] = (uint8_t)run;
  if (written < sign_bytes) std::memset(signs + written, 0, (size_t)(sign_bytes - written));
  const uint16_t m = sparse_m_bits(sparse_magnitude(tree_sum(tree, B), count, pre));
  std::memcpy(record, &m, sizeof(m));
}

// 32 sign bits from bit s of a sign area of `bytes` bytes; bits past it read 0 (positive).
LANES_INLINE uint32_t sign_window(const uint8_t* signs, int64_t bytes, int64_t s) {
  const int64_t at = s >> 3;
  uint64_t w = 0;
  if (at + 8 <= bytes) {
    std::memcpy(&w, signs + at, sizeof(w));
  } else {
    for (int64_t b = at; b < bytes; ++b) w |= (uint64_t)signs[b] << (8 * (b - at));
  }
  return (uint32_t)(w >> (s & 7));
}

// One record, decoded in order: a bitmap word (32 elements) at a time, then element by
// element past the last whole word. A kept element is +-m, its sign the next of the
// record's sign bits; the others m * 0.
struct SparseRow {
  const uint8_t* bitmap;
  const uint8_t* signs;
  int64_t sign_bytes, s;  // s: the sign bits the elements before took
  float m;
  u32x8 mb, zb;  // m's and m * 0's bits in every lane
  bool bmi2;     // fast_bmi2()

  SparseRow() = default;
  SparseRow(const uint8_t* record, int64_t B)
      : bitmap(record + kSparseScaleBytes),
        signs(bitmap + B / 8),
        sign_bytes(B / 16),
        s(0),
        bmi2(fast_bmi2()) {
    uint16_t mb16;
    std::memcpy(&mb16, record, sizeof(mb16));
    m = sparse_m_value(mb16);
    mb = (u32x8){} + float_bits(m);
    zb = (u32x8){} + float_bits(sparse_value(false, false, m));
  }

  // The values of elements 32 q .. 32 q + 31, 8 per vector, lane by lane from m, -m, m * 0.
  LANES_INLINE void word(int64_t q, f32x8 (&v)[kWordSub]) {
    uint32_t bits;
    std::memcpy(&bits, bitmap + 4 * q, sizeof(bits));
    u32x8 sign[kWordSub];
    word_signs(sign_window(signs, sign_bytes, s), bits, bmi2, sign);
    s += __builtin_popcount(bits);
    const u32x8 kept = (u32x8){} + bits;
    for (int sub = 0; sub < kWordSub; ++sub) {
      v[sub] = (f32x8)(word_lanes(kept, sub) != 0 ? mb ^ sign[sub] : zb);
    }
  }

  // Element j's value, for j past the whole words, in increasing order.
  float element(int64_t j) {
    const bool kept = (bitmap[j >> 3] >> (j & 7)) & 1u;
    const bool negative = kept && ((sign_window(signs, sign_bytes, s) & 1u) != 0u);
    s += kept;
    return sparse_value(kept, negative, m);
  }
};

// Calls f(j, v) for the values v of elements j .. j + 7 of the record of a block of B
// (j < valid - valid % 32), then tail(j, value) for each element past them.
template <class F, class Tail>
LANES_INLINE void sparse_values(const uint8_t* record, int64_t B, int64_t valid, F&& f,
                                Tail&& tail) {
  SparseRow row(record, B);
  const int64_t words = valid / kWordBits;
  for (int64_t q = 0; q < words; ++q) {
    f32x8 v[kWordSub];
    row.word(q, v);
    for (int sub = 0; sub < kWordSub; ++sub) f(kWordBits * q + kLanes * sub, v[sub]);
  }
  for (int64_t j = words * kWordBits; j < valid; ++j) tail(j, row.element(j));
}

// Block size of a q1.5 record of `rec` bytes.
inline int64_t sparse_block(int64_t rec) { return (rec - kSparseScaleBytes) * 16 / 3; }

// sum_rows for q1.5 records (same contract). Up to kRowsAtOnce rows are decoded side by
// side, a word's sums kept in registers across them; more rows carry their partial sums
// through dst (the adds stay in row order, so the bits do not depend on the split).
template <SumTo kTo>
void sparse_sum_rows(const uint8_t* in, int64_t rows, int64_t row_bytes, int64_t blk, int64_t rec,
                     int64_t valid, const Divide& divide, const float* res, float* dst, float* e) {
  constexpr int64_t kRowsAtOnce = 8;
  const Divide d = divide;  // a local copy: the stores to dst cannot change it
  const int64_t B = sparse_block(rec), words = valid / kWordBits;
  const uint8_t* first = in + blk * rec;
  SparseRow row[kRowsAtOnce];
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsAtOnce) {
    const int64_t n = std::min(kRowsAtOnce, rows - r0);
    const bool last = r0 + n == rows;
    for (int64_t r = 0; r < n; ++r) row[r] = SparseRow(first + (r0 + r) * row_bytes, B);
    for (int64_t q = 0; q < words; ++q) {
      f32x8 a[kWordSub], v[kWordSub];
      for (int sub = 0; sub < kWordSub; ++sub) {
        a[sub] = r0 == 0 ? (f32x8){} : load8(dst + kWordBits * q + kLanes * sub);
      }
      for (int64_t r = 0; r < n; ++r) {
        row[r].word(q, v);
        for (int sub = 0; sub < kWordSub; ++sub) a[sub] = a[sub] + v[sub];
      }
      for (int sub = 0; sub < kWordSub; ++sub) {
        const int64_t j = kWordBits * q + kLanes * sub;
        if (last) {
          finish8<kTo>(a[sub], j, d, res, dst, e);
        } else {
          store8(dst + j, a[sub]);
        }
      }
    }
    for (int64_t j = words * kWordBits; j < valid; ++j) {
      float a = r0 == 0 ? 0.0f : dst[j];
      for (int64_t r = 0; r < n; ++r) a = a + row[r].element(j);
      if (last) {
        finish1<kTo>(a, j, d, res, dst, e);
      } else {
        dst[j] = a;
      }
    }
  }
}

// Error feedback after encoding, as update_residual: res[j] = canonical(s[j] - scale * deq[j]),
// in one pass over the record.
inline void sparse_residual(const uint8_t* record, int64_t B, const float* s, float scale,
                            int64_t valid, float* res) {
  sparse_values(
      record, B, valid,
      [&](int64_t j, f32x8 v) {
        const f32x8 sj = load8(s + j);
        store8(res + j, canonical8(scale == 1.0f ? sj - v : sj - scale * v));
      },
      [&](int64_t j, float v) { res[j] = canonical(scale == 1.0f ? s[j] - v : s[j] - scale * v); });
}
