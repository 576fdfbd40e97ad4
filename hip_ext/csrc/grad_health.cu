// GPU kernel of monarch_nb::grad_health: one pass over every gradient of a model, in one launch.
// Written once in the CUDA subset that hipify maps to HIP; it includes only project headers
// (no torch), so it compiles offline with hipcc for gfx90a/gfx940 and with nvcc for sm_80/sm_90.
//
// A multi-tensor apply over a table of chunks: the host cuts each gradient into pieces of at most
// MNB_CHUNK_ELEMENTS elements (launch.h); block b takes chunks b, b + gridDim.x, ... so one launch
// covers any number of tensors of any sizes and of mixed dtypes (the dtype is per chunk, so a
// block never diverges on it within a chunk).
#include "elements.h"
#include "launch.h"

namespace {

constexpr int kUnroll = 4;  // loads in flight per thread

struct Health {
  double sum_sq;
  double nonfinite;
};

template <typename Bits>
__device__ __forceinline__ void mnb_accumulate(Bits bits, int dtype, Health& acc);

template <>
__device__ __forceinline__ void mnb_accumulate<uint32_t>(uint32_t bits, int, Health& acc) {
  if (mnb_f32_nonfinite(bits)) {
    acc.nonfinite += 1.0;
  } else {
    const double v = static_cast<double>(mnb_float_from_bits(bits));
    acc.sum_sq += v * v;
  }
}

template <>
__device__ __forceinline__ void mnb_accumulate<uint16_t>(uint16_t bits, int dtype, Health& acc) {
  const bool bad = dtype == MNB_F16 ? mnb_f16_nonfinite(bits) : mnb_bf16_nonfinite(bits);
  if (bad) {
    acc.nonfinite += 1.0;
  } else {
    const double v = static_cast<double>(dtype == MNB_F16 ? mnb_f16_to_float(bits) : mnb_bf16_to_float(bits));
    acc.sum_sq += v * v;
  }
}

template <>
__device__ __forceinline__ void mnb_accumulate<uint64_t>(uint64_t bits, int, Health& acc) {
  if (mnb_f64_nonfinite(bits)) {
    acc.nonfinite += 1.0;
  } else {
    double v;
    memcpy(&v, &bits, sizeof v);
    acc.sum_sq += v * v;
  }
}

// This thread's share of one chunk: elements tid, tid + blockDim.x, ... with kUnroll loads issued
// before any is used.
template <typename Bits>
__device__ __forceinline__ void mnb_chunk(const MnbChunk& chunk, Health& acc) {
  const Bits* data = static_cast<const Bits*>(chunk.data);
  const uint32_t n = chunk.numel;
  const uint32_t stride = blockDim.x;
  uint32_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    Bits v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      v[k] = data[i + k * stride];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      mnb_accumulate<Bits>(v[k], chunk.dtype, acc);
    }
  }
  for (; i < n; i += stride) {
    mnb_accumulate<Bits>(data[i], chunk.dtype, acc);
  }
}

__global__ void __launch_bounds__(MNB_BLOCK_THREADS)
    mnb_grad_health_kernel(const MnbChunk* chunks, int64_t num_chunks, unsigned int* counter, double* partials,
                           double* out) {
  extern __shared__ double warp_partials[];  // two per warp
  __shared__ bool last_block;
  Health acc = {0.0, 0.0};
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const MnbChunk chunk = chunks[c];
    switch (chunk.dtype) {
      case MNB_F32:
        mnb_chunk<uint32_t>(chunk, acc);
        break;
      case MNB_F16:
      case MNB_BF16:
        mnb_chunk<uint16_t>(chunk, acc);
        break;
      default:
        mnb_chunk<uint64_t>(chunk, acc);
        break;
    }
  }
  const int lanes = mnb_warp_size();
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int warp = static_cast<int>(threadIdx.x) / lanes;
  const int warps = (static_cast<int>(blockDim.x) + lanes - 1) / lanes;
  acc.sum_sq = mnb_warp_sum(acc.sum_sq);
  acc.nonfinite = mnb_warp_sum(acc.nonfinite);
  if (lane == 0) {
    warp_partials[2 * warp] = acc.sum_sq;
    warp_partials[2 * warp + 1] = acc.nonfinite;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Health block = {0.0, 0.0};
    for (int w = 0; w < warps; ++w) {
      block.sum_sq += warp_partials[2 * w];
      block.nonfinite += warp_partials[2 * w + 1];
    }
    partials[2 * blockIdx.x] = block.sum_sq;
    partials[2 * blockIdx.x + 1] = block.nonfinite;
    __threadfence();  // the partials are visible to every block before the counter says so
    last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last_block && threadIdx.x == 0) {
    __threadfence();
    const volatile double* done = partials;
    Health total = {0.0, 0.0};
    for (unsigned int b = 0; b < gridDim.x; ++b) {  // block order: the same sum on every run
      total.sum_sq += done[2 * b];
      total.nonfinite += done[2 * b + 1];
    }
    out[0] = total.sum_sq;
    out[1] = total.nonfinite;
  }
}

}  // namespace

int mnb_grad_health_launch(void* workspace, int64_t num_chunks, int blocks, int warp_size, double* out,
                           mnb_stream_t stream) {
  char* base = static_cast<char*>(workspace);
  const MnbChunk* chunks = reinterpret_cast<const MnbChunk*>(base);
  unsigned int* counter = reinterpret_cast<unsigned int*>(base + mnb_grad_health_counter_offset(num_chunks));
  double* partials = reinterpret_cast<double*>(base + mnb_grad_health_upload_bytes(num_chunks));
  const int warps = (MNB_BLOCK_THREADS + warp_size - 1) / warp_size;
  const size_t shared_bytes = 2 * sizeof(double) * static_cast<size_t>(warps);
  mnb_grad_health_kernel<<<blocks, MNB_BLOCK_THREADS, shared_bytes, stream>>>(chunks, num_chunks, counter, partials,
                                                                               out);
  return mnb_last_error();
}
