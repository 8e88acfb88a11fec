// CUDA kernels of the quantizer family: quantize (+ error feedback, stochastic rounding),
// dequantize, dequantize_sum, dequantize_sum_requantize. Every bit of output comes from
// csrc/numerics.h, so payloads, residuals and values equal the CPU ops' bit for bit.
//
// Launch geometry and why
// -----------------------
// Every kernel runs CTAs of kThreads = 256 threads, and every thread owns "chunks" of
// kVec = 8 contiguous elements: 8 elements are one 32-byte (fp32) or 16-byte (fp16/bf16)
// vector access and exactly 8*b bits = b whole bytes of codes, so loads, stores and code
// packing need no cross-thread traffic and stay coalesced.
//
// Encode kernels (quantize, dequantize_sum_requantize) must reduce over a whole quantization
// block before the first code can be written. A block of B elements is owned by a group of
// G = min(B / 8, 256) threads of one CTA (256 / G blocks per CTA: one per 4 threads at
// B = 32, one per CTA from B = 2048 up); thread g of the group owns the R = B / (8 G) chunks
//   element  j = 8 (g + G r) + k,   r < R, k < 8,
// of its block. With this layout the deterministic 1-bit magnitude -- the pairwise tree sum
// of numerics.h, where at level w (w = B/2, ..., 1) element i adds element i + w -- splits
// along the bits of j: the top levels pair rows r (inside a thread), the middle levels pair
// threads g (warps through shared memory first, then lanes with a xor butterfly, which
// leaves every lane with the same bits because float addition commutes), the last three
// levels pair k inside the thread. Max |e| and the non-finite flag are order-independent.
// For R <= 4 (B <= 8192) the block stays in registers between the reduction and the code
// pass: each input byte is read once. Larger blocks (B >= 16384) are split over several CTAs
// each (the split path below), so that a tensor of few such blocks still fills the GPU.
//
// Decode kernels (dequantize, dequantize_sum) need no reduction: one thread per chunk, the N
// payload rows summed in row order in registers, one vector store.

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../numerics.h"
#include "elements.cuh"
#include "launchers.h"

namespace ddpcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRegRows = 4;      // rows a thread keeps in registers (B <= 8 * 256 * 4)
constexpr int kMaxStackLevels = 6;  // streaming tree over up to 32 rows (B = 65536)
// Larger blocks are split over CTAs until a launch has this many: about 4 CTAs of 256 threads
// per SM of a 132-SM H100 (a 1M-element tensor in blocks of 65536 had 16 CTAs for 132 SMs).
constexpr int64_t kFillCtas = 512;

// Loads elements [i0, i0 + 8) of p as floats, 0 past n. `vec` says p is 16-byte aligned;
// i0 is a multiple of 8, so a full chunk is then one (or two) aligned 16-byte loads.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, int64_t i0, int64_t n, bool vec,
                                      float (&v)[kVec]) {
  if (vec && i0 + kVec <= n) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = *reinterpret_cast<const float4*>(p + i0);
      const float4 b = *reinterpret_cast<const float4*>(p + i0 + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 w = *reinterpret_cast<const uint4*>(p + i0);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // Little-endian: the element at the lower address is the low half of the word.
        const uint32_t lo = words[q] & 0xffffu, hi = words[q] >> 16;
        if constexpr (std::is_same<T, __half>::value) {
          v[2 * q] = half_bits_to_float(lo), v[2 * q + 1] = half_bits_to_float(hi);
        } else {
          v[2 * q] = bf16_bits_to_float(lo), v[2 * q + 1] = bf16_bits_to_float(hi);
        }
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = i0 + k < n ? to_float(p[i0 + k]) : 0.0f;
  }
}

