// SPDX-License-Identifier: BSD-3-Clause
#include "persistence/state_format.h"

#include <amp/version.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace amp::detail {

void write_state_format(torch::serialize::OutputArchive& archive) {
  archive.write(kStateFormatEntry, at::scalar_tensor(kStateFormat, at::kLong));
}

int64_t read_state_format(torch::serialize::InputArchive& archive, const std::string& what) {
  at::Tensor value;
  if (!archive.try_read(kStateFormatEntry, value)) return 1;
  TORCH_CHECK(value.numel() == 1 && !value.is_floating_point(), "amp: the ", what, "'s entry '", kStateFormatEntry,
              "' should hold one integer, got ", value.scalar_type(), " with ", value.numel(), " values.");
  const int64_t format = value.item<int64_t>();
  TORCH_CHECK(format >= 1, "amp: the ", what, " says format ", format, ", which no amp writes.");
  TORCH_CHECK(format <= kStateFormat, "amp: the ", what, " was written by a newer amp, in format ", format,
              "; amp ", AMP_VERSION_STRING, " reads formats 1 to ", kStateFormat, ". Load it with the amp that "
              "wrote it (or a newer one), or save it again there with save_fp32_weights for the weights alone. "
              "Nothing was loaded.");
  return format;
}

}  // namespace amp::detail
