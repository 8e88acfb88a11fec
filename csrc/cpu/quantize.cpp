// CPU implementations of the quantizer ops: quantize_into, dequantize_sum_into (which is also
// ops.dequantize) and dequantize_sum_requantize_into. Every bit of output comes from
// csrc/numerics.h.
//
// Work is split over blocks with at::parallel_for; each block is staged in a small fp32
// buffer so the per-element loops are straight-line and vectorize.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../numerics.h"
#include "dispatch.h"

// Everything below, not the headers above, is compiled for x86-64-v3 in the AVX2 variant
// (avx2/quantize.cpp; see dispatch.h).
#if defined(DDPCOMM_ISA_AVX2)
#pragma GCC target("arch=x86-64-v3")
#endif

namespace ddpcomm::DDPCOMM_ISA {
namespace {

// Blocks per parallel_for task: enough work to amortize the task, small enough to balance.
int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, (1 << 16) / block); }

// Encodes one staged block `e` (B values, zero past `valid`) into `record`; when `deq` is
// given, writes the dequantized values of the first `valid` elements there.
template <int kBits, bool kStochastic>
void encode_block(const float* e, int64_t valid, int64_t B, uint8_t* record, float* deq,
                  uint64_t key, int64_t index0, float* scratch, uint8_t* codes) {
  float m;
  uint32_t nonfinite = 0;
  if (uses_mean(kBits, kStochastic)) {
    float absmax = 0.0f;
    for (int64_t j = 0; j < B; ++j) {
      scratch[j] = fabsf(e[j]);
      absmax = scratch[j] > absmax ? scratch[j] : absmax;
      nonfinite |= (uint32_t)!is_finite(e[j]);
    }
    m = valid > 0 ? mean_magnitude(kBits, absmax, block_tree_sum(scratch, B), valid) : 0.0f;
  } else {
    // |x| compared as its bit pattern: for non-negative floats the integer order is the
    // float order, and an integer max reduction vectorizes where a float one may not.
    uint32_t mbits = 0;
    for (int64_t j = 0; j < B; ++j) {
      uint32_t u;
      std::memcpy(&u, &e[j], sizeof(u));
      u &= 0x7FFFFFFFu;
      nonfinite |= (uint32_t)(u >= 0x7F800000u);
      mbits = u > mbits ? u : mbits;
    }
    std::memcpy(&m, &mbits, sizeof(m));
  }
  if (nonfinite) m = canonical_nan();
  std::memcpy(record, &m, sizeof(float));

  if (block_is_degenerate(m)) {
    // A counted loop, not std::fill(codes, codes + B): fill's length is last - first, which
    // gcc cannot prove non-negative here (it warned of a 2^63-byte memset, -Wstringop-overflow);
    // the loop is well defined for any B and still compiles to one memset.
    const uint8_t code = (uint8_t)degenerate_code(kBits);
    for (int64_t j = 0; j < B; ++j) codes[j] = code;
  } else {
    const BlockInv inv = block_inv(m, kBits);
    for (int64_t j = 0; j < B; ++j) {
      const float u = kStochastic ? uniform24(rng_u64_keyed(key, index0 + j)) : 0.0f;
      codes[j] = (uint8_t)quantize_one(e[j], inv, kBits, kStochastic, u);
    }
  }

  constexpr int per_byte = 8 / kBits;
  uint8_t* out = record + kScaleBytes;
  const int64_t nbytes = code_bytes_per_block(B, kBits);
  if (kBits == 8) {
    std::memcpy(out, codes, static_cast<size_t>(nbytes));
  } else {
    for (int64_t k = 0; k < nbytes; ++k) {
      uint32_t byte = 0;
      for (int t = 0; t < per_byte; ++t) byte |= (uint32_t)codes[k * per_byte + t] << (t * kBits);
      out[k] = (uint8_t)byte;
    }
  }
  if (deq != nullptr) {
    for (int64_t j = 0; j < valid; ++j) {
      const float level = kBits == 1 ? 0.0f : level_value(codes[j], kBits);
      deq[j] = dequantize_one(codes[j], m, level, kBits);
    }
  }
}

using EncodeFn = void (*)(const float*, int64_t, int64_t, uint8_t*, float*, uint64_t, int64_t,
                          float*, uint8_t*);

EncodeFn pick_encoder(int bits, bool stochastic) {
  return with_bits(bits, [&](auto b) -> EncodeFn {
    constexpr int kBits = decltype(b)::value;
    return stochastic ? &encode_block<kBits, true> : &encode_block<kBits, false>;
  });
}