// Stores v[0, 8) to elements [i0, i0 + 8) of p, only those below n. Every value goes through
// from_float, so NaNs are stored canonical (numerics.h).
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, int64_t i0, int64_t n, bool vec,
                                       const float (&v)[kVec]) {
  if (vec && i0 + kVec <= n) {
    if constexpr (sizeof(T) == 4) {
      float c[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) c[k] = from_float<float>(v[k]);
      *reinterpret_cast<float4*>(p + i0) = make_float4(c[0], c[1], c[2], c[3]);
      *reinterpret_cast<float4*>(p + i0 + 4) = make_float4(c[4], c[5], c[6], c[7]);
    } else {
      uint32_t words[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        words[q] =
            to_bits16(from_float<T>(v[2 * q])) | (to_bits16(from_float<T>(v[2 * q + 1])) << 16);
      }
      *reinterpret_cast<uint4*>(p + i0) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (i0 + k < n) p[i0 + k] = from_float<T>(v[k]);
    }
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---------------------------------------------------------------------------------------
// Payload access. Records start 4-byte aligned when the payload base and row stride are
// multiples of 4 (record_bytes always is); a chunk's 8*b code bits then sit at a multiple
// of b bytes past a 4-aligned address, so 8-bit codes are two 32-bit words, 4-bit one,
// 2-bit one 16-bit half-word, 1-bit one byte. Unaligned payloads (a byte slice of a larger
// buffer) are read byte by byte.
// ---------------------------------------------------------------------------------------

template <int kBits>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* p, bool aligned) {
  if (aligned) {
    if constexpr (kBits == 8) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
      return (uint64_t)w[0] | ((uint64_t)w[1] << 32);
    } else if constexpr (kBits == 4) {
      return *reinterpret_cast<const uint32_t*>(p);
    } else if constexpr (kBits == 2) {
      return *reinterpret_cast<const uint16_t*>(p);
    } else {
      return *p;
    }
  }
  uint64_t w = 0;
#pragma unroll
  for (int b = 0; b < kBits; ++b) w |= (uint64_t)p[b] << (8 * b);
  return w;
}

__device__ __forceinline__ void store_scale(uint8_t* p, float m, bool aligned) {
  if (aligned) {
    *reinterpret_cast<float*>(p) = m;
    return;
  }
  const uint32_t u = __float_as_uint(m);
#pragma unroll
  for (int b = 0; b < 4; ++b) p[b] = (uint8_t)(u >> (8 * b));
}

__device__ __forceinline__ float load_scale(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const float*>(p);
  const uint32_t u =
      (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
  return __uint_as_float(u);
}

// Packs 8 codes LSB-first (element k at bit k*b) and stores their b bytes at p: as words
// when the payload is aligned as load_codes describes, else byte by byte (an `out` that is
// a byte slice of a larger buffer).
template <int kBits>
__device__ __forceinline__ void store_codes(uint8_t* p, const uint32_t (&c)[kVec], bool aligned) {
  uint64_t w = 0;
#pragma unroll
  for (int k = 0; k < kVec; ++k) w |= (uint64_t)c[k] << (k * kBits);
  if (!aligned) {
#pragma unroll
    for (int b = 0; b < kBits; ++b) p[b] = (uint8_t)(w >> (8 * b));
  } else if constexpr (kBits == 8) {
    reinterpret_cast<uint32_t*>(p)[0] = (uint32_t)w;
    reinterpret_cast<uint32_t*>(p)[1] = (uint32_t)(w >> 32);
  } else if constexpr (kBits == 4) {
    *reinterpret_cast<uint32_t*>(p) = (uint32_t)w;
  } else if constexpr (kBits == 2) {
    *reinterpret_cast<uint16_t*>(p) = (uint16_t)w;
  } else {
    *p = (uint8_t)w;
  }
}

// What the decode side needs to find element i of row r.
struct PayloadView {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  int64_t rec;  // record_bytes(B, bits)
  int log2_block;
  bool aligned;
};

// acc[k] += value of element i0 + k of every row, rows in order (numerics.h dequantize_one).
// `levels` is the level_value table.
template <int kBits>
__device__ __forceinline__ void accumulate_rows(const PayloadView& pv, int64_t i0,
                                                const float* levels, float (&acc)[kVec]) {
  const int64_t blk = i0 >> pv.log2_block;
  const int64_t j = i0 & ((int64_t(1) << pv.log2_block) - 1);
  const uint8_t* rec = pv.data + blk * pv.rec;
  const int64_t code_off = kScaleBytes + j * kBits / 8;
  constexpr uint32_t mask = (1u << kBits) - 1u;
#pragma unroll 4
  for (int64_t r = 0; r < pv.rows; ++r, rec += pv.row_bytes) {
    const float m = load_scale(rec, pv.aligned);
    const uint64_t w = load_codes<kBits>(rec + code_off, pv.aligned);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t c = (uint32_t)(w >> (k * kBits)) & mask;
      acc[k] = acc[k] + dequantize_one(c, m, levels[c], kBits);
    }
  }
}

// Fills the shared level_value table (0 for 1-bit, as the CPU op's table). The caller
// synchronizes before use.
template <int kBits>
__device__ __forceinline__ void fill_levels(float* levels) {
  for (int c = threadIdx.x; c < (1 << kBits); c += blockDim.x) {
    levels[c] = kBits == 1 ? 0.0f : level_value((uint32_t)c, kBits);
  }
}

