// CUDA kernels of q1.5's code (csrc/numerics.h, ops' bits = kSparseBits): quantize,
// dequantize_sum and dequantize_sum_requantize, bit for bit the CPU ops (cpu/sparse_code.h).
//
// Encode: a staging kernel writes every block's values e in fp32 to the workspace (x plus
// the residual; or, requantizing, the row sum S plus the residual, which then holds S until
// the residual update, and e = S / divisor). Then one CTA per quantization block runs the
// block in passes, each as numerics.h states it: the largest key, the pairwise tree sum of
// squares (in shared memory up to B = 8192, else in the workspace), the count above the
// dead zone, past the cap a radix select of the cap-th largest key; then tiles of one 32-bit
// bitmap word per thread in index order, where two CTA scans rank the ties and place each
// kept element's sign; the tree sum of the kept |e| gives m; then the record and residual.
//
// Decode: one thread per 32-element bitmap word, CTAs of 256 consecutive words. A word's
// first sign sits after every set bit before it in its block: a CTA scan of the words'
// popcounts, plus, for blocks longer than a CTA's 8192 elements, the count of the block's
// words before the CTA. Rows are summed in row order in registers.
//
// These kernels favour plain, checkable passes over speed: one CTA per block of 512 leaves
// most threads idle in the tile pass.

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "../numerics.h"
#include "elements.cuh"
#include "launchers.h"

namespace ddpcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWord = 32;                             // elements per bitmap word
constexpr int64_t kTile = (int64_t)kThreads * kWord;  // elements per CTA tile: 8192
constexpr int kMaxWords = 65536 / kWord;              // bitmap words of the largest block
constexpr int kMaxSignWords = 65536 / 2 / kWord;

// ---------------------------------------------------------------------------------------
// CTA-wide integer reductions and scans (exact in any order).
// ---------------------------------------------------------------------------------------

struct CtaScratch {
  uint32_t warp[kThreads / 32];
  uint32_t total;
};

// Exclusive prefix of v over the CTA's threads; *total gets the sum. Every thread calls it.
__device__ uint32_t cta_exclusive_scan(uint32_t v, CtaScratch& s, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t inc = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t u = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += u;
  }
  __syncthreads();
  if (lane == 31) s.warp[warp] = inc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t run = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      const uint32_t t = s.warp[w];
      s.warp[w] = run;
      run += t;
    }
    s.total = run;
  }
  __syncthreads();
  const uint32_t out = s.warp[warp] + inc - v;
  *total = s.total;
  return out;
}

__device__ uint32_t cta_sum(uint32_t v, CtaScratch& s) {
  uint32_t total;
  cta_exclusive_scan(v, s, &total);
  return total;
}

__device__ uint32_t cta_max(uint32_t v, CtaScratch& s) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s.warp[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, s.warp[w]);
    s.total = m;
  }
  __syncthreads();
  return s.total;
}

// numerics.h block_tree_sum over tree[0, B): level w adds i + w to i.
__device__ float cta_tree_sum(float* tree, int64_t B) {
  for (int64_t w = B / 2; w >= 1; w /= 2) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < w; i += kThreads) tree[i] = tree[i] + tree[i + w];
  }
  __syncthreads();
  return tree[0];
}

// Bytes of a record are read and written one at a time: records of 4 + 3B/16 bytes need not
// be 4-byte aligned.
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

__device__ __forceinline__ float load_m(const uint8_t* p) {
  return sparse_m_value((uint16_t)(p[0] | (p[1] << 8)));
}

// ---------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------

struct SparseRows {
  const uint8_t* data;
  int64_t rows, row_bytes, n;
  int log2_block;
  int64_t rec;
};

