// CUDA kernels of the sparsification family: topk_compress (exact and approximate),
// sparse_accumulate, randk_compress, randk_decompress. Selection order, sampling, strata and the
// payload layout come from csrc/numerics.h, so indices and values equal the CPU ops' bit for bit.
//
// Launch geometry and why
// -----------------------
// Dense passes (the EF add, candidate counts, compactions) cut the bucket into tiles of kTile =
// 4096 elements, one CTA of 256 threads each; a tile is walked in 16 rounds of 256 consecutive
// elements, so loads are coalesced and a round's survivors get their output slots, in index order,
// from one warp-ballot block scan. Tiles learn their global output offset from an exclusive scan of
// per-tile counts (one CTA). Payloads are therefore written in ascending index order without
// sorting.
//
// topk_compress, as on CPU, and without a host synchronization: (1) one CTA gathers the threshold
// sample (numerics.h) and finds its rank-th largest key by radix select; (2) a fused pass adds the
// residual, stores e back and counts the entries at or above the threshold per tile; (3) one
// thread reads the candidate total and picks the path on the device. Compact (at least k
// candidates, and they fit a buffer the host sized at ~2x the sample's expectation): the
// candidates are compacted in index order and the selection runs over them. Dense (exact mode
// with fewer than k candidates, or more than fit): the selection runs over every entry, so exact
// mode never depends on the sample. Either way (4) a radix select over the keys (11 + 10 + 10
// bits, CTA histograms merged with atomics, one tiny kernel per digit) finds the k-th largest key
// T and how many of the entries equal to T (the lowest-index ones) still fit, then (5) a count
// pass and a write pass emit the winners in index order. Padded (approximate mode with fewer than
// k candidates): one ordered pass writes the candidates plus the lowest-index non-candidates.
// Every kernel of every path is launched; those of the paths not taken exit at once.
//
// sparse_accumulate: one CTA per 4096-element output tile keeps the tile's fp32 sums in shared
// memory and applies the rows in rank order (a barrier between rows); each row's entries inside the
// tile come from a boundary table built in one coalesced pass over the (sorted) indices, so the
// dense output is written exactly once. With check=True the indices are validated first, like the
// CPU op does, and the binding raises before anything is scattered.
//
// randk: an elementwise pass (EF add, non-finite flag) and one thread per stratum, over the strata
// [j0, j1) asked for and their elements only.

#include <cuda_runtime.h>
#include <stdint.h>

#include "../numerics.h"
#include "elements.cuh"
#include "launchers.h"

namespace ddpcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRounds = 16;
constexpr int64_t kTile = (int64_t)kThreads * kRounds;  // 4096 elements
constexpr int kWarps = kThreads / 32;

// Tiles of kTile over [0, n).
__host__ __device__ __forceinline__ int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// Little-endian reads that tolerate any alignment (payload rows of fp16 values with odd k start 2
// bytes off a word boundary).
__device__ __forceinline__ int32_t load_i32(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const int32_t*>(p);
  return (int32_t)((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                   ((uint32_t)p[3] << 24));
}

__device__ __forceinline__ float load_value(const uint8_t* p, FloatType t, bool aligned) {
  if (t == FloatType::kFloat32) return __int_as_float(load_i32(p, aligned));
  const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
  return t == FloatType::kFloat16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
}

// ---------------------------------------------------------------------------------------
// Block-wide ordered compaction: exclusive prefix of a 0/1 flag over the CTA's threads in thread
// order, and the round's total. `warp_sums` is kWarps ints of shared memory that the caller does
// not touch until the next call has passed its first barrier.
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ int block_prefix(bool flag, int* warp_sums, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  __syncthreads();  // the previous round's readers are done with warp_sums
  if (lane == 0) warp_sums[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    total += s;
  }
  return before + in_warp;
}

__device__ __forceinline__ int64_t block_sum(int64_t v, int64_t* red) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  int64_t t = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += red[w];
  return t;
}

