// GPU kernel of monarch_nb::checksum: a 64-bit hash of a tensor's bytes that does not depend on
// how the bytes are split over threads and blocks (each 64-bit word adds a term that depends only
// on its value and index; the terms are summed mod 2^64), so it equals the CPU kernel's and the
// pure-torch reference's value for the same bytes. The formula is in elements.h.
// Written once in the CUDA subset that hipify maps to HIP; it includes only project headers.
#include "elements.h"
#include "launch.h"

namespace {

constexpr int kUnroll = 4;  // loads in flight per thread

__global__ void __launch_bounds__(MNB_BLOCK_THREADS)
    mnb_checksum_kernel(const unsigned char* data, int64_t nbytes, unsigned int* counter, uint64_t* partials,
                        int64_t* out) {
  extern __shared__ uint64_t warp_sums[];  // one per warp
  __shared__ bool last_block;
  const uint64_t* words = reinterpret_cast<const uint64_t*>(data);
  const uint64_t full_words = static_cast<uint64_t>(nbytes) / 8;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint64_t acc = 0;
  for (; i + (kUnroll - 1) * stride < full_words; i += kUnroll * stride) {
    uint64_t w[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      w[k] = words[i + k * stride];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      acc += mnb_checksum_term(w[k], i + k * stride);
    }
  }
  for (; i < full_words; i += stride) {
    acc += mnb_checksum_term(words[i], i);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int tail = static_cast<int>(static_cast<uint64_t>(nbytes) - 8 * full_words);
    if (tail > 0) {
      acc += mnb_checksum_term(mnb_tail_word(data + 8 * full_words, tail), full_words);
    }
    acc += mnb_checksum_length_term(static_cast<uint64_t>(nbytes));
  }
  const int lanes = mnb_warp_size();
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int warp = static_cast<int>(threadIdx.x) / lanes;
  const int warps = (static_cast<int>(blockDim.x) + lanes - 1) / lanes;
  acc = mnb_warp_sum(acc);
  if (lane == 0) {
    warp_sums[warp] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t block = 0;
    for (int w = 0; w < warps; ++w) {
      block += warp_sums[w];
    }
    partials[blockIdx.x] = block;
    __threadfence();  // the partial is visible to every block before the counter says so
    last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last_block && threadIdx.x == 0) {
    __threadfence();
    const volatile uint64_t* done = partials;
    uint64_t total = 0;
    for (unsigned int b = 0; b < gridDim.x; ++b) {
      total += done[b];
    }
    out[0] = static_cast<int64_t>(total);  // two's complement: the same 64 bits
  }
}

}  // namespace

int mnb_checksum_launch(const void* data, int64_t nbytes, void* workspace, int blocks, int warp_size, int64_t* out,
                        mnb_stream_t stream) {
  unsigned int* counter = static_cast<unsigned int*>(workspace);
  uint64_t* partials = reinterpret_cast<uint64_t*>(static_cast<char*>(workspace) + 16);
  const int warps = (MNB_BLOCK_THREADS + warp_size - 1) / warp_size;
  const size_t shared_bytes = sizeof(uint64_t) * static_cast<size_t>(warps);
  mnb_checksum_kernel<<<blocks, MNB_BLOCK_THREADS, shared_bytes, stream>>>(static_cast<const unsigned char*>(data),
                                                                            nbytes, counter, partials, out);
  return mnb_last_error();
}
