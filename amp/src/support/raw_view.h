// SPDX-License-Identifier: BSD-3-Clause
// Private: a view of a tensor made without the dispatcher, where a view op
// costs the host about 3K instructions - for amp's own temporaries and
// flags, which carry no autograd history and whose version counters nothing
// reads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <utility>

namespace amp::detail {

// `base`'s values from element `offset` on, contiguous in `shape`.
inline at::Tensor raw_view(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous(shape);
  return at::Tensor(std::move(impl));
}

}  // namespace amp::detail
