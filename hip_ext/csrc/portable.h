// The portable warp layer of monarch_nb's GPU kernels: one header that lets the same source build
// as CUDA (nvcc, NVIDIA torch) and as HIP (hipcc/clang, ROCm torch after hipify).
//
// What differs between the two, and is kept here and nowhere else:
// - the lane-mask type and the full mask: a warp is 32 lanes on NVIDIA and a 32-bit mask names all
//   of them; a wavefront is 64 lanes on CDNA (MI200/MI300) and 32 on RDNA, and HIP's masks are
//   64-bit (a 32-bit 0xffffffff names only half a CDNA wavefront);
// - shuffle-down: __shfl_down_sync on CUDA; on HIP the _sync builtins exist only from ROCm 6.2 on
//   (opt-in through HIP_ENABLE_WARP_SYNC_BUILTINS until ROCm 7) and need a 64-bit mask, so older
//   ROCm (Debian 12 ships 5.2) uses __shfl_down, which always spans the whole wavefront;
// - the warp size: never a literal. On the device it is `warpSize` (a variable on both platforms,
//   not a compile-time constant on ROCm 7); on the host, mnb_device_warp_size() asks the device
//   for its warpSize attribute.
//
// This header includes only the platform's runtime header, never torch's, so kernel files that
// include it compile offline with Debian's hipcc and with nvcc (scripts/hip-offline-check.sh).
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define MNB_HIP 1
#include <hip/hip_runtime.h>
typedef hipStream_t mnb_stream_t;
typedef unsigned long long mnb_lane_mask_t;
#else
#define MNB_HIP 0
#include <cuda_runtime.h>
typedef cudaStream_t mnb_stream_t;
typedef unsigned int mnb_lane_mask_t;
#endif

// Host-side queries, answered by the device (never a literal warp size).
// The device's warpSize attribute (32 on NVIDIA, 64 on CDNA, 32 on RDNA); 0 if the query fails.
inline int mnb_device_warp_size(int device) {
  int lanes = 0;
#if MNB_HIP
  (void)hipDeviceGetAttribute(&lanes, hipDeviceAttributeWarpSize, device);
#else
  (void)cudaDeviceGetAttribute(&lanes, cudaDevAttrWarpSize, device);
#endif
  return lanes;  // 0: the query failed
}

// Streaming multiprocessors (NVIDIA) or compute units (AMD) of the device.
inline int mnb_device_sm_count(int device) {
  int count = 0;
#if MNB_HIP
  (void)hipDeviceGetAttribute(&count, hipDeviceAttributeMultiprocessorCount, device);
#else
  (void)cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
#endif
  return count > 0 ? count : 1;
}

// The last launch error of this thread, cleared (cudaError_t / hipError_t as int; 0: success).
inline int mnb_last_error() {
#if MNB_HIP
  return static_cast<int>(hipGetLastError());
#else
  return static_cast<int>(cudaGetLastError());
#endif
}

// The runtime's text for an error code of mnb_last_error().
inline const char* mnb_error_string(int error) {
#if MNB_HIP
  return hipGetErrorString(static_cast<hipError_t>(error));
#else
  return cudaGetErrorString(static_cast<cudaError_t>(error));
#endif
}

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define MNB_DEVICE_CODE 1
#else
#define MNB_DEVICE_CODE 0
#endif

#if MNB_DEVICE_CODE

// Lanes in this device's warp (32 on NVIDIA; 64 on CDNA, 32 on RDNA in wave32 mode).
__device__ __forceinline__ int mnb_warp_size() { return warpSize; }

// The mask naming every lane of this device's warp.
__device__ __forceinline__ mnb_lane_mask_t mnb_full_mask() {
  const int lanes = mnb_warp_size();
  const int mask_bits = static_cast<int>(8 * sizeof(mnb_lane_mask_t));
  return lanes >= mask_bits ? ~static_cast<mnb_lane_mask_t>(0)
                            : ((static_cast<mnb_lane_mask_t>(1) << lanes) - 1);
}

// value held by lane (lane + delta) of the warp; every lane of the warp must call it together.
template <typename T>
__device__ __forceinline__ T mnb_shfl_down(T value, unsigned int delta) {
#if MNB_HIP
#if defined(HIP_ENABLE_WARP_SYNC_BUILTINS) || (defined(HIP_VERSION_MAJOR) && HIP_VERSION_MAJOR >= 7)
  return __shfl_down_sync(mnb_full_mask(), value, delta);
#else
  return __shfl_down(value, delta);
#endif
#else
  return __shfl_down_sync(mnb_full_mask(), value, delta);
#endif
}

// The sum of `value` over the lanes of the warp, in lane 0 (other lanes hold partial sums).
template <typename T>
__device__ __forceinline__ T mnb_warp_sum(T value) {
  for (int delta = mnb_warp_size() / 2; delta > 0; delta /= 2) {
    value += mnb_shfl_down(value, static_cast<unsigned int>(delta));
  }
  return value;
}

#endif  // MNB_DEVICE_CODE
