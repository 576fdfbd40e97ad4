// The interface between the torch binding (ops_cuda.cpp, built by the host compiler) and the GPU
// kernels (grad_health.cu, checksum.cu, built by nvcc or hipcc): plain pointers, sizes and a
// stream, no torch types, so the kernel files compile without torch's GPU headers.
//
// Both launchers reduce in one launch: every block writes its partial result, and the last block
// to finish (counted with an atomic on a zeroed counter in the workspace) adds the partials up in
// block order, so the result does not depend on which block finished when.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "portable.h"

// One piece of one gradient: at most MNB_CHUNK_ELEMENTS consecutive elements of one dtype.
struct MnbChunk {
  const void* data;  // first element of the piece (aligned to its element size)
  uint32_t numel;    // elements in the piece
  int32_t dtype;     // an MnbDtype
};

#define MNB_CHUNK_ELEMENTS (1u << 16)
#define MNB_BLOCK_THREADS 256

// grad_health's device workspace, in bytes from its start: the chunk table, then a 32-bit counter
// that must be zero at launch (padded to 16 bytes), then `blocks` partials of two doubles. The
// host uploads the table and the zeroed counter in one copy of mnb_grad_health_upload_bytes().
inline size_t mnb_grad_health_counter_offset(int64_t num_chunks) {
  return static_cast<size_t>(num_chunks) * sizeof(MnbChunk);
}
inline size_t mnb_grad_health_upload_bytes(int64_t num_chunks) {
  return mnb_grad_health_counter_offset(num_chunks) + 16;
}
inline size_t mnb_grad_health_workspace_bytes(int64_t num_chunks, int blocks) {
  return mnb_grad_health_upload_bytes(num_chunks) + 2 * sizeof(double) * static_cast<size_t>(blocks);
}

// Writes out[0] = sum of squares of the finite elements of all chunks (float64) and out[1] = the
// number of non-finite ones (as a float64), with `blocks` blocks of MNB_BLOCK_THREADS threads on
// `stream`. `warp_size` is the device's warpSize property (sizes the shared memory).
// Returns the launch's error code (cudaError_t / hipError_t as int; 0 is success).
int mnb_grad_health_launch(void* workspace, int64_t num_chunks, int blocks, int warp_size, double* out,
                           mnb_stream_t stream);

// checksum's device workspace: a 32-bit counter that must be zero at launch (padded to 16 bytes),
// then `blocks` 64-bit partials.
inline size_t mnb_checksum_workspace_bytes(int blocks) { return 16 + sizeof(uint64_t) * static_cast<size_t>(blocks); }

// Writes out[0] = checksum of the `nbytes` bytes at `data` (8-byte aligned) as int64, with `blocks`
// blocks of MNB_BLOCK_THREADS threads on `stream`. Returns the launch's error code.
int mnb_checksum_launch(const void* data, int64_t nbytes, void* workspace, int blocks, int warp_size, int64_t* out,
                        mnb_stream_t stream);
