// The element type of a tensor as a kernel's MnbDtype code, checked once for the CPU binding
// (ops_cpu.cpp) and the GPU binding (ops_cuda.cpp): both accept exactly the same types and say
// the same thing about the others. Needs torch's headers: a .hpp, included by the bindings only,
// never by a kernel file (whose headers are the portable .h files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

#include "elements.h"

namespace monarch_nb_ext {

// MNB_F32, MNB_F16, MNB_BF16 or MNB_F64 for tensor `index` of grad_health's list; any other dtype
// fails with a message naming the tensor and its type.
inline int dtype_code(const at::Tensor& t, size_t index) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return MNB_F32;
    case at::kHalf:
      return MNB_F16;
    case at::kBFloat16:
      return MNB_BF16;
    case at::kDouble:
      return MNB_F64;
    default:
      TORCH_CHECK(false, "grad_health expects float32, float16, bfloat16 or float64 tensors; tensor ", index, " is ",
                  t.scalar_type());
  }
}

}  // namespace monarch_nb_ext