// ---------------------------------------------------------------------------------------
// Decode: dequantize and dequantize_sum.
// ---------------------------------------------------------------------------------------

template <int kBits, typename OutT>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(PayloadView pv, int64_t n, float divisor, const float* __restrict__ scale,
                  bool scale_vec, OutT* __restrict__ out, bool out_vec) {
  __shared__ float levels[1 << kBits];
  fill_levels<kBits>(levels);
  __syncthreads();
  const int64_t i0 = ((int64_t)blockIdx.x * kThreads + threadIdx.x) * kVec;
  if (i0 >= n) return;
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.0f;
  accumulate_rows<kBits>(pv, i0, levels, acc);
  // x / 1 == x exactly, so skipping the division for dequantize changes no bit.
  if (divisor != 1.0f) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = acc[k] / divisor;
  }
  if (scale != nullptr) {
    // The value as stored (from_float), then times the scale in fp32: a separate mul_'s bits.
    float s[kVec];
    load8<float>(scale, i0, n, scale_vec, s);
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = to_float(from_float<OutT>(acc[k])) * s[k];
  }
  store8(out, i0, n, out_vec, acc);
}

// ---------------------------------------------------------------------------------------
// Encode sources: what a chunk of the quantized vector e is, and how its residual is kept.
// load() gives the value v the residual is computed from; e = to_e(v).
// ---------------------------------------------------------------------------------------

// quantize: v = e = float(x) + residual.
template <typename T>
struct QuantizeSource {
  const T* x;
  float* residual;
  int64_t n;
  bool x_vec, res_vec;

  __device__ __forceinline__ void load(int64_t i0, const float*, float (&v)[kVec]) const {
    load8(x, i0, n, x_vec, v);
    if (residual != nullptr) {
      float r[kVec];
      load8<float>(residual, i0, n, res_vec, r);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = v[k] + r[k];
    }
  }
  __device__ __forceinline__ float to_e(float v) const { return v; }
  __device__ __forceinline__ void store_residual(int64_t i0, const float (&v)[kVec],
                                                 const float (&deq)[kVec]) const {
    float r[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = v[k] - deq[k];
    store8<float>(residual, i0, n, res_vec, r);
  }
};

// dequantize_sum_requantize: v = S = row-order sum (+ residual), e = S / divisor, and the
// residual stays in sum units: S - divisor * deq.
template <int kBits>
struct SumSource {
  PayloadView pv;
  float* residual;
  int64_t n;
  float divisor;
  bool res_vec;

