// What one element or one 64-bit word means, shared by the CPU kernels (ops_cpu.cpp) and the GPU
// kernels (grad_health.cu, checksum.cu), so the three implementations cannot drift apart:
// dtype codes, the non-finite test on an element's bits, half/bfloat16 decoding, and the word
// hash of monarch_nb::checksum. No torch header; plain C++ for the host compiler, and the platform's
// runtime header (through portable.h) only when nvcc or hipcc compile it.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIP__)
#include "portable.h"  // the runtime header: __host__, __device__, device memcpy
#define MNB_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define MNB_HOST_DEVICE inline __attribute__((always_inline))  // inlined into each ISA's clone of a loop
#else
#define MNB_HOST_DEVICE inline
#endif

// Element types grad_health reads (the `dtype` of a chunk of a gradient).
enum MnbDtype : int { MNB_F32 = 0, MNB_F16 = 1, MNB_BF16 = 2, MNB_F64 = 3 };

MNB_HOST_DEVICE float mnb_float_from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// True when an IEEE half (bits) is NaN or +-Inf: exponent all ones.
MNB_HOST_DEVICE bool mnb_f16_nonfinite(uint16_t bits) { return (bits & 0x7c00u) == 0x7c00u; }
// True when a bfloat16 (bits) is NaN or +-Inf.
MNB_HOST_DEVICE bool mnb_bf16_nonfinite(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u; }
// True when a float32 (bits) is NaN or +-Inf.
MNB_HOST_DEVICE bool mnb_f32_nonfinite(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }
// True when a float64 (bits) is NaN or +-Inf.
MNB_HOST_DEVICE bool mnb_f64_nonfinite(uint64_t bits) {
  return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

MNB_HOST_DEVICE uint32_t mnb_bits_from_float(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return bits;
}

// The value of an IEEE half given by its bits, exact for every half (zero, subnormal, normal,
// Inf, NaN), without branches so that loops over it vectorize (the FP16 library's algorithm,
// also used by c10::Half).
MNB_HOST_DEVICE float mnb_f16_to_float(uint16_t bits) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = mnb_float_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = mnb_float_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? mnb_bits_from_float(denormalized) : mnb_bits_from_float(normalized);
  return mnb_float_from_bits(sign | magnitude);
}

// The value of a bfloat16 given by its bits (the upper half of a float32).
MNB_HOST_DEVICE float mnb_bf16_to_float(uint16_t bits) {
  return mnb_float_from_bits(static_cast<uint32_t>(bits) << 16);
}

// -- monarch_nb::checksum ------------------------------------------------------------------------
// The byte layout and formula are specified in hip_ext/_reference.py (checksum_reference):
//   word i = bytes [8i, 8i+8) of the tensor, little-endian, the last word zero-padded;
//   checksum = sum_i splitmix64(word_i ^ (i * GAMMA)) + splitmix64(nbytes ^ LENGTH_SALT)  (mod 2^64)
// Addition mod 2^64 is commutative, so any split of the words over threads, blocks or chunks gives
// the same value.
#define MNB_GAMMA 0x9E3779B97F4A7C15ull
#define MNB_LENGTH_SALT 0xD6E8FEB86659FD93ull

// splitmix64's output function applied to x + GAMMA (Steele, Lea, Flood 2014; Vigna's constants).
MNB_HOST_DEVICE uint64_t mnb_splitmix64(uint64_t x) {
  uint64_t z = x + MNB_GAMMA;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The term word `index` (0-based) with value `word` adds to the checksum.
MNB_HOST_DEVICE uint64_t mnb_checksum_term(uint64_t word, uint64_t index) {
  return mnb_splitmix64(word ^ (index * MNB_GAMMA));
}

// The term the tensor's length in bytes adds (tells apart tensors that differ only in zero padding).
MNB_HOST_DEVICE uint64_t mnb_checksum_length_term(uint64_t nbytes) {
  return mnb_splitmix64(nbytes ^ MNB_LENGTH_SALT);
}

// The little-endian word made of the `count` (< 8) bytes at `bytes`, zero-padded.
MNB_HOST_DEVICE uint64_t mnb_tail_word(const unsigned char* bytes, int count) {
  uint64_t word = 0;
  for (int k = 0; k < count; ++k) {
    word |= static_cast<uint64_t>(bytes[k]) << (8 * k);
  }
  return word;
}
