// The torch binding of the GPU kernels, registered for the CUDA dispatch key (which is also the
// key of ROCm devices: torch calls them "cuda"). Built by the host compiler; on ROCm torch,
// cpp_extension hipifies it (c10::cuda -> c10::hip, cudaStream_t -> hipStream_t). It turns
// tensors into pointers, sizes and a stream and calls the launchers of launch.h, so the kernel
// files never see a torch header.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "dtype_code.hpp"
#include "elements.h"
#include "launch.h"

namespace monarch_nb_ext {
namespace {

constexpr int kBlocksPerSm = 2048 / MNB_BLOCK_THREADS;  // enough resident threads to keep loads in flight

int warp_size(const c10::Device& device) {
  const int lanes = mnb_device_warp_size(device.index());
  TORCH_CHECK(lanes > 0, "could not read the warp size of ", device);
  return lanes;
}

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == 0, what, " kernel launch failed: ", mnb_error_string(error));
}

at::Tensor grad_health_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "grad_health: the CUDA kernel needs at least one tensor");
  const c10::Device device = tensors[0].device();
  c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> dense;  // keeps contiguous copies alive until the kernel is queued
  dense.reserve(tensors.size());
  std::vector<MnbChunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == device, "grad_health expects all tensors on one device; tensor ", i, " is on ",
                t.device(), ", tensor 0 on ", device);
    const int code = dtype_code(t, i);
    dense.push_back(t.contiguous());
    const char* base = static_cast<const char*>(dense.back().const_data_ptr());
    const int64_t numel = dense.back().numel();
    for (int64_t start = 0; start < numel; start += MNB_CHUNK_ELEMENTS) {
      const int64_t n = std::min<int64_t>(MNB_CHUNK_ELEMENTS, numel - start);
      chunks.push_back(MnbChunk{base + start * t.element_size(), static_cast<uint32_t>(n), code});
    }
  }
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kDouble).device(device));
  if (chunks.empty()) {
    return out.zero_();
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int sms = mnb_device_sm_count(device.index());
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_chunks, int64_t{sms} * kBlocksPerSm)));
  // The chunk table and the zeroed counter go up in one asynchronous copy from pinned memory
  // (torch keeps the pinned block until the copy has run).
  const int64_t upload = static_cast<int64_t>(mnb_grad_health_upload_bytes(num_chunks));
  at::Tensor host = at::empty({upload}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memset(host.mutable_data_ptr(), 0, static_cast<size_t>(upload));
  std::memcpy(host.mutable_data_ptr(), chunks.data(), chunks.size() * sizeof(MnbChunk));
  at::Tensor workspace = at::empty({static_cast<int64_t>(mnb_grad_health_workspace_bytes(num_chunks, blocks))},
                                   at::TensorOptions().dtype(at::kByte).device(device));
  workspace.narrow(0, 0, upload).copy_(host, /*non_blocking=*/true);
  check_launch(mnb_grad_health_launch(workspace.mutable_data_ptr(), num_chunks, blocks,
                                      warp_size(device), out.mutable_data_ptr<double>(),
                                      c10::cuda::getCurrentCUDAStream(device.index()).stream()),
               "grad_health");
  return out;
}

at::Tensor checksum_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.layout() == at::kStrided, "checksum expects a dense (strided) tensor, got layout ", x.layout());
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dense = x.resolve_conj().resolve_neg().contiguous();
  if (reinterpret_cast<uintptr_t>(dense.const_data_ptr()) % 8 != 0) {
    dense = dense.clone();  // a view at an odd offset: the kernel reads aligned 64-bit words
  }
  const int64_t nbytes = dense.numel() * dense.element_size();
  const int sms = mnb_device_sm_count(x.device().index());
  const int64_t words = (nbytes + 7) / 8;
  const int64_t wanted = (words + MNB_BLOCK_THREADS - 1) / MNB_BLOCK_THREADS;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sms} * kBlocksPerSm)));
  at::Tensor workspace = at::zeros({static_cast<int64_t>(mnb_checksum_workspace_bytes(blocks))},
                                   at::TensorOptions().dtype(at::kByte).device(x.device()));
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kLong).device(x.device()));
  check_launch(mnb_checksum_launch(dense.const_data_ptr(), nbytes, workspace.mutable_data_ptr(), blocks,
                                   warp_size(x.device()), out.mutable_data_ptr<int64_t>(),
                                   c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "checksum");
  return out;
}

}  // namespace
}  // namespace monarch_nb_ext

TORCH_LIBRARY_IMPL(monarch_nb, CUDA, m) {
  m.impl("grad_health", &monarch_nb_ext::grad_health_cuda);
  m.impl("checksum", &monarch_nb_ext::checksum_cuda);
}