  __device__ __forceinline__ void load(int64_t i0, const float* levels, float (&v)[kVec]) const {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = 0.0f;
    if (i0 >= n) return;
    accumulate_rows<kBits>(pv, i0, levels, v);
    if (residual != nullptr) {
      float r[kVec];
      load8<float>(residual, i0, n, res_vec, r);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = v[k] + r[k];
    }
    // Codes past numel in the last record are padding: the block is zero-padded there.
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = i0 + k < n ? v[k] : 0.0f;
  }
  __device__ __forceinline__ float to_e(float v) const { return v / divisor; }
  __device__ __forceinline__ void store_residual(int64_t i0, const float (&v)[kVec],
                                                 const float (&deq)[kVec]) const {
    float r[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = v[k] - divisor * deq[k];
    store8<float>(residual, i0, n, res_vec, r);
  }
};

// ---------------------------------------------------------------------------------------
// Encode.
// ---------------------------------------------------------------------------------------

struct EncodeParams {
  int64_t n;
  int64_t nblocks;
  int log2_block;
  int log2_group;  // G = threads per quantization block
  int rows;        // R = B / (8 G) chunks per thread
  bool stochastic;
  uint64_t rng_key;
  int64_t rng_offset;
  uint8_t* out;
  bool out_aligned;  // out is 4-byte aligned: scales and codes are stored as words
  int64_t rec;
  bool residual;    // write the residual
  int log2_slices;  // split path (R > kMaxRegRows): S = 2^log2_slices CTAs per block
};

// Shared scratch for the cross-warp levels of the group reduction: 8 tree partials and the
// max, per warp and lane (lane fastest: no bank conflicts).
struct ReduceScratch {
  float v[kWarps][kVec + 1][32];
};

// Reduces sum[0, kSums) with + in the tree order of the file comment, and mx with max,
// over the G = 2^log2_group threads of each group; every thread of the group gets the
// result. Must be reached by every thread of the CTA (it synchronizes once when G > 32).
template <int kSums>
__device__ __forceinline__ void group_reduce(float (&sum)[kVec], float& mx, int log2_group,
                                             ReduceScratch& s) {
  const int lane = threadIdx.x & 31;
  if (log2_group > 5) {
    const int warp = threadIdx.x >> 5, W = 1 << (log2_group - 5), w0 = warp & ~(W - 1);
#pragma unroll
    for (int i = 0; i < kSums; ++i) s.v[warp][i][lane] = sum[i];
    s.v[warp][kVec][lane] = mx;
    __syncthreads();
    // Warp w of the group pairs with warp w + W/2, then W/4, ...: the top thread-index bits.
#pragma unroll
    for (int i = 0; i < kSums; ++i) {
      float t[kWarps];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) t[w] = w < W ? s.v[w0 + w][i][lane] : 0.0f;
#pragma unroll
      for (int h = kWarps / 2; h >= 1; h /= 2) {
        if (h < W) {
#pragma unroll
          for (int w = 0; w < h; ++w) t[w] = t[w] + t[w + h];
        }
      }
      sum[i] = t[0];
    }
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = w < W ? fmaxf(m, s.v[w0 + w][kVec][lane]) : m;
    mx = m;
  }
  // Lanes: offsets 16, 8, ..., 1 (or G/2, ..., 1 for groups inside a warp). Lanes i and
  // i ^ off hold S[i] + S[i ^ off] in either order, the same bits.
  const int top = log2_group > 5 ? 16 : (1 << log2_group) >> 1;
  for (int off = top; off >= 1; off >>= 1) {
#pragma unroll
    for (int i = 0; i < kSums; ++i) sum[i] = sum[i] + __shfl_xor_sync(0xffffffffu, sum[i], off);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  }
}

// Folds one chunk into the thread's running max |e|; non-finite values count as +inf, so
// the reduced max is +inf exactly when the block holds a non-finite value.
template <class Src>
__device__ __forceinline__ void fold_max(const Src& src, const float (&v)[kVec], float& mx) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float e = src.to_e(v[k]);
    mx = fmaxf(mx, is_finite(e) ? fabsf(e) : INFINITY);
  }
}

// Per-thread state of one encode: which block, which of its threads, where its rows are.
struct EncodeThread {
  int g;          // thread within the group
  int G;          // threads per group
  int64_t blk;    // quantization block
  int64_t start;  // first element of the block
  int64_t valid;  // elements of the block below numel (0 for an idle group)
  bool active;    // blk < nblocks
  bool tree;      // deterministic 1-, 2-bit: magnitude from the tree sum (numerics.h)
  int bits;

  // Element offset within the block of this thread's row r.
  __device__ __forceinline__ int64_t row_offset(int r) const {
    return (int64_t)kVec * (g + (int64_t)G * r);
  }
};

__device__ __forceinline__ EncodeThread encode_thread(const EncodeParams& p) {
  EncodeThread t;
  t.G = 1 << p.log2_group;
  t.g = threadIdx.x & (t.G - 1);
  t.blk = (int64_t)blockIdx.x * (kThreads >> p.log2_group) + (threadIdx.x >> p.log2_group);
  t.active = t.blk < p.nblocks;
  const int64_t B = int64_t(1) << p.log2_block;
  t.start = t.blk * B;
  t.valid = t.active ? (p.n - t.start < B ? p.n - t.start : B) : 0;
  t.tree = false;
  t.bits = 0;
  return t;
}

// Reduces the thread partials to the block magnitude m (numerics.h), NaN for a block with a
// non-finite value. Every thread of the CTA must call it.
__device__ __forceinline__ float block_magnitude(const EncodeThread& t, float (&part)[kVec],
                                                 float mx, int log2_group, ReduceScratch& s) {
  float m;
  if (t.tree) {
    group_reduce<kVec>(part, mx, log2_group, s);
    // The last three levels pair k with k + 4, k + 2, k + 1.
    float s4[4], s2[2];
#pragma unroll
    for (int k = 0; k < 4; ++k) s4[k] = part[k] + part[k + 4];
#pragma unroll
    for (int k = 0; k < 2; ++k) s2[k] = s4[k] + s4[k + 2];
    m = mean_magnitude(t.bits, mx, s2[0] + s2[1], t.valid);
  } else {
    group_reduce<0>(part, mx, log2_group, s);
    m = mx;
  }
  return mx == INFINITY ? canonical_nan() : m;
}