// Adds row r's values of this thread's word (elements 32 w .. 32 w + 31) to acc. Every
// thread of the CTA calls it (it scans); `word` may lie past the payload (then adds nothing).
__device__ void add_row_word(const SparseRows& p, int64_t r, int64_t word, CtaScratch& s,
                             float (&acc)[kWord]) {
  const int64_t B = int64_t(1) << p.log2_block, words_per_block = B / kWord;
  const int64_t blk = (word * kWord) >> p.log2_block;
  const bool live = word * kWord < p.n;
  const uint8_t* rec = p.data + r * p.row_bytes + blk * p.rec;
  const uint8_t* bitmap = rec + kSparseScaleBytes;
  const int64_t wb = word - blk * words_per_block;  // word within its block
  const uint32_t bits = live ? load_u32(bitmap + 4 * wb) : 0u;
  uint32_t total;
  uint32_t prefix = cta_exclusive_scan((uint32_t)__popc(bits), s, &total);
  // The CTA's words start a block (B <= 8192: minus the scan at the block's first word,
  // which is CTA-local) or lie inside one (B > 8192: plus the block's words before the CTA).
  const int64_t cta_word0 = (int64_t)blockIdx.x * kThreads;
  __shared__ uint32_t first[kThreads];
  __syncthreads();
  first[threadIdx.x] = prefix;
  __syncthreads();
  if (words_per_block <= kThreads) {
    prefix -= first[(int64_t)threadIdx.x - wb];  // the block's first word is in this CTA
  } else {
    const int64_t blk0 = (cta_word0 * kWord) >> p.log2_block;
    const uint8_t* rec0 = p.data + r * p.row_bytes + blk0 * p.rec + kSparseScaleBytes;
    uint32_t before = 0;
    for (int64_t v = blk0 * words_per_block + threadIdx.x; v < cta_word0; v += kThreads) {
      before += (uint32_t)__popc(load_u32(rec0 + 4 * (v - blk0 * words_per_block)));
    }
    prefix += cta_sum(before, s);
  }
  if (!live) return;
  const float m = load_m(rec);
  // Up to 32 sign bits from bit `prefix` of the sign area; bytes past it read 0 (positive).
  const uint8_t* signs = bitmap + B / 8;
  const int64_t sign_bytes = B / 16;
  uint64_t window = 0;
#pragma unroll
  for (int b = 0; b < 5; ++b) {
    const int64_t at = (int64_t)(prefix >> 3) + b;
    if (at < sign_bytes) window |= (uint64_t)signs[at] << (8 * b);
  }
  uint32_t sg = (uint32_t)(window >> (prefix & 7));
  const float zero = sparse_value(false, false, m);
#pragma unroll
  for (int k = 0; k < kWord; ++k) {
    const bool kept = (bits >> k) & 1u;
    float v = zero;
    if (kept) {
      v = sparse_value(true, sg & 1u, m);
      sg >>= 1;
    }
    acc[k] = acc[k] + v;
  }
}

// dequantize_sum: out = (row sum / divisor) in T, times the scale where given.
template <typename T>
struct ToOutput {
  T* out;
  float divisor;
  const float* scale;
  __device__ void put(int64_t i, float a) const {
    float v = divisor != 1.0f ? a / divisor : a;
    if (scale != nullptr) v = to_float(from_float<T>(v)) * scale[i];
    out[i] = from_float<T>(v);
  }
};

// dequantize_sum_requantize's staging: S = row sum (+ residual) into the residual, e = S /
// divisor into the workspace.
struct ToStage {
  float* residual;
  float* e;
  float divisor;
  __device__ void put(int64_t i, float a) const {
    const float S = residual != nullptr ? a + residual[i] : a;
    if (residual != nullptr) residual[i] = S;
    e[i] = S / divisor;
  }
};

template <class Sink>
__global__ void __launch_bounds__(kThreads) decode_kernel(SparseRows p, Sink sink) {
  __shared__ CtaScratch s;
  const int64_t word = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  float acc[kWord];
#pragma unroll
  for (int k = 0; k < kWord; ++k) acc[k] = 0.0f;
  for (int64_t r = 0; r < p.rows; ++r) add_row_word(p, r, word, s, acc);
  const int64_t i0 = word * kWord;
#pragma unroll
  for (int k = 0; k < kWord; ++k) {
    if (i0 + k < p.n) sink.put(i0 + k, acc[k]);
  }
}

// ---------------------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------------------

template <typename T>
__global__ void stage_kernel(const T* __restrict__ x, const float* __restrict__ residual, int64_t n,
                             float* __restrict__ e) {
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * kThreads) {
    const float v = to_float(x[i]);
    e[i] = residual != nullptr ? v + residual[i] : v;
  }
}

struct EncodeArgs {
  const float* e;  // staged values
  int64_t n;
  int log2_block;
  int64_t rec;
  uint8_t* out;
  float* residual;     // or nullptr
  float scale;         // residual = canonical(s - scale * deq): 1, or the divisor
  const float* s;      // what the residual is taken from: e (quantize) or S (residual)
  float* tree_global;  // B floats per block where B > 8192
};