// 1- and 2-bit codes decoded a byte at a time: every byte value's 8 / kBits elements as
// 32-bit words, the 1-bit sign bit to XOR into m (m or -m, as dequantize_one gives them,
// NaN m included), the 2-bit level_value as bits. 256 rows of 8 words (8 KB) stay in L1;
// the 1-bit sum ran at a third of copy speed unpacking bit by bit.
template <int kBits>
struct ByteTable {
  static constexpr int per_byte = 8 / kBits;
  uint32_t word[256][per_byte];
  ByteTable() {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      for (int t = 0; t < per_byte; ++t) {
        const uint32_t code = (byte >> (t * kBits)) & ((1u << kBits) - 1u);
        word[byte][t] =
            kBits == 1 ? (code ? 0u : 0x80000000u) : float_bits(level_value(code, kBits));
      }
    }
  }
};

// Adds the values of one block record to `acc` (first `valid` elements). Codes are
// unpacked first (1 and 2 bits: through the byte table, 64 elements at a time) so the add
// loop is plain and vectorizes; one add per element, of the value dequantize_one gives.
template <int kBits>
void accumulate_record(const uint8_t* record, int64_t valid, float* acc, uint8_t* codes) {
  float m;
  std::memcpy(&m, record, sizeof(float));
  const uint8_t* packed = record + kScaleBytes;
  constexpr int per_byte = 8 / kBits;
  if constexpr (kBits <= 2) {
    static const ByteTable<kBits> table;
    constexpr int64_t kStep = 64;
    uint32_t words[kStep];
    const uint32_t mbits = float_bits(m);
    for (int64_t j0 = 0; j0 < valid; j0 += kStep) {
      const int64_t len = std::min(kStep, valid - j0);
      for (int64_t k = 0; k < (len + per_byte - 1) / per_byte; ++k) {
        std::memcpy(words + k * per_byte, table.word[packed[j0 / per_byte + k]],
                    sizeof(table.word[0]));
      }
      float* a = acc + j0;
      for (int64_t j = 0; j < len; ++j) {
        a[j] += kBits == 1 ? bits_float(mbits ^ words[j]) : m * bits_float(words[j]);
      }
    }
    return;
  }
  constexpr uint32_t mask = (1u << kBits) - 1u;
  const int64_t nbytes = (valid + per_byte - 1) / per_byte;
  for (int64_t k = 0; k < nbytes; ++k) {
    for (int t = 0; t < per_byte; ++t) codes[k * per_byte + t] = (packed[k] >> (t * kBits)) & mask;
  }
  for (int64_t j = 0; j < valid; ++j) {
    const float level = kBits == 1 ? 0.0f : level_value(codes[j], kBits);
    acc[j] += dequantize_one(codes[j], m, level, kBits);
  }
}

using AccumulateFn = void (*)(const uint8_t*, int64_t, float*, uint8_t*);

AccumulateFn pick_accumulator(int bits) {
  return with_bits(bits,
                   [](auto b) -> AccumulateFn { return &accumulate_record<decltype(b)::value>; });
}

// Per-task scratch: the staged block, a tree-sum buffer, codes, dequantized values.
struct Scratch {
  std::vector<float> e, tree, deq;
  std::vector<uint8_t> codes;
  explicit Scratch(int64_t B) : e(B), tree(B), deq(B), codes(B) {}
};

void quantize_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                       const at::Tensor& packed, int64_t bits, int64_t block_size, bool stochastic,
                       int64_t seed, int64_t step, int64_t rng_offset) {
  check_quantize(x, residual, packed, bits, block_size);
  const int64_t n = x.numel();
  const at::Tensor xc = x.contiguous();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t B = block_size, nb = num_blocks(n, B), rec = record_bytes(B, (int)bits);
  const EncodeFn encode = pick_encoder((int)bits, stochastic);
  const uint64_t key = rng_key((uint64_t)seed, (uint64_t)step);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    at::parallel_for(0, nb, grain_blocks(B), [&](int64_t b0, int64_t b1) {
      Scratch s(B);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t start = blk * B, valid = std::min(B, n - start);
        const float* e = s.e.data();
        if (std::is_same_v<scalar_t, float> && res == nullptr && valid == B) {
          e = reinterpret_cast<const float*>(xp + start);  // full fp32 block: no staging
        } else {
          for (int64_t j = 0; j < valid; ++j) s.e[j] = static_cast<float>(xp[start + j]);
          if (res != nullptr) {
            for (int64_t j = 0; j < valid; ++j) s.e[j] = s.e[j] + res[start + j];
          }
          std::fill(s.e.begin() + valid, s.e.end(), 0.0f);
        }
        encode(e, valid, B, out + blk * rec, res ? s.deq.data() : nullptr, key, rng_offset + start,
               s.tree.data(), s.codes.data());
        if (res != nullptr) {
          for (int64_t j = 0; j < valid; ++j) res[start + j] = canonical(s.e[j] - s.deq[j]);
        }
      }
    });
  });
}

