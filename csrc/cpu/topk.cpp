// CPU implementations of the top-k ops: topk_compress_into and sparse_accumulate_into.
// Selection order, sampling and the payload layout come from csrc/numerics.h
// ("Sparsification"); ddpcomm/reference.py states the semantics. Random-k: randk.cpp.
//
// topk_compress avoids both a full sort and a full histogram in the common case:
//   1. a random sample of 16K magnitudes gives a threshold expected to keep ~1.37 k
//      entries (exact mode: 4 standard deviations of margin) or ~1.08 k (approximate: 1);
//   2. one fused pass over the bucket adds the residual, stores e back into it and keeps
//      every entry at or above the threshold as a candidate (per chunk, in index order;
//      AVX2 compaction in the x86-64-v3 variant, dispatch.h);
//   3. the k winners are picked among the candidates only (a histogram of their keys, then
//      nth_element inside one bin; ties by lower index) and written in ascending index
//      order with the residual update.
// When the sample misjudged and fewer than k entries passed, exact mode finds a safe
// threshold from a 32768-bin histogram of the keys (one more pass) and repeats steps 2-3
// on e, so its result never depends on the sample; approximate mode never makes that pass
// and fills up with the lowest-index entries that missed the threshold.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "../checks.h"
#include "../numerics.h"
#include "dispatch.h"

#if DDPCOMM_HAVE_AVX2
#include <immintrin.h>
#endif

// Everything below, not the headers above, is compiled for x86-64-v3 in the AVX2 variant
// (avx2/topk.cpp; see dispatch.h).
#if defined(DDPCOMM_ISA_AVX2)
#pragma GCC target("arch=x86-64-v3")
#endif

namespace ddpcomm::DDPCOMM_ISA {
namespace {

// Elements per parallel task of the scan, and per inner block whose hit count is taken
// before any candidate is stored (keeps the hot loop vectorizable; blocks without a hit,
// most of them below ~1% density, skip the compaction).
constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kBlock = 64;

int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// A growable array that, unlike std::vector, does not zero the room it hands out: the
// compaction writes up to a block (+ 8) of entries past the end and keeps only the hits.
template <typename T>
class Buffer {
 public:
  void clear() { size_ = 0; }
  void reserve(int64_t capacity) {
    if (capacity > capacity_) grow(capacity);
  }
  // Where `count` more entries can be written; extend() then keeps the ones used.
  T* tail(int64_t count) {
    if (size_ + count > capacity_) grow(std::max(2 * capacity_, size_ + count));
    return data_.get() + size_;
  }
  void extend(int64_t count) { size_ += count; }
  int64_t size() const { return size_; }
  const T* begin() const { return data_.get(); }
  const T* end() const { return data_.get() + size_; }
  const T& operator[](int64_t i) const { return data_[i]; }

 private:
  void grow(int64_t capacity) {
    std::unique_ptr<T[]> bigger(new T[capacity]);
    if (size_ > 0) std::memcpy(bigger.get(), data_.get(), size_ * sizeof(T));
    data_ = std::move(bigger);
    capacity_ = capacity;
  }
  std::unique_ptr<T[]> data_;
  int64_t size_ = 0, capacity_ = 0;
};

// One chunk's candidates, in index order: the raw bits of e (value and key in one word),
// and the largest key of the whole chunk (>= every candidate's).
struct Candidates {
  Buffer<uint32_t> bits;
  Buffer<int32_t> index;
  uint32_t max_key = 0;
};

#if DDPCOMM_HAVE_AVX2
#include "lane_tables.h"
#endif

// Appends the entries of bits[0, len) whose key is >= thr, with their indices b + j, to
// hit_bits / hit_index (which have room for len + 8) and returns how many. Keeps order.
int64_t compact(const uint32_t* bits, int64_t len, int64_t b, uint32_t thr, uint32_t* hit_bits,
                int32_t* hit_index) {
  int64_t m = 0, j = 0;
#if DDPCOMM_HAVE_AVX2
  // Keys are < 2^31, so a signed compare against thr - 1 is key >= thr (thr = 0: all).
  const __m256i lo = _mm256_set1_epi32((int32_t)thr - 1);
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= len; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + j));
    const __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(v, magnitude), lo);
    // No early exit on an empty mask: the mispredicted branch costs more than the stores
    // it saves (64 Mi fp32 at 1%, one thread: 35 ms with it, 29 ms without).
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(hit));
    const __m256i perm = lane_row(kLaneTables.compact, (uint32_t)mask);
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(b + j)), lane);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hit_bits + m),
                        _mm256_permutevar8x32_epi32(v, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hit_index + m),
                        _mm256_permutevar8x32_epi32(index, perm));
    m += __builtin_popcount((unsigned)mask);
  }
