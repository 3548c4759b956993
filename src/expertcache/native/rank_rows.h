// Shared by the two native modules (decode.cpp, quant.cpp): where a decode step's experts write
// their outputs into their router ranks' rows, for `combine`.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// `out`'s data where a call writes its n experts' outputs, each D wide, to rows `rows` of
// out [A, D] (fp32); nullptr without `out`. Checks both.
inline float* rank_rows(const c10::optional<torch::Tensor>& out, const std::vector<int64_t>& rows, int64_t n,
                        int64_t D) {
  if (!out.has_value()) return nullptr;
  const torch::Tensor& o = *out;
  TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == torch::kFloat32 && o.dim() == 2 && o.is_contiguous() &&
                  o.size(1) == D,
              "out: expected a contiguous fp32 CPU tensor [A, ", D, "]");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == n, "rows: expected one per expert (", n, "), got ", rows.size());
  for (int64_t r : rows)
    TORCH_CHECK(r >= 0 && r < o.size(0), "rows: expected indices below ", o.size(0), ", got ", r);
  return o.data_ptr<float>();
}
