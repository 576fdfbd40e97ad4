// CPU kernel of monarch_nb::grad_stats: one pass over a floating-point tensor giving
// [sum of squares of its finite elements, number of non-finite elements] as float64.
// The training loop calls it on every gradient before the all-reduce: a NaN-poisoned
// rank is caught locally instead of poisoning every replica, and the grad norm comes free.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <utility>

namespace monarch_nb_ext {

at::Tensor grad_stats_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.is_floating_point(), "grad_stats expects a floating-point tensor, got ", x.scalar_type());
  auto contiguous = x.contiguous();
  using Partial = std::pair<double, int64_t>;  // (sum of squares of finite values, non-finite count)
  Partial total{0.0, 0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, contiguous.scalar_type(), "grad_stats_cpu", [&] {
    const scalar_t* data = contiguous.data_ptr<scalar_t>();
    total = at::parallel_reduce(
        0, contiguous.numel(), 1 << 16, Partial{0.0, 0},
        [&](int64_t begin, int64_t end, Partial acc) {
          for (int64_t i = begin; i < end; ++i) {
            const double v = static_cast<double>(data[i]);
            if (std::isfinite(v)) {
              acc.first += v * v;
            } else {
              ++acc.second;
            }
          }
          return acc;
        },
        [](Partial a, Partial b) { return Partial{a.first + b.first, a.second + b.second}; });
  });
  auto out = at::empty({2}, x.options().dtype(at::kDouble).device(at::kCPU));
  out[0] = total.first;
  out[1] = static_cast<double>(total.second);
  return out;
}

}  // namespace monarch_nb_ext

TORCH_LIBRARY_IMPL(monarch_nb, CPU, m) {
  m.impl("grad_stats", &monarch_nb_ext::grad_stats_cpu);
}