#endif
  for (; j < len; ++j) {  // branch-free: always store, advance only on a hit
    hit_bits[m] = bits[j];
    hit_index[m] = (int32_t)(b + j);
    m += (bits[j] & 0x7FFFFFFFu) >= thr ? 1 : 0;
  }
  return m;
}

// Scans e over [0, n) and keeps entries with magnitude_key(e) >= thr. e = x + res when
// kFuse (and e is stored back into res), else e = x. Each block is first scanned with a
// vectorizable count of hits; only blocks with a hit run the compaction.
template <typename T, bool kFuse>
void collect(const T* x, float* res, int64_t n, uint32_t thr, double keep_fraction,
             std::vector<Candidates>& out) {
  at::parallel_for(0, num_chunks(n), 1, [&](int64_t c0, int64_t c1) {
    uint32_t bits[kBlock];
    for (int64_t c = c0; c < c1; ++c) {
      Candidates& cand = out[c];
      cand.bits.clear();
      cand.index.clear();
      const int64_t end = std::min(n, (c + 1) * kChunk);
      // Room for the expected share plus slack, so the lists rarely regrow (and copy).
      const int64_t expect = (int64_t)(keep_fraction * (double)(end - c * kChunk) * 1.25) + 64;
      cand.bits.reserve(expect);
      cand.index.reserve(expect);
      uint32_t chunk_max = 0;
      for (int64_t b = c * kChunk; b < end; b += kBlock) {
        const int64_t len = std::min(kBlock, end - b);
        int32_t hits = 0;
        uint32_t block_max = 0;
        for (int64_t j = 0; j < len; ++j) {
          float v = static_cast<float>(x[b + j]);
          if (kFuse) v = v + res[b + j];
          v = canonical(v);
          if (kFuse) res[b + j] = v;
          bits[j] = float_bits(v);
          const uint32_t key = bits[j] & 0x7FFFFFFFu;
          hits += key >= thr ? 1 : 0;
          block_max = key > block_max ? key : block_max;
        }
        chunk_max = std::max(chunk_max, block_max);
        if (hits == 0) continue;
        const int64_t m =
            compact(bits, len, b, thr, cand.bits.tail(len + 8), cand.index.tail(len + 8));
        cand.bits.extend(m);
        cand.index.extend(m);
      }
      cand.max_key = chunk_max;
    }
  });
}

// Key of the sample entry at `rank` in descending order, or 0 ("keep everything") when
// the rank falls past the sample. e is read as x (+ res) before the fused pass.
template <typename T>
uint32_t sample_threshold(const T* x, const float* res, int64_t n, int64_t rank, uint64_t key) {
  const int64_t samples = topk_sample_count(n);
  if (rank >= samples) return 0;
  std::vector<uint32_t> keys(samples);
  for (int64_t j = 0; j < samples; ++j) {
    const int64_t i = topk_sample_index(key, j, n);
    float v = static_cast<float>(x[i]);
    if (res != nullptr) v = v + res[i];
    keys[j] = magnitude_key(canonical(v));
  }
  std::nth_element(keys.begin(), keys.begin() + rank, keys.end(), std::greater<uint32_t>());
  return keys[rank];
}

// Largest threshold of the form bin << 16 that keeps at least k entries of e, from a
// histogram of key >> 16 (32768 bins: keys have 31 bits). Exact mode's fallback.
template <typename T>
uint32_t histogram_threshold(const T* e, int64_t n, int64_t k) {
  constexpr int64_t kBins = 1 << 15;
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_chunks(n)));
  std::vector<std::vector<int64_t>> hist(parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      std::vector<int64_t>& h = hist[p];
      h.assign(kBins, 0);
      for (int64_t i = p * n / parts; i < (p + 1) * n / parts; ++i) {
        h[magnitude_key(canonical(static_cast<float>(e[i]))) >> 16] += 1;
      }
    }
  });
  int64_t kept = 0;
  for (int64_t bin = kBins - 1; bin > 0; --bin) {
    for (int64_t p = 0; p < parts; ++p) kept += hist[p][bin];
    if (kept >= k) return (uint32_t)bin << 16;
  }
  return 0;
}

