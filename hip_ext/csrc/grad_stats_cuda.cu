// GPU kernel of monarch_nb::grad_stats, written once in the subset torch's hipify maps to HIP:
// it builds as CUDA on NVIDIA torch and as HIP on ROCm torch (torch.utils.cpp_extension
// hipifies .cu sources when torch.version.hip is set). The wavefront is 64 lanes on CDNA
// (MI200/MI300) and a warp 32 on NVIDIA: the code reads warpSize, never a literal.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

namespace monarch_nb_ext {

template <typename scalar_t>
__global__ void grad_stats_kernel(const scalar_t* __restrict__ data, int64_t n, double* out) {
  extern __shared__ double shared[];  // 2 doubles per warp: sum of squares, non-finite count
  double sum_sq = 0.0;
  double bad = 0.0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    const double v = static_cast<double>(data[i]);
    if (isfinite(v)) {
      sum_sq += v * v;
    } else {
      bad += 1.0;
    }
  }
  const int lane = threadIdx.x % warpSize;
  const int warp = threadIdx.x / warpSize;
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    sum_sq += __shfl_down_sync(0xffffffff, sum_sq, offset);
    bad += __shfl_down_sync(0xffffffff, bad, offset);
  }
  if (lane == 0) {
    shared[2 * warp] = sum_sq;
    shared[2 * warp + 1] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double block_sum = 0.0;
    double block_bad = 0.0;
    const int warps = (blockDim.x + warpSize - 1) / warpSize;
    for (int w = 0; w < warps; ++w) {
      block_sum += shared[2 * w];
      block_bad += shared[2 * w + 1];
    }
    atomicAdd(out, block_sum);
    atomicAdd(out + 1, block_bad);
  }
}

at::Tensor grad_stats_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.is_floating_point(), "grad_stats expects a floating-point tensor, got ", x.scalar_type());
  auto contiguous = x.contiguous();
  auto out = at::zeros({2}, x.options().dtype(at::kDouble));
  const int64_t n = contiguous.numel();
  if (n == 0) {
    return out;
  }
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1024));
  const int warp_size = at::cuda::getCurrentDeviceProperties()->warpSize;
  const size_t shared_bytes = 2 * sizeof(double) * ((threads + warp_size - 1) / warp_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, contiguous.scalar_type(), "grad_stats_cuda", [&] {
    grad_stats_kernel<scalar_t><<<blocks, threads, shared_bytes, at::cuda::getCurrentCUDAStream()>>>(
        contiguous.data_ptr<scalar_t>(), n, out.data_ptr<double>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace monarch_nb_ext

TORCH_LIBRARY_IMPL(monarch_nb, CUDA, m) {
  m.impl("grad_stats", &monarch_nb_ext::grad_stats_cuda);
}
