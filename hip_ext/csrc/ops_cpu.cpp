// CPU kernels of monarch_nb::grad_health and monarch_nb::checksum, registered for the CPU dispatch
// key (where they take precedence over the pure-torch references in hip_ext/_reference.py).
//
// Both read their input once. The loops are plain C++ with `omp simd` reductions (-fopenmp-simd:
// no OpenMP runtime), cloned per x86-64 level (v4: AVX-512, v3: AVX2+FMA, baseline) and picked at
// load time, so one build runs everywhere and still vectorizes. Threads: at::parallel_reduce over
// pieces of at most kChunk elements (grad_health) or words (checksum).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "dtype_code.hpp"
#include "elements.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MNB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MNB_CLONES
#endif

namespace monarch_nb_ext {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements (grad_health) or 64-bit words (checksum) per piece
constexpr int kConvert = 1024;       // 16-bit elements widened to float32 per step

struct Health {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
};

Health operator+(Health a, Health b) { return Health{a.sum_sq + b.sum_sq, a.nonfinite + b.nonfinite}; }

MNB_CLONES Health health_f32(const uint32_t* bits, int64_t n) {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
#pragma omp simd reduction(+ : sum_sq, nonfinite)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i];
    const uint32_t bad = mnb_f32_nonfinite(b);
    const double v = static_cast<double>(mnb_float_from_bits(b & (bad - 1u)));  // a non-finite one reads 0
    sum_sq += v * v;
    nonfinite += bad;
  }
  return Health{sum_sq, nonfinite};
}

MNB_CLONES Health health_f64(const uint64_t* bits, int64_t n) {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
#pragma omp simd reduction(+ : sum_sq, nonfinite)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t b = bits[i];
    const uint64_t bad = mnb_f64_nonfinite(b);
    const uint64_t kept = b & (bad - 1u);
    double v;
    std::memcpy(&v, &kept, sizeof v);
    sum_sq += v * v;
    nonfinite += static_cast<int64_t>(bad);
  }
  return Health{sum_sq, nonfinite};
}

// float16 / bfloat16: widened to float32 bits kConvert at a time (exact), then the float32 loop
// (the widening loop and the float32 loop each vectorize; one fused loop does not).
MNB_CLONES void widen_f16(const uint16_t* bits, int64_t n, uint32_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = mnb_bits_from_float(mnb_f16_to_float(bits[i]));
  }
}

MNB_CLONES void widen_bf16(const uint16_t* bits, int64_t n, uint32_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint32_t>(bits[i]) << 16;
  }
}

Health health_16(const uint16_t* bits, int64_t n, bool bf16) {
  Health total;
  uint32_t wide[kConvert];
  for (int64_t start = 0; start < n; start += kConvert) {
    const int64_t m = std::min<int64_t>(kConvert, n - start);
    if (bf16) {
      widen_bf16(bits + start, m, wide);
    } else {
      widen_f16(bits + start, m, wide);
    }
    total = total + health_f32(wide, m);
  }
  return total;
}

struct Piece {
  const void* data;
  int64_t numel;
  int dtype;  // MnbDtype
};

Health health_of(const Piece& p) {
  switch (p.dtype) {
    case MNB_F32:
      return health_f32(static_cast<const uint32_t*>(p.data), p.numel);
    case MNB_F64:
      return health_f64(static_cast<const uint64_t*>(p.data), p.numel);
    default:
      return health_16(static_cast<const uint16_t*>(p.data), p.numel, p.dtype == MNB_BF16);
  }
}

at::Tensor grad_health_cpu(at::TensorList tensors) {
  std::vector<at::Tensor> dense;  // keeps the contiguous copies of strided inputs alive
  dense.reserve(tensors.size());
  std::vector<Piece> pieces;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu(), "grad_health expects all tensors on one device; tensor ", i, " is on ", t.device(),
                ", the others on the CPU");
    const int code = dtype_code(t, i);
    dense.push_back(t.contiguous());
    const char* base = static_cast<const char*>(dense.back().const_data_ptr());
    const int64_t numel = dense.back().numel();
    for (int64_t start = 0; start < numel; start += kChunk) {
      pieces.push_back(Piece{base + start * t.element_size(), std::min(kChunk, numel - start), code});
    }
  }
  const Health total = at::parallel_reduce(
      0, static_cast<int64_t>(pieces.size()), 1, Health{},
      [&](int64_t begin, int64_t end, Health acc) {
        for (int64_t i = begin; i < end; ++i) {
          acc = acc + health_of(pieces[i]);
        }
        return acc;
      },
      [](Health a, Health b) { return a + b; });
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  double* values = out.mutable_data_ptr<double>();
  values[0] = total.sum_sq;
  values[1] = static_cast<double>(total.nonfinite);
  return out;
}

MNB_CLONES uint64_t checksum_words(const unsigned char* bytes, int64_t begin, int64_t end) {
  uint64_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = begin; i < end; ++i) {
    uint64_t word;
    std::memcpy(&word, bytes + 8 * i, sizeof word);  // little-endian host: the word of the spec
    sum += mnb_checksum_term(word, static_cast<uint64_t>(i));
  }
  return sum;
}

at::Tensor checksum_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.layout() == at::kStrided, "checksum expects a dense (strided) tensor, got layout ", x.layout());
  const at::Tensor dense = x.resolve_conj().resolve_neg().contiguous();
  const auto* bytes = static_cast<const unsigned char*>(dense.const_data_ptr());
  const int64_t nbytes = dense.numel() * dense.element_size();
  const int64_t full_words = nbytes / 8;
  uint64_t sum = at::parallel_reduce(
      0, full_words, kChunk, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t acc) { return acc + checksum_words(bytes, begin, end); },
      [](uint64_t a, uint64_t b) { return a + b; });
  const int tail = static_cast<int>(nbytes - 8 * full_words);
  if (tail > 0) {
    sum += mnb_checksum_term(mnb_tail_word(bytes + 8 * full_words, tail), static_cast<uint64_t>(full_words));
  }
  sum += mnb_checksum_length_term(static_cast<uint64_t>(nbytes));
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kLong));
  int64_t value;
  std::memcpy(&value, &sum, sizeof value);  // the same 64 bits, as a signed integer
  *out.mutable_data_ptr<int64_t>() = value;
  return out;
}

}  // namespace
}  // namespace monarch_nb_ext

TORCH_LIBRARY_IMPL(monarch_nb, CPU, m) {
  m.impl("grad_health", &monarch_nb_ext::grad_health_cpu);
  m.impl("checksum", &monarch_nb_ext::checksum_cpu);
}