// Pass 2 for one row: quantizes the chunk whose values are v, stores its codes and, when
// asked, its residual.
template <class Src, int kBits>
__device__ __forceinline__ void emit_row(const Src& src, const EncodeParams& p,
                                         const EncodeThread& t, int r, const float (&v)[kVec],
                                         float m, BlockInv inv, bool degenerate,
                                         const float* levels) {
  const int64_t j0 = t.row_offset(r), i0 = t.start + j0;
  uint32_t codes[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if (degenerate) {
      codes[k] = degenerate_code(kBits);
    } else {
      // Padding elements draw too: their codes are part of the payload.
      const uint64_t counter = (uint64_t)(p.rng_offset + i0 + k);
      const float u = p.stochastic ? uniform24(rng_u64_keyed(p.rng_key, counter)) : 0.0f;
      codes[k] = quantize_one(src.to_e(v[k]), inv, kBits, p.stochastic, u);
    }
  }
  store_codes<kBits>(p.out + t.blk * p.rec + kScaleBytes + j0 * kBits / 8, codes, p.out_aligned);
  if (p.residual && j0 < t.valid) {
    float deq[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) deq[k] = dequantize_one(codes[k], m, levels[codes[k]], kBits);
    src.store_residual(i0, v, deq);
  }
}

// B <= 8192: the thread's R <= kRows rows stay in registers from the load to the codes.
// kRows = 1 (B <= 2048, the common case) gets its own instance: fewer registers, more
// resident warps to hide memory latency.
template <class Src, int kBits, int kRows>
__global__ void __launch_bounds__(kThreads) encode_kernel_regs(Src src, EncodeParams p) {
  __shared__ float levels[1 << kBits];
  __shared__ ReduceScratch scratch;
  fill_levels<kBits>(levels);
  __syncthreads();
  EncodeThread t = encode_thread(p);
  t.tree = uses_mean(kBits, p.stochastic);
  t.bits = kBits;
  const int R = p.rows;

  float v[kRows][kVec];
  float a[kRows][kVec];  // |e|
  float mx = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < R && t.active) {
      src.load(t.start + t.row_offset(r), levels, v[r]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[r][k] = 0.0f;
    }
    fold_max(src, v[r], mx);
#pragma unroll
    for (int k = 0; k < kVec; ++k) a[r][k] = fabsf(src.to_e(v[r][k]));
  }
  if (t.tree) {
    // Rows pair r with r + R/2 first: the top bits of the element index.
#pragma unroll
    for (int h = kRows / 2; h >= 1; h /= 2) {
      if (h < R) {
#pragma unroll
        for (int r = 0; r < h; ++r) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) a[r][k] = a[r][k] + a[r + h][k];
        }
      }
    }
  }
  const float m = block_magnitude(t, a[0], mx, p.log2_group, scratch);
  if (!t.active) return;  // no barrier follows
  if (t.g == 0) store_scale(p.out + t.blk * p.rec, m, p.out_aligned);
  const bool degenerate = block_is_degenerate(m);
  const BlockInv inv = block_inv(m, kBits);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < R) emit_row<Src, kBits>(src, p, t, r, v[r], m, inv, degenerate, levels);
  }
}

// ---------------------------------------------------------------------------------------
// Split path, B >= 16384 (R = B / 2048 >= 8 rows of 256 chunks): each block is split over
// S = 2^log2_slices CTAs, enough for the launch to fill the GPU (kFillCtas), in three kernels:
// partials (per CTA: max |e| and, for the tree, the per-thread row-tree sums), magnitude (one
// CTA per block combines them and stores the scale), emit (per CTA: codes and residuals of its
// rows, the scale read back). CTA s of a block owns rows r = s + S t, t < R / S: r's top bits
// are t, so each CTA first completes the row tree over t on its own; the partials then pair s
// with s + S/2, ... (r's low bits) before the thread and lane levels, exactly the order of
// numerics.h. Rows stream from global memory in both passes (the second read mostly from L2).
// ---------------------------------------------------------------------------------------

// c's low `bits` bits, reversed.
__device__ __forceinline__ int bit_reverse(int c, int bits) {
  return bits == 0 ? 0 : (int)(__brev((unsigned)c) >> (32 - bits));
}