// Writes entry o of the payload (index i, value e cast to the value dtype, saturated at its
// largest finite value: numerics.h saturate) and, with error feedback, leaves in the residual
// what the cast lost (0 for float32 values). e is canonical (numerics.h), so a NaN value is
// stored as its dtype's canonical NaN.
struct PayloadWriter {
  int32_t* index;
  uint8_t* values;
  at::ScalarType vtype;
  float* res;

  void put(int64_t o, int64_t i, float e) const {
    index[o] = (int32_t)i;
    float sent = e;
    if (vtype == at::kHalf) {
      const c10::Half h(saturate(e, kMaxFloat16));
      reinterpret_cast<c10::Half*>(values)[o] = h;
      sent = static_cast<float>(h);
    } else if (vtype == at::kBFloat16) {
      const c10::BFloat16 h(saturate(e, kMaxBFloat16));
      reinterpret_cast<c10::BFloat16*>(values)[o] = h;
      sent = static_cast<float>(h);
    } else {
      reinterpret_cast<float*>(values)[o] = e;
    }
    if (res != nullptr) res[i] = canonical(e - sent);
  }
};

int64_t total_candidates(const std::vector<Candidates>& cands) {
  int64_t c = 0;
  for (const Candidates& cd : cands) c += cd.index.size();
  return c;
}

// The k-th largest key among the candidates (all keyed >= lo, at least k of them). A
// parallel 4096-bin histogram of (key - lo) >> shift finds the bin holding it; only that
// bin's keys (a small fraction) go through nth_element. Replaces an nth_element over all
// candidates, which was serial and a fifth of the op's time at 1% density.
uint32_t kth_largest_key(const std::vector<Candidates>& cands, int64_t k, uint32_t lo) {
  constexpr int64_t kBins = 1 << 12;
  const int64_t nc = (int64_t)cands.size();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nc));
  auto part_range = [&](int64_t p) { return std::make_pair(p * nc / parts, (p + 1) * nc / parts); };
  uint32_t top = lo;
  for (const Candidates& cd : cands) top = std::max(top, cd.max_key);
  const uint32_t span = top - lo;
  int shift = 0;
  while ((int64_t)(span >> shift) >= kBins) ++shift;

  std::vector<std::vector<int64_t>> hist(parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      std::vector<int64_t>& h = hist[p];
      h.assign(kBins, 0);
      for (int64_t c = part_range(p).first; c < part_range(p).second; ++c) {
        for (uint32_t b : cands[c].bits) h[((b & 0x7FFFFFFFu) - lo) >> shift] += 1;
      }
    }
  });
  int64_t above = 0, bin = kBins - 1;
  for (;; --bin) {
    int64_t count = 0;
    for (int64_t p = 0; p < parts; ++p) count += hist[p][bin];
    if (above + count >= k) break;
    above += count;
  }
  std::vector<uint32_t> keys;
  for (const Candidates& cd : cands) {
    for (uint32_t b : cd.bits) {
      const uint32_t key = b & 0x7FFFFFFFu;
      if ((int64_t)((key - lo) >> shift) == bin) keys.push_back(key);
    }
  }
  const int64_t r = k - above - 1;  // rank of the answer inside its bin, descending
  std::nth_element(keys.begin(), keys.begin() + r, keys.end(), std::greater<uint32_t>());
  return keys[r];
}