__global__ void __launch_bounds__(kThreads) encode_kernel(EncodeArgs a) {
  __shared__ CtaScratch s;
  __shared__ float tree_shared[kTile];
  __shared__ uint32_t bm[kMaxWords];
  __shared__ uint32_t sg[kMaxSignWords];
  __shared__ uint32_t hist[256];
  const int64_t B = int64_t(1) << a.log2_block, blk = blockIdx.x, start = blk * B;
  const int64_t valid = a.n - start < B ? a.n - start : B;
  float* tree = B <= kTile ? tree_shared : a.tree_global + blk * B;
  auto key_at = [&](int64_t j) -> uint32_t {
    return j < valid ? magnitude_key(a.e[start + j]) : 0u;
  };

  uint32_t mx = 0;
  for (int64_t j = threadIdx.x; j < B; j += kThreads) mx = max(mx, key_at(j));
  mx = cta_max(mx, s);
  for (int64_t w = threadIdx.x; w < B / kWord; w += kThreads) bm[w] = 0u;
  // B = 32 has 16 sign bits: half a word, which must still be cleared.
  for (int64_t w = threadIdx.x; w < (B / 2 + kWord - 1) / kWord; w += kThreads) sg[w] = 0u;
  float m = canonical_nan();
  if (mx < 0x7F800000u) {
    const float pre = sparse_pre(__uint_as_float(mx));
    for (int64_t j = threadIdx.x; j < B; j += kThreads) {
      const float v = __uint_as_float(key_at(j)) * pre;
      tree[j] = v * v;
    }
    const float t = dead_zone(cta_tree_sum(tree, B), valid);
    uint32_t over = 0;
    for (int64_t j = threadIdx.x; j < B; j += kThreads)
      over += __uint_as_float(key_at(j)) * pre > t;
    over = cta_sum(over, s);
    const int64_t cap = sparse_cap(B);
    const bool capped = over > (uint32_t)cap;
    uint32_t v = 0, ties = 0;
    if (capped) {
      // Radix select, 8 bits a round from the top: v = the cap-th largest key.
      uint32_t prefix = 0, rank = (uint32_t)cap;
      for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t mask = shift == 24 ? 0u : 0xFFFFFFFFu << (shift + 8);
        for (int d = threadIdx.x; d < 256; d += kThreads) hist[d] = 0u;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < B; j += kThreads) {
          const uint32_t k = key_at(j);
          if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xFFu], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          uint32_t above = 0;
          int d = 255;
          while (above + hist[d] < rank) above += hist[d--];
          s.total = (uint32_t)d | (above << 8);  // rank <= cap <= 32768: fits in 24 bits
        }
        __syncthreads();
        prefix |= (s.total & 0xFFu) << shift;
        rank -= s.total >> 8;
        __syncthreads();
      }
      v = prefix;
      uint32_t above = 0;
      for (int64_t j = threadIdx.x; j < B; j += kThreads) above += key_at(j) > v;
      ties = (uint32_t)cap - cta_sum(above, s);
    }
    // Tiles of one bitmap word per thread, in index order.
    uint32_t tie_carry = 0, kept_carry = 0;
    for (int64_t t0 = 0; t0 < B; t0 += kTile) {
      const int64_t word = t0 / kWord + threadIdx.x;
      const bool live = word * kWord < B;
      uint32_t eq = 0, keys[kWord];
#pragma unroll
      for (int k = 0; k < kWord; ++k) {
        keys[k] = live ? key_at(word * kWord + k) : 0u;
        eq |= (uint32_t)(capped && live && keys[k] == v) << k;
      }
      uint32_t tile_ties, tile_kept;
      uint32_t tie_rank = tie_carry + cta_exclusive_scan((uint32_t)__popc(eq), s, &tile_ties);
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < kWord; ++k) {
        const float av = __uint_as_float(keys[k]) * pre;
        bool keep = live && (capped ? keys[k] > v : av > t);
        if ((eq >> k) & 1u) keep = tie_rank++ < ties;
        bits |= (uint32_t)keep << k;
        if (live) tree[word * kWord + k] = keep ? av : 0.0f;
      }
      const uint32_t at = kept_carry + cta_exclusive_scan((uint32_t)__popc(bits), s, &tile_kept);
      if (live) {
        bm[word] = bits;
        uint32_t neg = 0, c = 0;
#pragma unroll
        for (int k = 0; k < kWord; ++k) {
          if ((bits >> k) & 1u) neg |= (uint32_t)(a.e[start + word * kWord + k] < 0.0f) << c++;
        }
        if (neg != 0u) {
          atomicOr(&sg[at >> 5], neg << (at & 31));
          if ((at & 31) != 0 && (at >> 5) + 1 < (uint32_t)(B / 2 / kWord)) {
            atomicOr(&sg[(at >> 5) + 1], neg >> (32 - (at & 31)));
          }
        }
      }
      tie_carry += tile_ties;
      kept_carry += tile_kept;
    }
    m = sparse_magnitude(cta_tree_sum(tree, B), kept_carry, pre);
  }
  // What the record holds, and so what the residual is taken against.
  const uint16_t mbits = sparse_m_bits(m);
  m = sparse_m_value(mbits);
  __syncthreads();
  uint8_t* rec = a.out + blk * a.rec;
  const int64_t code_bytes = B / 8 + B / 16;
  for (int64_t b = threadIdx.x; b < kSparseScaleBytes + code_bytes; b += kThreads) {
    uint32_t word;
    int64_t at;
    if (b < kSparseScaleBytes) {
      word = mbits, at = b;
    } else if (b < kSparseScaleBytes + B / 8) {
      at = b - kSparseScaleBytes;
      word = bm[at >> 2];
    } else {
      at = b - kSparseScaleBytes - B / 8;
      word = sg[at >> 2];
    }
    rec[b] = (uint8_t)(word >> (8 * (at & 3)));
  }
  if (a.residual != nullptr) {
    for (int64_t j = threadIdx.x; j < valid; j += kThreads) {
      const bool kept = (bm[j >> 5] >> (j & 31)) & 1u;
      const float deq = sparse_value(kept, a.e[start + j] < 0.0f, m);
      const float sv = a.s[start + j];
      a.residual[start + j] = canonical(a.scale == 1.0f ? sv - deq : sv - a.scale * deq);
    }
  }
}