// Adds rows in the pairwise tree's order when they arrive in bit-reversed order: pairs
// (r, r + R/2), then (r, r + R/4), ... become neighbours, and a binary counter adds them;
// level l holds the pending left sibling covering 2^l rows. After 2^L pushes the whole tree
// sits at level L.
struct TreeStack {
  float v[kMaxStackLevels][kVec];

  __device__ __forceinline__ void push(int c, float (&cur)[kVec]) {
    bool placed = false;
#pragma unroll
    for (int l = 0; l < kMaxStackLevels; ++l) {
      if (!placed) {
        if ((c >> l) & 1) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) cur[k] = v[l][k] + cur[k];
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) v[l][k] = cur[k];
          placed = true;
        }
      }
    }
  }

  __device__ __forceinline__ void root(int levels, float (&out)[kVec]) const {
#pragma unroll
    for (int l = 0; l < kMaxStackLevels; ++l) {
      if (l == levels) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[k] = v[l][k];
      }
    }
  }
};

// The thread's view of its block on the split path (one group of kThreads per block).
__device__ __forceinline__ EncodeThread split_thread(const EncodeParams& p, int64_t blk) {
  EncodeThread t;
  t.G = kThreads;
  t.g = threadIdx.x;
  t.blk = blk;
  t.active = true;
  const int64_t B = int64_t(1) << p.log2_block;
  t.start = blk * B;
  t.valid = p.n - t.start < B ? p.n - t.start : B;
  t.tree = false;
  t.bits = 0;
  return t;
}

// Pass 1, grid nblocks * S: max |e| of the CTA's rows (+inf for a non-finite value) into
// part_max[cta]; for the tree, each thread's row-tree sums into part_sum[cta][thread][k].
template <class Src, int kBits>
__global__ void __launch_bounds__(kThreads)
    encode_partials_kernel(Src src, EncodeParams p, float* part_max, float* part_sum) {
  __shared__ float levels[1 << kBits];
  __shared__ float warp_max[kWarps];
  fill_levels<kBits>(levels);
  __syncthreads();
  const int64_t blk = blockIdx.x >> p.log2_slices;
  const int s = blockIdx.x & ((1 << p.log2_slices) - 1);
  const EncodeThread t = split_thread(p, blk);
  const bool tree = uses_mean(kBits, p.stochastic);
  const int log2_mine = 31 - __clz(p.rows) - p.log2_slices, mine = 1 << log2_mine;

  TreeStack stack;
  float mx = 0.0f;
  for (int c = 0; c < mine; ++c) {
    const int r = s + ((tree ? bit_reverse(c, log2_mine) : c) << p.log2_slices);
    float cur[kVec];
    src.load(t.start + t.row_offset(r), levels, cur);
    fold_max(src, cur, mx);
    if (tree) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) cur[k] = fabsf(src.to_e(cur[k]));
      stack.push(c, cur);
    }
  }
  if (tree) {
    float part[kVec];
    stack.root(log2_mine, part);
    float* dst = part_sum + ((int64_t)blockIdx.x * kThreads + threadIdx.x) * kVec;
#pragma unroll
    for (int k = 0; k < kVec; ++k) dst[k] = part[k];
  }
  // The max is order-independent: any reduction order gives the same bits.
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_max[w]);
    part_max[blockIdx.x] = m;
  }
}

// Pass 2, grid nblocks: combines the block's S partials (slices s and s + S/2 first, by the
// same stack over bit-reversed s), reduces over threads and k, stores the scale.
template <int kBits>
__global__ void __launch_bounds__(kThreads)
    encode_magnitude_kernel(EncodeParams p, const float* part_max, const float* part_sum) {
  __shared__ ReduceScratch scratch;
  const int64_t blk = blockIdx.x;
  const int S = 1 << p.log2_slices;
  EncodeThread t = split_thread(p, blk);
  t.tree = uses_mean(kBits, p.stochastic);
  t.bits = kBits;
  float mx = 0.0f;
  for (int s = 0; s < S; ++s) mx = fmaxf(mx, part_max[blk * S + s]);
  float part[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) part[k] = 0.0f;
  if (t.tree) {
    TreeStack stack;
    for (int c = 0; c < S; ++c) {
      const int s = bit_reverse(c, p.log2_slices);
      const float* src = part_sum + ((blk * S + s) * kThreads + threadIdx.x) * kVec;
      float cur[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) cur[k] = src[k];
      stack.push(c, cur);
    }
    stack.root(p.log2_slices, part);
  }
  const float m = block_magnitude(t, part, mx, 8, scratch);  // G = 256 = 2^8 threads
  if (threadIdx.x == 0) store_scale(p.out + blk * p.rec, m, p.out_aligned);
}