// Writes the k best candidates (numerics.h order) in ascending index order. Requires at
// least k candidates; the k-th largest key T splits them into sure winners (key > T) and
// ties (key == T), of which the lowest-index ones fill the remaining places.
void emit_best(const std::vector<Candidates>& cands, int64_t k, uint32_t lo,
               const PayloadWriter& w) {
  const int64_t nc = (int64_t)cands.size();
  const uint32_t t = kth_largest_key(cands, k, lo);

  std::vector<int64_t> above(nc), ties(nc);
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t a = 0, q = 0;
      for (uint32_t b : cands[c].bits) {
        const uint32_t kb = b & 0x7FFFFFFFu;
        a += kb > t;
        q += kb == t;
      }
      above[c] = a;
      ties[c] = q;
    }
  });
  // Ties go to the lowest indices, so to the earliest chunks first.
  int64_t tie_budget = k;
  for (int64_t c = 0; c < nc; ++c) tie_budget -= above[c];
  std::vector<int64_t> out_at(nc + 1, 0), tie_take(nc);
  for (int64_t c = 0; c < nc; ++c) {
    tie_take[c] = std::min(ties[c], tie_budget);
    tie_budget -= tie_take[c];
    out_at[c + 1] = out_at[c] + above[c] + tie_take[c];
  }
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t o = out_at[c], taken = 0;
      for (int64_t j = 0; j < cands[c].bits.size(); ++j) {
        const uint32_t kb = cands[c].bits[j] & 0x7FFFFFFFu;
        const bool win = kb > t || (kb == t && taken++ < tie_take[c]);
        if (win) w.put(o++, cands[c].index[j], bits_float(cands[c].bits[j]));
      }
    }
  });
}

// Approximate mode with fewer than k candidates: all of them, plus the lowest indices that
// missed the threshold, merged in ascending order. e(i) gives e at a non-candidate.
template <typename EFn>
void emit_padded(const std::vector<Candidates>& cands, int64_t k, const PayloadWriter& w,
                 const EFn& e_at) {
  int64_t pads = k - total_candidates(cands), o = 0, i = 0;
  for (const Candidates& cd : cands) {
    for (int64_t j = 0; j < cd.index.size(); ++j) {
      for (; i < cd.index[j] && pads > 0; ++i, --pads) w.put(o++, i, e_at(i));
      w.put(o++, cd.index[j], bits_float(cd.bits[j]));
      i = cd.index[j] + 1;
    }
  }
  for (; pads > 0; ++i, --pads) w.put(o++, i, e_at(i));
}

void topk_compress_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                            const at::Tensor& packed, int64_t k, bool approximate, int64_t seed,
                            int64_t step, std::optional<at::ScalarType> value_dtype) {
  const at::ScalarType vtype = check_topk_compress(x, residual, packed, k, value_dtype);
  const int64_t n = x.numel();
  const at::Tensor xc = x.contiguous();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  const PayloadWriter w{reinterpret_cast<int32_t*>(packed.data_ptr<uint8_t>()),
                        packed.data_ptr<uint8_t>() + 4 * k, vtype, res};
  const uint64_t key = rng_key((uint64_t)seed, (uint64_t)step);
  const int64_t samples = topk_sample_count(n);
  const int64_t rank =
      approximate ? topk_approx_rank(k, n, samples) : topk_exact_rank(k, n, samples);
  std::vector<Candidates> cands(num_chunks(n));
  // Share of entries the sample threshold is expected to keep (sizes the candidate lists);
  // after a miss, the histogram threshold keeps k plus at most one bin.
  const double keep = rank >= samples ? 1.0 : (double)(rank + 1) / (double)samples;
  const double safe_keep = std::min(1.0, 2.0 * (double)k / (double)n);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "topk_compress", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const uint32_t thr = sample_threshold(xp, res, n, rank, key);
    if (res != nullptr) {
      collect<scalar_t, true>(xp, res, n, thr, keep, cands);
    } else {
      collect<scalar_t, false>(xp, nullptr, n, thr, keep, cands);
    }
    if (total_candidates(cands) >= k) {
      emit_best(cands, k, thr, w);
    } else if (approximate) {
      // res already holds e after the fused pass.
      emit_padded(cands, k, w, [&](int64_t i) {
        return res != nullptr ? res[i] : canonical(static_cast<float>(xp[i]));
      });
    } else if (res != nullptr) {
      const uint32_t safe = histogram_threshold(res, n, k);
      collect<float, false>(res, nullptr, n, safe, safe_keep, cands);
      emit_best(cands, k, safe, w);
    } else {
      const uint32_t safe = histogram_threshold(xp, n, k);
      collect<scalar_t, false>(xp, nullptr, n, safe, safe_keep, cands);
      emit_best(cands, k, safe, w);
    }
  });
}