// Exclusive scan of counts[0, n) into offsets[0, n) and *total, by one CTA. With
// `tiles_over`, n is tiles_of(*tiles_over) instead: a length known only on the device.
__global__ void __launch_bounds__(1024)
    exclusive_scan_kernel(const int64_t* counts, int64_t n, const int64_t* tiles_over,
                          int64_t* offsets, int64_t* total) {
  __shared__ int64_t sums[1024];
  if (tiles_over != nullptr) n = tiles_of(*tiles_over);
  const int t = threadIdx.x;
  const int64_t per = (n + 1023) / 1024, lo = t * per, hi = lo + per < n ? lo + per : n;
  int64_t s = 0;
  for (int64_t i = lo; i < hi; ++i) s += counts[i];
  sums[t] = s;
  __syncthreads();
  // Hillis-Steele inclusive scan of the 1024 thread sums.
  for (int off = 1; off < 1024; off <<= 1) {
    const int64_t add = t >= off ? sums[t - off] : 0;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  int64_t run = t == 0 ? 0 : sums[t - 1];
  for (int64_t i = lo; i < hi; ++i) {
    offsets[i] = run;
    run += counts[i];
  }
  if (t == 1023) *total = sums[1023];
}

// ---------------------------------------------------------------------------------------
// topk_compress
// ---------------------------------------------------------------------------------------

// e at element i, canonical (numerics.h: every NaN one bit pattern, so keys and values match
// the CPU's): x (+ residual) before the fused pass; after it, the residual holds e.
struct EView {
  const void* x;
  FloatType x_type;
  const float* residual;
  __device__ __forceinline__ float at(int64_t i) const {
    const float v = load_elem(x, x_type, i);
    return canonical(residual != nullptr ? v + residual[i] : v);
  }
  // After the fused pass (residual already holds e).
  __device__ __forceinline__ float after(int64_t i) const {
    return residual != nullptr ? residual[i] : canonical(load_elem(x, x_type, i));
  }
};

// What the selection runs over, decided on the device by topk_decide_kernel: the compacted
// candidates, every entry (the candidates were too many for their buffer, or exact mode got
// too few), or nothing (approximate mode with too few candidates: the padded pass instead).
enum TopkMode : int { kCompact = 0, kDense = 1, kPadded = 2 };

// Device-side state of one top-k selection, in the workspace.
struct TopkState {
  uint32_t threshold;  // candidates have magnitude_key >= threshold
  uint32_t prefix;     // radix select: key bits found so far, then the k-th largest key T
  int64_t need;        // radix select: rank still to find (1-based), then ties of T to take
  int64_t candidates;  // entries at or above the threshold (the count pass)
  int64_t count;       // entries the selection runs over (candidates or n; 0 when padded)
  int mode;            // TopkMode
  int64_t scratch;     // unused scan totals land here
};

// Radix select by one CTA over `count` keys in global memory: the rank-th largest (0-based) of
// keys[i] & 0x7fffffff. Four digits: bits 30..24, 23..16, 15..8, 7..0.
__global__ void __launch_bounds__(1024)
    sample_threshold_kernel(EView ev, int64_t n, int64_t samples, int64_t rank, uint64_t rng_key,
                            uint32_t* keys, TopkState* st) {
  __shared__ unsigned hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int64_t need_s;
  const int t = threadIdx.x;
  if (rank >= samples) {
    if (t == 0) st->threshold = 0;  // "keep everything", as numerics.h says
    return;
  }
  for (int64_t j = t; j < samples; j += 1024) {
    keys[j] = magnitude_key(ev.at(topk_sample_index(rng_key, j, n)));
  }
  if (t == 0) {
    prefix_s = 0;
    need_s = rank + 1;  // 1-based rank among keys sorted descending
  }
  __syncthreads();
  const int shifts[4] = {24, 16, 8, 0};
  for (int d = 0; d < 4; ++d) {
    const int shift = shifts[d];
    if (t < 256) hist[t] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int64_t j = t; j < samples; j += 1024) {
      const uint32_t k = keys[j];
      // Keys whose digits above this one match the prefix found so far.
      if (d == 0 || (k >> (shift + 8)) == prefix) atomicAdd(&hist[(k >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (t == 0) {
      int64_t need = need_s;
      int digit = 255;
      for (; digit > 0; --digit) {
        if ((int64_t)hist[digit] >= need) break;
        need -= hist[digit];
      }
      prefix_s = (prefix << 8) | (uint32_t)digit;
      need_s = need;
    }
    __syncthreads();
  }
  if (t == 0) st->threshold = prefix_s;
}

// Fused pass: e = x + residual stored back into the residual (fuse), and per-tile counts of entries
// with magnitude_key(e) >= threshold.
__global__ void __launch_bounds__(kThreads)
    candidate_count_kernel(EView ev, float* residual, int64_t n, bool fuse, const TopkState* st,
                           int64_t* counts) {
  __shared__ int64_t red[kWarps];
  const uint32_t thr = st->threshold;
  const int64_t base = (int64_t)blockIdx.x * kTile;
  int64_t c = 0;
#pragma unroll 4
  for (int q = 0; q < kRounds; ++q) {
    const int64_t i = base + q * kThreads + threadIdx.x;
    if (i >= n) break;
    float e;
    if (fuse) {
      e = ev.at(i);
      residual[i] = e;
    } else {
      e = ev.after(i);
    }
    c += magnitude_key(e) >= thr ? 1 : 0;
  }
  const int64_t total = block_sum(c, red);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// Picks the path from the candidate count, on the device, so the host never waits for it:
// compacted candidates when they are at least k and fit their buffer, every entry when exact
// mode got fewer than k (its result never depends on the sample) or they do not fit, and
// the padded pass when approximate mode got fewer than k. Starts the radix select. One thread.
__global__ void topk_decide_kernel(TopkState* st, int64_t n, int64_t k, bool approximate,
                                   int64_t capacity) {
  const int64_t c = st->candidates;
  if (c >= k && c <= capacity) {
    st->mode = kCompact;
    st->count = c;
  } else if (c < k && approximate) {
    st->mode = kPadded;
    st->count = 0;
  } else {
    st->mode = kDense;
    st->count = n;
  }
  st->prefix = 0;
  st->need = k;
}

// Ordered compaction of the candidates (compact mode only): bits of e and index, in index
// order. CTAs stride over the tiles of [0, n).
__global__ void __launch_bounds__(kThreads)
    candidate_compact_kernel(EView ev, int64_t n, const TopkState* st, const int64_t* offsets,
                             uint32_t* cand_bits, int32_t* cand_index) {
  __shared__ int warp_sums[kWarps];
  if (st->mode != kCompact) return;
  const uint32_t thr = st->threshold;
  for (int64_t tile = blockIdx.x; tile < tiles_of(n); tile += gridDim.x) {
    const int64_t base = tile * kTile;
    int64_t out = offsets[tile];
    for (int q = 0; q < kRounds; ++q) {
      const int64_t i = base + q * kThreads + threadIdx.x;
      uint32_t bits = 0;
      bool keep = false;
      if (i < n) {
        bits = float_bits(ev.after(i));
        keep = (bits & 0x7fffffffu) >= thr;
      }
      int total;
      const int pos = block_prefix(keep, warp_sums, total);
      if (keep) {
        cand_bits[out + pos] = bits;
        cand_index[out + pos] = (int32_t)i;
      }
      out += total;
    }
  }
}

// Entry j of what the selection runs over: candidate j (compact mode) or element j (dense).
struct SelectSource {
  const uint32_t* cand_bits;
  const int32_t* cand_index;
  EView ev;
  bool dense;
  __device__ __forceinline__ uint32_t bits(int64_t j) const {
    return dense ? float_bits(ev.after(j)) : cand_bits[j];
  }
  __device__ __forceinline__ int64_t index(int64_t j) const { return dense ? j : cand_index[j]; }
};

// One digit of the radix select over the source's keys: histogram of the keys whose higher
// digits equal the prefix found so far (all keys for the first digit).
__global__ void __launch_bounds__(kThreads)
    radix_hist_kernel(SelectSource src, const TopkState* st, int shift, int width, bool first,
                      unsigned* hist) {
  __shared__ unsigned h[2048];
  if (st->mode == kPadded) return;
  src.dense = st->mode == kDense;
  for (int b = threadIdx.x; b < (1 << width); b += kThreads) h[b] = 0;
  __syncthreads();
  const int64_t count = st->count;
  const uint32_t prefix = st->prefix;
  const uint32_t mask = (1u << width) - 1u;
  for (int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x; j < count;
       j += (int64_t)gridDim.x * kThreads) {
    const uint32_t k = src.bits(j) & 0x7fffffffu;
    if (first || (k >> (shift + width)) == prefix) atomicAdd(&h[(k >> shift) & mask], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < (1 << width); b += kThreads) {
    if (h[b] != 0) atomicAdd(&hist[b], h[b]);
  }
}

// Picks the digit holding the need-th largest key, from the top digit down; clears the histogram
// for the next digit. One thread.
__global__ void radix_pick_kernel(unsigned* hist, int width, TopkState* st) {
  if (st->mode == kPadded) return;
  int64_t need = st->need;
  int digit = (1 << width) - 1;
  for (; digit > 0; --digit) {
    if ((int64_t)hist[digit] >= need) break;
    need -= hist[digit];
  }
  st->prefix = (st->prefix << width) | (uint32_t)digit;
  st->need = need;
  for (int b = 0; b < (1 << width); ++b) hist[b] = 0;
}

// Per tile of the source: entries with key > T, and ties (key == T).
__global__ void __launch_bounds__(kThreads)
    winner_count_kernel(SelectSource src, const TopkState* st, int64_t* above, int64_t* ties) {
  __shared__ int64_t red[kWarps];
  src.dense = st->mode == kDense;
  const uint32_t T = st->prefix;
  const int64_t count = st->count;
  for (int64_t tile = blockIdx.x; tile < tiles_of(count); tile += gridDim.x) {
    const int64_t base = tile * kTile;
    int64_t a = 0, q = 0;
    for (int r = 0; r < kRounds; ++r) {
      const int64_t j = base + r * kThreads + threadIdx.x;
      if (j >= count) break;
      const uint32_t k = src.bits(j) & 0x7fffffffu;
      a += k > T ? 1 : 0;
      q += k == T ? 1 : 0;
    }
    const int64_t sa = block_sum(a, red);
    const int64_t sq = block_sum(q, red);
    if (threadIdx.x == 0) {
      above[tile] = sa;
      ties[tile] = sq;
    }
  }
}

// Writes payload entry o: index i and e cast to the value type, saturated at its largest finite
// value (numerics.h saturate); with a residual, what the cast lost stays there (0 for float32).
struct PayloadOut {
  int32_t* index;
  void* values;
  FloatType value_type;
  float* residual;
  __device__ __forceinline__ void put(int64_t o, int64_t i, float e) const {
    index[o] = (int32_t)i;
    const float max_finite = value_type == FloatType::kFloat16    ? kMaxFloat16
                             : value_type == FloatType::kBFloat16 ? kMaxBFloat16
                                                                  : kMaxFloat32;
    const float sent = store_elem(values, value_type, o, saturate(e, max_finite));
    if (residual != nullptr) residual[i] = canonical(e - sent);
  }
};

// Ordered write of the winners: key > T, or key == T among the first `need` ties.
__global__ void __launch_bounds__(kThreads)
    winner_emit_kernel(SelectSource src, const TopkState* st, const int64_t* above_before,
                       const int64_t* ties_before, PayloadOut out) {
  __shared__ int warp_sums[2][kWarps];
  src.dense = st->mode == kDense;
  const uint32_t T = st->prefix;
  const int64_t need = st->need, count = st->count;
  for (int64_t tile = blockIdx.x; tile < tiles_of(count); tile += gridDim.x) {
    const int64_t base = tile * kTile, t0 = ties_before[tile];
    // Winners before this tile: every entry above T plus the ties taken so far.
    int64_t o = above_before[tile] + (t0 < need ? t0 : need);
    int64_t tie_rank = t0;
    for (int r = 0; r < kRounds; ++r) {
      const int64_t j = base + r * kThreads + threadIdx.x;
      uint32_t bits = 0;
      bool is_tie = false, is_above = false;
      if (j < count) {
        bits = src.bits(j);
        const uint32_t k = bits & 0x7fffffffu;
        is_above = k > T;
        is_tie = k == T;
      }
      int ties_total;
      const int my_tie = block_prefix(is_tie, warp_sums[0], ties_total);
      const bool win = is_above || (is_tie && tie_rank + my_tie < need);
      int wins_total;
      const int pos = block_prefix(win, warp_sums[1], wins_total);
      if (win) out.put(o + pos, src.index(j), bits_float(bits));
      o += wins_total;
      tie_rank += ties_total;
    }
  }
}

// Approximate mode with fewer than k candidates (padded mode only): the candidates plus the
// lowest-index non-candidates, k in all, in index order.
__global__ void __launch_bounds__(kThreads)
    padded_emit_kernel(EView ev, int64_t n, int64_t k, const TopkState* st,
                       const int64_t* cand_before, PayloadOut out) {
  __shared__ int warp_sums[kWarps];
  if (st->mode != kPadded) return;
  const uint32_t thr = st->threshold;
  const int64_t pads = k - st->candidates;
  for (int64_t tile = blockIdx.x; tile < tiles_of(n); tile += gridDim.x) {
    const int64_t base = tile * kTile;
    int64_t cands = cand_before[tile];
    for (int q = 0; q < kRounds; ++q) {
      const int64_t i = base + q * kThreads + threadIdx.x;
      float e = 0.0f;
      bool cand = false;
      if (i < n) {
        e = ev.after(i);
        cand = magnitude_key(e) >= thr;
      }
      int total;
      const int c_before = (int)block_prefix(cand, warp_sums, total);
      if (i < n) {
        const int64_t cb = cands + c_before;  // candidates before i
        const int64_t nb = i - cb;            // non-candidates before i
        if (cand || nb < pads) out.put(cb + (nb < pads ? nb : pads), i, e);
      }
      cands += total;
    }
  }
}

// ---------------------------------------------------------------------------------------
// sparse_accumulate
// ---------------------------------------------------------------------------------------

struct SparseRows {
  const uint8_t* data;
  int64_t rows, row_bytes, k, numel;
  FloatType value_type;
  bool aligned;  // data and row_bytes are multiples of 4
  __device__ __forceinline__ const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
  __device__ __forceinline__ int32_t index(int64_t r, int64_t j) const {
    return load_i32(row(r) + 4 * j, aligned);
  }
  __device__ __forceinline__ float value(int64_t r, int64_t j, int vbytes) const {
    const uint8_t* p = row(r) + 4 * k + (int64_t)vbytes * j;
    return load_value(p, value_type, aligned);
  }
};

// Validates every row (indices strictly increasing, in [0, numel)) into bad[r] (first bad position,
// left at INT32_MAX when the row is valid) and builds the tile boundary table: start[r * (tiles +
// 1) + t] = first entry of row r with index >= t * kTile.
__global__ void __launch_bounds__(kThreads)
    sparse_index_kernel(SparseRows p, int64_t tiles, int32_t* bad, int32_t* start) {
  const int64_t total = p.rows * p.k;
  for (int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x; g < total;
       g += (int64_t)gridDim.x * kThreads) {
    const int64_t r = g / p.k, j = g - r * p.k;
    const int64_t idx = p.index(r, j);
    const int64_t prev = j > 0 ? (int64_t)p.index(r, j - 1) : -1;
    if (bad != nullptr && (idx <= prev || idx >= p.numel)) atomicMin(&bad[r], (int32_t)j);
    // Tiles (tile(prev), tile(idx)] start at entry j; clamped so bad rows stay in bounds.
    const int64_t t_prev = prev < 0 ? -1 : prev / kTile;
    int64_t t_hi = idx < 0 ? -1 : idx / kTile;
    t_hi = t_hi < tiles ? t_hi : tiles - 1;
    int32_t* row_start = start + r * (tiles + 1);
    for (int64_t t = t_prev + 1; t <= t_hi; ++t) row_start[t] = (int32_t)j;
    if (j == p.k - 1) {
      const int64_t t_last = idx < 0 ? -1 : (idx / kTile < tiles ? idx / kTile : tiles - 1);
      for (int64_t t = t_last + 1; t <= tiles; ++t) row_start[t] = (int32_t)p.k;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    sparse_accumulate_kernel(SparseRows p, int64_t tiles, const int32_t* start, float divisor,
                             void* out, FloatType out_type) {
  __shared__ float acc[kTile];
  const int64_t t = blockIdx.x, base = t * kTile;
  for (int i = threadIdx.x; i < kTile; i += kThreads) acc[i] = 0.0f;
  const int vbytes = p.value_type == FloatType::kFloat32 ? 4 : 2;
  for (int64_t r = 0; r < p.rows; ++r) {
    // Row r - 1 (or the zero fill) is complete: rank order per element.
    __syncthreads();
    const int32_t* row_start = start + r * (tiles + 1);
    const int64_t j0 = row_start[t], j1 = row_start[t + 1];
    // Indices are distinct within a row: no two threads touch the same sum. An unvalidated
    // row (check=False) may hold indices of another tile here: skipped, never out of bounds.
    for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
      const int64_t i = p.index(r, j) - base;
      if (i >= 0 && i < kTile) acc[i] = acc[i] + p.value(r, j, vbytes);
    }
  }
  __syncthreads();
  const int64_t len = p.numel - base < kTile ? p.numel - base : kTile;
  // x / 1 == x exactly: skipping the division for divisor 1 changes no bit.
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    store_elem(out, out_type, base + i, divisor != 1.0f ? acc[i] / divisor : acc[i]);
  }
}

// ---------------------------------------------------------------------------------------
// randk
// ---------------------------------------------------------------------------------------

// Over the elements [lo, hi) of strata [j0, j1): e = x (+ residual, stored back); flag = 1 if
// any e there is non-finite.
__global__ void __launch_bounds__(kThreads)
    randk_scan_kernel(const void* x, FloatType x_type, float* residual, int64_t lo, int64_t hi,
                      int* flag) {
  bool finite = true;
  for (int64_t i = lo + (int64_t)blockIdx.x * kThreads + threadIdx.x; i < hi;
       i += (int64_t)gridDim.x * kThreads) {
    float e = load_elem(x, x_type, i);
    if (residual != nullptr) {
      e = canonical(e + residual[i]);
      residual[i] = e;
    }
    finite &= is_finite(e);
  }
  if (__any_sync(0xffffffffu, !finite) && (threadIdx.x & 31) == 0) *flag = 1;
}

// One thread per stratum j in [j0, j1).
__global__ void __launch_bounds__(kThreads)
    randk_gather_kernel(const void* x, FloatType x_type, float* residual, int64_t n, int64_t k,
                        int64_t j0, int64_t j1, uint64_t key, const int* flag, float* values) {
  const int64_t j = j0 + (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (j >= j1) return;
  const int64_t i = randk_index(key, j, n, k);
  float v;
  if (residual != nullptr) {
    v = residual[i];
    residual[i] = 0.0f;
  } else {
    v = load_elem(x, x_type, i);
  }
  values[j] = *flag ? canonical_nan() : v;
}

__global__ void __launch_bounds__(kThreads)
    randk_scatter_kernel(const float* values, int64_t n, int64_t k, int64_t j0, int64_t j1,
                         uint64_t key, float divisor, void* out, FloatType out_type) {
  const int64_t j = j0 + (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (j >= j1) return;
  store_elem(out, out_type, randk_index(key, j, n, k), values[j] / divisor);
}

unsigned grid_for(int64_t work, int64_t per_cta, int64_t cap) {
  int64_t g = (work + per_cta - 1) / per_cta;
  if (g < 1) g = 1;
  return (unsigned)(g < cap ? g : cap);
}

// Workspace of topk_compress: the device-side state and every buffer a path may need, sized
// on the host from n and the candidate capacity alone (nothing is read back).
struct TopkWorkspace {
  TopkState* state;
  uint32_t* sample_keys;  // kTopkSampleMax
  int64_t* counts;        // tiles_of(n): candidates per tile
  int64_t* offsets;       // tiles_of(n): candidates before each tile
  int64_t* above;         // tiles_of(n) each (the selection runs over at most n entries):
  int64_t* ties;          // entries above T and ties of T per selection tile, and the
  int64_t* above_before;  // exclusive scans of both
  int64_t* ties_before;   //
  unsigned* hist;         // 2048 radix bins
  uint32_t* cand_bits;    // capacity compacted candidates
  int32_t* cand_index;    //
};

int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

// Lays the workspace out at ws (every piece 256-byte aligned); with ws == nullptr only sizes
// it. Returns its bytes.
int64_t carve(uint8_t* ws, int64_t n, int64_t capacity, TopkWorkspace& w) {
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    uint8_t* p = ws != nullptr ? ws + off : nullptr;
    off += align256(bytes);
    return p;
  };
  const int64_t tiles = tiles_of(n);
  w.state = reinterpret_cast<TopkState*>(take(sizeof(TopkState)));
  w.sample_keys = reinterpret_cast<uint32_t*>(take(4 * kTopkSampleMax));
  int64_t** per_tile[] = {&w.counts, &w.offsets,      &w.above,
                          &w.ties,   &w.above_before, &w.ties_before};
  for (int64_t** p : per_tile) *p = reinterpret_cast<int64_t*>(take(8 * tiles));
  w.hist = reinterpret_cast<unsigned*>(take(4 * 2048));
  w.cand_bits = reinterpret_cast<uint32_t*>(take(4 * capacity));
  w.cand_index = reinterpret_cast<int32_t*>(take(4 * capacity));
  return off;
}

EView eview(const TopkArgs& a) { return EView{a.x, a.x_type, a.residual}; }

PayloadOut payload_out(const TopkArgs& a) {
  return PayloadOut{reinterpret_cast<int32_t*>(a.out), a.out + 4 * a.k, a.value_type, a.residual};
}

bool topk_args_ok(const TopkArgs& a) {
  return a.n >= 1 && a.n <= 0x7fffffffLL && a.k >= 1 && a.k <= a.n && a.out != nullptr &&
         a.capacity >= 0 && a.capacity <= a.n;
}

}  // namespace

int64_t topk_candidate_capacity(int64_t n, int64_t samples, int64_t sample_rank) {
  // Threshold 0 (a ratio near 1, or a bucket smaller than the sample): every entry is a
  // candidate, so topk_decide_kernel takes the dense mode, which selects over x itself. A
  // capacity of n would only add 8 bytes per element of workspace that no path reads.
  if (sample_rank >= samples) return 0;
  // The threshold keeps about (rank + 1) / samples of the entries; twice that plus a few tiles
  // absorbs the sample's error and ties at the threshold. Beyond it, the dense path.
  const int64_t expect = (sample_rank + 1) * n / samples;
  const int64_t capacity = 2 * expect + 4 * kTile;
  return capacity < n ? capacity : n;
}

int64_t topk_workspace_bytes(int64_t n, int64_t capacity) {
  TopkWorkspace w;
  return carve(nullptr, n, capacity, w);
}

cudaError_t launch_topk_compress(const TopkArgs& a, void* workspace, cudaStream_t stream) {
  if (!topk_args_ok(a) || workspace == nullptr) return cudaErrorInvalidValue;
  TopkWorkspace w;
  carve(static_cast<uint8_t*>(workspace), a.n, a.capacity, w);
  const EView ev = eview(a);
  const PayloadOut out = payload_out(a);
  const int64_t tiles = tiles_of(a.n);
  // Passes over tiles stride with at most 1024 CTAs; those of a path not taken exit at once.
  const unsigned tile_grid = grid_for(a.n, kTile, 1024);

  // (1) Threshold from the sample; (2) the fused EF add and per-tile candidate counts, scanned.
  sample_threshold_kernel<<<1, 1024, 0, stream>>>(ev, a.n, a.samples, a.sample_rank, a.rng_key,
                                                  w.sample_keys, w.state);
  candidate_count_kernel<<<(unsigned)tiles, kThreads, 0, stream>>>(
      ev, a.residual, a.n, a.residual != nullptr, w.state, w.counts);
  exclusive_scan_kernel<<<1, 1024, 0, stream>>>(w.counts, tiles, nullptr, w.offsets,
                                                &w.state->candidates);
  // (3) The path, chosen on the device; the padded pass or the compaction (or neither).
  topk_decide_kernel<<<1, 1, 0, stream>>>(w.state, a.n, a.k, a.approximate, a.capacity);
  padded_emit_kernel<<<tile_grid, kThreads, 0, stream>>>(ev, a.n, a.k, w.state, w.offsets, out);
  candidate_compact_kernel<<<tile_grid, kThreads, 0, stream>>>(ev, a.n, w.state, w.offsets,
                                                               w.cand_bits, w.cand_index);
  // (4) Radix select of the k-th largest key (11 + 10 + 10 bits) over the source. Its grid fits
  // the compacted candidates; the dense fallback strides through n with the same CTAs.
  const cudaError_t err = cudaMemsetAsync(w.hist, 0, 4 * 2048, stream);
  if (err != cudaSuccess) return err;
  const SelectSource src{w.cand_bits, w.cand_index, ev, false};
  // Capacity 0 means the dense mode for certain (every entry is a candidate): size for n.
  const int64_t source = a.capacity > 0 ? a.capacity : a.n;
  const unsigned hist_grid = grid_for(source, (int64_t)kThreads * 16, 1024);
  const int shifts[3] = {20, 10, 0}, widths[3] = {11, 10, 10};
  for (int d = 0; d < 3; ++d) {
    radix_hist_kernel<<<hist_grid, kThreads, 0, stream>>>(src, w.state, shifts[d], widths[d],
                                                          d == 0, w.hist);
    radix_pick_kernel<<<1, 1, 0, stream>>>(w.hist, widths[d], w.state);
  }
  // (5) Winners per tile of the source, their offsets, the ordered write.
  winner_count_kernel<<<tile_grid, kThreads, 0, stream>>>(src, w.state, w.above, w.ties);
  exclusive_scan_kernel<<<1, 1024, 0, stream>>>(w.above, 0, &w.state->count, w.above_before,
                                                &w.state->scratch);
  exclusive_scan_kernel<<<1, 1024, 0, stream>>>(w.ties, 0, &w.state->count, w.ties_before,
                                                &w.state->scratch);
  winner_emit_kernel<<<tile_grid, kThreads, 0, stream>>>(src, w.state, w.above_before,
                                                         w.ties_before, out);
  return cudaGetLastError();
}

// ---- sparse_accumulate ----

int64_t sparse_tiles(int64_t numel) { return tiles_of(numel); }

namespace {
SparseRows sparse_rows(const SparsePayloads& p) {
  const bool aligned = (reinterpret_cast<uintptr_t>(p.data) & 3u) == 0 && (p.row_bytes & 3) == 0;
  return SparseRows{p.data, p.rows, p.row_bytes, p.k, p.numel, p.value_type, aligned};
}
}  // namespace

cudaError_t launch_sparse_index(const SparsePayloads& p, int32_t* bad, int32_t* start,
                                cudaStream_t stream) {
  if (p.rows < 0 || p.k < 1 || p.numel < 1) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  sparse_index_kernel<<<grid_for(p.rows * p.k, kThreads, 8192), kThreads, 0, stream>>>(
      sparse_rows(p), tiles_of(p.numel), bad, start);
  return cudaGetLastError();
}

cudaError_t launch_sparse_accumulate(const SparsePayloads& p, const int32_t* start, int64_t divisor,
                                     void* out, FloatType out_type, cudaStream_t stream) {
  if (p.rows < 0 || p.k < 1 || p.numel < 1 || divisor < 1) return cudaErrorInvalidValue;
  const int64_t tiles = tiles_of(p.numel);
  if (tiles > 0x7fffffffLL) return cudaErrorInvalidValue;
  sparse_accumulate_kernel<<<(unsigned)tiles, kThreads, 0, stream>>>(sparse_rows(p), tiles, start,
                                                                     (float)divisor, out, out_type);
  return cudaGetLastError();
}

// ---- randk ----

cudaError_t launch_randk_compress(const void* x, FloatType x_type, float* residual, int64_t n,
                                  int64_t k, int64_t j0, int64_t j1, uint64_t key, float* values,
                                  int* flag, cudaStream_t stream) {
  if (n < 1 || k < 1 || k > n || j0 < 0 || j0 > j1 || j1 > k) return cudaErrorInvalidValue;
  if (j0 == j1) return cudaSuccess;
  const int64_t lo = j0 * n / k, hi = j1 * n / k;  // the strata's elements (numerics.h)
  cudaError_t err = cudaMemsetAsync(flag, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  randk_scan_kernel<<<grid_for(hi - lo, (int64_t)kThreads * 8, 8192), kThreads, 0, stream>>>(
      x, x_type, residual, lo, hi, flag);
  randk_gather_kernel<<<grid_for(j1 - j0, kThreads, 0x7fffffffLL), kThreads, 0, stream>>>(
      x, x_type, residual, n, k, j0, j1, key, flag, values);
  return cudaGetLastError();
}

cudaError_t launch_randk_decompress(const float* values, int64_t numel, int64_t k, int64_t j0,
                                    int64_t j1, uint64_t key, int64_t divisor, void* out,
                                    FloatType out_type, cudaStream_t stream) {
  if (numel < 1 || k < 1 || k > numel || divisor < 1 || j0 < 0 || j0 > j1 || j1 > k) {
    return cudaErrorInvalidValue;
  }
  if (j0 == j1) return cudaSuccess;
  const int64_t lo = j0 * numel / k, hi = j1 * numel / k;
  const int64_t bytes = elem_bytes(out_type);
  cudaError_t err =
      cudaMemsetAsync(static_cast<char*>(out) + lo * bytes, 0, (hi - lo) * bytes, stream);
  if (err != cudaSuccess) return err;
  randk_scatter_kernel<<<grid_for(j1 - j0, kThreads, 0x7fffffffLL), kThreads, 0, stream>>>(
      values, numel, k, j0, j1, key, (float)divisor, out, out_type);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ddpcomm