// Pass 3, grid nblocks * S: codes (and residuals) of the CTA's rows, from the stored scale.
template <class Src, int kBits>
__global__ void __launch_bounds__(kThreads) encode_emit_kernel(Src src, EncodeParams p) {
  __shared__ float levels[1 << kBits];
  fill_levels<kBits>(levels);
  __syncthreads();
  const int64_t blk = blockIdx.x >> p.log2_slices;
  const int s = blockIdx.x & ((1 << p.log2_slices) - 1);
  const EncodeThread t = split_thread(p, blk);
  const float m = load_scale(p.out + blk * p.rec, p.out_aligned);
  const bool degenerate = block_is_degenerate(m);
  const BlockInv inv = block_inv(m, kBits);
  const int mine = p.rows >> p.log2_slices;
  for (int c = 0; c < mine; ++c) {
    const int r = s + (c << p.log2_slices);
    float cur[kVec];
    src.load(t.start + t.row_offset(r), levels, cur);
    emit_row<Src, kBits>(src, p, t, r, cur, m, inv, degenerate, levels);
  }
}

// ---------------------------------------------------------------------------------------
// Launchers.
// ---------------------------------------------------------------------------------------

bool valid_bits_block(int bits, int64_t block) {
  return (bits == 1 || bits == 2 || bits == 4 || bits == 8) && block >= 32 && block <= 65536 &&
         (block & (block - 1)) == 0;
}

int log2_exact(int64_t v) {
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

bool grid_fits(int64_t ctas) { return ctas >= 1 && ctas <= 0x7fffffffLL; }

// Split path scratch: one max per CTA, and for the tree kThreads * kVec sums per CTA.
int64_t split_workspace_floats(const EncodeParams& p, int bits, int64_t ctas) {
  if (p.rows <= kMaxRegRows) return 0;
  const bool tree = uses_mean(bits, p.stochastic);
  return ctas + (tree ? ctas * kThreads * kVec : 0);
}

template <class Src, int kBits>
cudaError_t launch_encode_bits(const Src& src, const EncodeParams& p, int64_t ctas, void* workspace,
                               cudaStream_t stream) {
  if (p.rows > kMaxRegRows) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    float* part_max = static_cast<float*>(workspace);
    float* part_sum = part_max + ctas;
    encode_partials_kernel<Src, kBits>
        <<<(unsigned)ctas, kThreads, 0, stream>>>(src, p, part_max, part_sum);
    encode_magnitude_kernel<kBits>
        <<<(unsigned)p.nblocks, kThreads, 0, stream>>>(p, part_max, part_sum);
    encode_emit_kernel<Src, kBits><<<(unsigned)ctas, kThreads, 0, stream>>>(src, p);
  } else if (p.rows > 1) {
    encode_kernel_regs<Src, kBits, kMaxRegRows><<<(unsigned)ctas, kThreads, 0, stream>>>(src, p);
  } else {
    encode_kernel_regs<Src, kBits, 1><<<(unsigned)ctas, kThreads, 0, stream>>>(src, p);
  }
  return cudaGetLastError();
}

// The one builder of an encode launch (quantize and dequantize_sum_requantize): geometry and
// options. Returns the CTA count (of the partials and emit kernels on the split path).
int64_t encode_params(int64_t n, int bits, int64_t block, bool stochastic, uint64_t rng_key,
                      int64_t rng_offset, uint8_t* out, bool residual, EncodeParams& p) {
  p = EncodeParams{};
  p.n = n;
  p.nblocks = num_blocks(n, block);
  p.log2_block = log2_exact(block);
  p.log2_group = p.log2_block - 3 < 8 ? p.log2_block - 3 : 8;  // G = min(B / 8, 256)
  p.rows = (int)(block / (kVec << p.log2_group));
  p.rec = record_bytes(block, bits);
  p.stochastic = stochastic;
  p.rng_key = rng_key;
  p.rng_offset = rng_offset;
  p.out = out;
  p.out_aligned = (reinterpret_cast<uintptr_t>(out) & 3u) == 0;
  p.residual = residual;
  p.log2_slices = 0;
  if (p.rows > kMaxRegRows) {
    // Split each block over more CTAs (at most one row each) until the launch fills the GPU.
    while ((1 << p.log2_slices) < p.rows && (p.nblocks << p.log2_slices) < kFillCtas) {
      ++p.log2_slices;
    }
    return p.nblocks << p.log2_slices;
  }
  const int64_t per_cta = kThreads >> p.log2_group;
  return (p.nblocks + per_cta - 1) / per_cta;
}