// Checks that every row's indices are strictly increasing and below numel, so rows can be
// scattered in parallel without races and never write out of bounds.
void check_rows(const uint8_t* in, int64_t rows, int64_t row_bytes, int64_t k, int64_t numel) {
  std::vector<int64_t> bad(rows, -1);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* idx = reinterpret_cast<const int32_t*>(in + r * row_bytes);
      int64_t prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        if (idx[j] <= prev || idx[j] >= numel) {
          bad[r] = j;
          break;
        }
        prev = idx[j];
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(bad[r] < 0, "sparse_accumulate: payloads row ", r, " holds index ",
                reinterpret_cast<const int32_t*>(in + r * row_bytes)[bad[r]], " at position ",
                bad[r], ": indices must be strictly increasing and in [0, numel=", numel, ")");
  }
}

// Elements of `out` per task of the sum: an fp32 slice of this size stays in L2 while the
// rows are added into it and it is divided and stored, so `out` is written once and read
// never (filling a bucket-sized sum, adding, then dividing it in a second pass moved three
// times the bytes: 12 ms instead of under 3 for 16M elements at 1% on 2 cores).
constexpr int64_t kSumSlice = 1 << 14;

// Where the indices of a strictly increasing row reach `i`. Rows that were not validated
// (check=False) may be in any order: the search then lands anywhere in [0, k], and
// sum_slice's bounds test still keeps every write inside the slice.
int64_t first_at_or_above(const int32_t* idx, int64_t k, int64_t i) {
  return std::lower_bound(idx, idx + k, i, [](int32_t a, int64_t b) { return a < b; }) - idx;
}

// sparse_accumulate's fp32 sum of this many bytes or more is written with streaming stores:
// a plain store first reads the line it writes (4 bytes read for every 4 written, where a
// 1%-dense sum writes almost nothing else) and leaves it in a cache that several MB evict
// again anyway; vmovntps writes whole lines and reads nothing. 64 MiB, 2 rows at 1%, runs
// taking turns with the plain stores: 3.8-5.5 ms -> 2.4-3.3 on two threads (0.83-0.86 of a
// copy's time -> 0.53-0.66), 5.9-7.9 -> 5.4-7.5 on one.
constexpr int64_t kStreamBytes = 4 << 20;

// Whether a float result of n elements at p is streamed: large, and 32-byte aligned (the
// kernels' vector offsets are multiples of 8 elements from p).
inline bool streams(const void* p, int64_t n) {
  return DDPCOMM_HAVE_AVX2 && n * (int64_t)sizeof(float) >= kStreamBytes &&
         (reinterpret_cast<uintptr_t>(p) & 31) == 0;
}

// Orders a task's streaming stores before whatever reads their lines after it: they are
// weakly ordered, and the thread pool's join alone does not order them.
inline void stream_fence() {
#if DDPCOMM_HAVE_AVX2
  _mm_sfence();
#endif
}

// out[i] = canonical(acc[i] / div) for i < len, streamed (out 32-byte aligned). A power-of-two
// div (the world size, usually) multiplies by its inverse instead: the same bits, and a
// divide for every element of a 1%-dense sum costs more than a multiply.
inline void stream_quotients(const float* acc, int64_t len, float div, float* out) {
  int64_t i = 0;
#if DDPCOMM_HAVE_AVX2
  const bool pow2 = (float_bits(div) & 0x007FFFFFu) == 0;
  const __m256 d = _mm256_set1_ps(div), inv = _mm256_set1_ps(1.0f / div);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)kCanonicalNanF32));
  for (; i + 8 <= len; i += 8) {
    const __m256 a = _mm256_loadu_ps(acc + i);
    const __m256 q = pow2 ? _mm256_mul_ps(a, inv) : _mm256_div_ps(a, d);
    _mm256_stream_ps(out + i, _mm256_blendv_ps(q, nan, _mm256_cmp_ps(q, q, _CMP_UNORD_Q)));
  }
#endif
  for (; i < len; ++i) out[i] = canonical(acc[i] / div);
}