// Sums block `blk` of every payload row into acc[0, valid), in row order.
void sum_rows(const uint8_t* in, int64_t rows, int64_t row_bytes, int64_t blk, int64_t rec,
              int64_t valid, AccumulateFn accumulate, float* acc, uint8_t* codes) {
  std::fill(acc, acc + valid, 0.0f);
  for (int64_t r = 0; r < rows; ++r) accumulate(in + r * row_bytes + blk * rec, valid, acc, codes);
}

void dequantize_sum_into_cpu(const at::Tensor& payloads, const at::Tensor& result, int64_t bits,
                             int64_t block_size, int64_t divisor) {
  check_dequantize_sum(payloads, result, bits, block_size, divisor);
  const int64_t numel = result.numel();
  const at::ScalarType dtype = result.scalar_type();
  const at::Tensor pc = payloads.contiguous();
  const int64_t B = block_size, nb = num_blocks(numel, B), rec = record_bytes(B, (int)bits);
  const int64_t rows = pc.size(0), row_bytes = pc.size(1);
  const uint8_t* in = pc.data_ptr<uint8_t>();
  const float div = (float)divisor;
  const AccumulateFn accumulate = pick_accumulator((int)bits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dequantize_sum", [&] {
    scalar_t* op = result.data_ptr<scalar_t>();
    at::parallel_for(0, nb, grain_blocks(B), [&](int64_t b0, int64_t b1) {
      std::vector<float> acc(B);
      std::vector<uint8_t> codes(B);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t start = blk * B, valid = std::min(B, numel - start);
        sum_rows(in, rows, row_bytes, blk, rec, valid, accumulate, acc.data(), codes.data());
        for (int64_t j = 0; j < valid; ++j) {
          op[start + j] = static_cast<scalar_t>(canonical(acc[j] / div));
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
  const at::Tensor pc = payloads.contiguous();
  const int64_t B = block_size, nb = num_blocks(numel, B), rec = record_bytes(B, (int)bits);
  const int64_t rows = pc.size(0), row_bytes = pc.size(1);
  const uint8_t* in = pc.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  const EncodeFn encode = pick_encoder((int)bits, stochastic);
  const uint64_t key = rng_key((uint64_t)seed, (uint64_t)step);
  const float div = (float)divisor;
  const AccumulateFn accumulate = pick_accumulator((int)bits);
  at::parallel_for(0, nb, grain_blocks(B), [&](int64_t b0, int64_t b1) {
    Scratch s(B);
    std::vector<float> sum(B);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * B, valid = std::min(B, numel - start);
      sum_rows(in, rows, row_bytes, blk, rec, valid, accumulate, sum.data(), s.codes.data());
      if (res != nullptr) {
        for (int64_t j = 0; j < valid; ++j) sum[j] = sum[j] + res[start + j];
      }
      for (int64_t j = 0; j < valid; ++j) s.e[j] = sum[j] / div;
      std::fill(s.e.begin() + valid, s.e.end(), 0.0f);
      encode(s.e.data(), valid, B, out + blk * rec, res ? s.deq.data() : nullptr, key,
             rng_offset + start, s.tree.data(), s.codes.data());
      if (res != nullptr) {
        for (int64_t j = 0; j < valid; ++j) res[start + j] = canonical(sum[j] - div * s.deq[j]);
      }
    }
  });
}

}  // namespace

void register_quantize(torch::Library& m) {
  m.impl("quantize_into", &quantize_into_cpu);
  m.impl("dequantize_sum_into", &dequantize_sum_into_cpu);
  m.impl("dequantize_sum_requantize_into", &dequantize_sum_requantize_into_cpu);
}

}  // namespace ddpcomm::DDPCOMM_ISA