PayloadView payload_view(const PayloadRows& p) {
  const bool aligned = (reinterpret_cast<uintptr_t>(p.data) & 3u) == 0 && (p.row_bytes & 3) == 0;
  return PayloadView{
      p.data, p.rows, p.row_bytes, record_bytes(p.block_size, p.bits), log2_exact(p.block_size),
      aligned};
}

}  // namespace

int64_t encode_workspace_bytes(int64_t numel, int bits, int64_t block_size, bool stochastic) {
  if (bits == kSparseBits) return sparse_workspace_bytes(numel, block_size);
  if (!valid_bits_block(bits, block_size) || numel <= 0) return 0;
  EncodeParams p;
  const int64_t ctas = encode_params(numel, bits, block_size, stochastic, 0, 0, nullptr, false, p);
  return (int64_t)sizeof(float) * split_workspace_floats(p, bits, ctas);
}

cudaError_t launch_quantize(const QuantizeArgs& a, void* workspace, cudaStream_t stream) {
  if (a.bits == kSparseBits) return launch_sparse_quantize(a, workspace, stream);
  if (!valid_bits_block(a.bits, a.block_size) || a.numel < 0) return cudaErrorInvalidValue;
  if (a.numel == 0) return cudaSuccess;
  EncodeParams p;
  const int64_t ctas = encode_params(a.numel, a.bits, a.block_size, a.stochastic, a.rng_key,
                                     a.rng_offset, a.out, a.residual != nullptr, p);
  if (!grid_fits(ctas)) return cudaErrorInvalidValue;
  return with_float_type(a.x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.x);
    const QuantizeSource<T> src{x, a.residual, a.numel, aligned16(x), aligned16(a.residual)};
    return with_bits(a.bits, [&](auto b) {
      return launch_encode_bits<QuantizeSource<T>, decltype(b)::value>(src, p, ctas, workspace,
                                                                       stream);
    });
  });
}

cudaError_t launch_dequantize_sum(const PayloadRows& p, int64_t divisor, const float* scale,
                                  void* out, FloatType out_type, cudaStream_t stream) {
  if (p.bits == kSparseBits) {
    return launch_sparse_dequantize_sum(p, divisor, scale, out, out_type, stream);
  }
  if (!valid_bits_block(p.bits, p.block_size) || p.numel < 0 || p.rows < 0 || divisor < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.numel == 0) return cudaSuccess;
  const int64_t ctas = (p.numel + (int64_t)kThreads * kVec - 1) / ((int64_t)kThreads * kVec);
  if (!grid_fits(ctas)) return cudaErrorInvalidValue;
  const PayloadView pv = payload_view(p);
  const float div = (float)divisor;
  return with_float_type(out_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out);
    return with_bits(p.bits, [&](auto b) {
      decode_kernel<decltype(b)::value, T><<<(unsigned)ctas, kThreads, 0, stream>>>(
          pv, p.numel, div, scale, aligned16(scale), o, aligned16(o));
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_dequantize_sum_requantize(const PayloadRows& rows, float* residual,
                                             int64_t divisor, bool stochastic, uint64_t rng_key,
                                             int64_t rng_offset, uint8_t* out, void* workspace,
                                             cudaStream_t stream) {
  if (rows.bits == kSparseBits) {
    if (stochastic) return cudaErrorInvalidValue;
    return launch_sparse_requantize(rows, residual, divisor, out, workspace, stream);
  }
  if (!valid_bits_block(rows.bits, rows.block_size) || rows.numel < 0 || rows.rows < 0 ||
      divisor < 1) {
    return cudaErrorInvalidValue;
  }
  if (rows.numel == 0) return cudaSuccess;
  EncodeParams p;
  const int64_t ctas = encode_params(rows.numel, rows.bits, rows.block_size, stochastic, rng_key,
                                     rng_offset, out, residual != nullptr, p);
  if (!grid_fits(ctas)) return cudaErrorInvalidValue;
  return with_bits(rows.bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    const SumSource<kBits> src{payload_view(rows), residual, rows.numel, (float)divisor,
                               aligned16(residual)};
    return launch_encode_bits<SumSource<kBits>, kBits>(src, p, ctas, workspace, stream);
  });
}

}  // namespace cuda
}  // namespace ddpcomm