// out[i0, i1) = (sum of the rows' values at i, in row order, from 0) / divisor, 0 where no
// row holds i. `acc` is this task's fp32 slice of kSumSlice elements; `spans` has a room
// per row for the range of its entries that fall in the slice. A streamed fp32 `out`
// is written whole from acc, 0 / divisor being the 0 of an element no row holds.
template <typename V, typename O>
void sum_slice(const uint8_t* in, int64_t rows, int64_t row_bytes, int64_t k, int64_t i0,
               int64_t i1, bool whole_rows, float div, bool stream, float* acc, O* out,
               std::vector<std::pair<int64_t, int64_t>>& spans) {
  // One slice covering [0, numel) takes whole rows (no search, any order).
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* idx = reinterpret_cast<const int32_t*>(in + r * row_bytes);
    spans[r] = whole_rows
                   ? std::make_pair(int64_t{0}, k)
                   : std::make_pair(first_at_or_above(idx, k, i0), first_at_or_above(idx, k, i1));
  }
  // Calls fn(i - i0, value) for every entry in the slice, row by row in rank order.
  const auto each_entry = [&](auto&& fn) {
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* idx = reinterpret_cast<const int32_t*>(in + r * row_bytes);
      const V* val = reinterpret_cast<const V*>(in + r * row_bytes + 4 * k);
      for (int64_t j = spans[r].first; j < spans[r].second; ++j) {
        const int64_t i = idx[j];
        if (i >= i0 && i < i1) fn(i - i0, val[j]);
      }
    }
  };
  std::fill(acc, acc + (i1 - i0), 0.0f);
  // Rank order, so duplicates across ranks sum in rank order.
  each_entry([&](int64_t s, V v) { acc[s] = canonical(acc[s] + static_cast<float>(v)); });
  if constexpr (std::is_same_v<O, float>) {
    if (stream) return stream_quotients(acc, i1 - i0, div, out + i0);
  }
  std::fill(out + i0, out + i1, static_cast<O>(0.0f));
  // Every index a row holds is stored; an index in two rows, twice alike.
  each_entry([&](int64_t s, V) { out[i0 + s] = static_cast<O>(canonical(acc[s] / div)); });
}

// Sums the rows into `out` (numel elements), divided by `divisor`, slice by slice.
void accumulate_rows(const at::Tensor& payloads, const at::Tensor& out, int64_t k, int64_t divisor,
                     at::ScalarType value_dtype, bool check) {
  const int64_t numel = out.numel();
  const at::Tensor pc = payloads.contiguous();
  const int64_t rows = pc.size(0), row_bytes = pc.size(1);
  const uint8_t* in = pc.data_ptr<uint8_t>();
  if (check) check_rows(in, rows, row_bytes, k, numel);
  const int64_t slices = (numel + kSumSlice - 1) / kSumSlice;
  const float div = (float)divisor;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, value_dtype, "sparse_accumulate", [&] {
    using V = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, out.scalar_type(), "sparse_accumulate", [&] {
          scalar_t* o = out.data_ptr<scalar_t>();
          const bool stream = std::is_same_v<scalar_t, float> && streams(o, numel);
          at::parallel_for(0, slices, 1, [&](int64_t s0, int64_t s1) {
            std::vector<float> acc(kSumSlice);
            std::vector<std::pair<int64_t, int64_t>> spans(rows);
            for (int64_t s = s0; s < s1; ++s) {
              const int64_t i0 = s * kSumSlice, i1 = std::min(numel, i0 + kSumSlice);
              sum_slice<V, scalar_t>(in, rows, row_bytes, k, i0, i1, slices == 1, div, stream,
                                     acc.data(), o, spans);
            }
            if (stream) stream_fence();
          });
        });
  });
}

void sparse_accumulate_into_cpu(const at::Tensor& payloads, const at::Tensor& out, int64_t k,
                                int64_t divisor, at::ScalarType value_dtype, bool check) {
  check_sparse_accumulate(payloads, out, k, divisor, value_dtype);
  accumulate_rows(payloads, out, k, divisor, value_dtype, check);
}

}  // namespace

void register_topk(torch::Library& m) {
  m.impl("topk_compress_into", &topk_compress_into_cpu);
  m.impl("sparse_accumulate_into", &sparse_accumulate_into_cpu);
}

}  // namespace ddpcomm::DDPCOMM_ISA