int log2_of(int64_t v) {
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

bool valid_block(int64_t block) {
  return block >= 32 && block <= 65536 && (block & (block - 1)) == 0;
}

// Workspace: e (numel floats, padded to whole blocks), then the trees of blocks over 8192.
int64_t workspace_floats(int64_t numel, int64_t block) {
  const int64_t padded = num_blocks(numel, block) * block;
  return padded + (block > kTile ? padded : 0);
}

cudaError_t launch_encode(const float* e, int64_t n, int64_t block, uint8_t* out, float* residual,
                          float scale, const float* s, float* ws, cudaStream_t stream) {
  const int64_t nb = num_blocks(n, block);
  if (nb > 0x7fffffffLL) return cudaErrorInvalidValue;
  const EncodeArgs args{e,
                        n,
                        log2_of(block),
                        record_bytes(block, kSparseBits),
                        out,
                        residual,
                        scale,
                        s,
                        ws + num_blocks(n, block) * block};
  encode_kernel<<<(unsigned)nb, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

SparseRows sparse_rows(const PayloadRows& p) {
  return SparseRows{p.data,
                    p.rows,
                    p.row_bytes,
                    p.numel,
                    log2_of(p.block_size),
                    record_bytes(p.block_size, kSparseBits)};
}

unsigned decode_ctas(int64_t n) { return (unsigned)((n + kTile - 1) / kTile); }

}  // namespace

int64_t sparse_workspace_bytes(int64_t numel, int64_t block_size) {
  if (!valid_block(block_size) || numel <= 0) return 0;
  return (int64_t)sizeof(float) * workspace_floats(numel, block_size);
}

cudaError_t launch_sparse_quantize(const QuantizeArgs& a, void* workspace, cudaStream_t stream) {
  if (!valid_block(a.block_size) || a.numel < 0 || a.stochastic) return cudaErrorInvalidValue;
  if (a.numel == 0) return cudaSuccess;
  if (workspace == nullptr || num_blocks(a.numel, a.block_size) > 0x7fffffffLL) {
    return cudaErrorInvalidValue;
  }
  float* e = static_cast<float*>(workspace);
  const unsigned ctas = (unsigned)std::min<int64_t>((a.numel + kThreads - 1) / kThreads, 65535);
  cudaError_t err = with_float_type(a.x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    stage_kernel<T>
        <<<ctas, kThreads, 0, stream>>>(static_cast<const T*>(a.x), a.residual, a.numel, e);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  return launch_encode(e, a.numel, a.block_size, a.out, a.residual, 1.0f, e, e, stream);
}

cudaError_t launch_sparse_dequantize_sum(const PayloadRows& p, int64_t divisor, const float* scale,
                                         void* out, FloatType out_type, cudaStream_t stream) {
  if (!valid_block(p.block_size) || p.numel < 0 || p.rows < 0 || divisor < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.numel == 0) return cudaSuccess;
  const SparseRows rows = sparse_rows(p);
  return with_float_type(out_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const ToOutput<T> sink{static_cast<T*>(out), (float)divisor, scale};
    decode_kernel<ToOutput<T>><<<decode_ctas(p.numel), kThreads, 0, stream>>>(rows, sink);
    return cudaGetLastError();
  });
}

cudaError_t launch_sparse_requantize(const PayloadRows& p, float* residual, int64_t divisor,
                                     uint8_t* out, void* workspace, cudaStream_t stream) {
  if (!valid_block(p.block_size) || p.numel < 0 || p.rows < 0 || divisor < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.numel == 0) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  float* e = static_cast<float*>(workspace);
  const ToStage sink{residual, e, (float)divisor};
  decode_kernel<ToStage><<<decode_ctas(p.numel), kThreads, 0, stream>>>(sparse_rows(p), sink);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // The residual holds S now: the update reads it and writes S - divisor * deq.
  return launch_encode(e, p.numel, p.block_size, out, residual, (float)divisor, residual, e,
                       stream);
}

}  // namespace cuda
}  // namespace ddpcomm
