// SPDX-License-Identifier: BSD-3-Clause
// Private: the LibTorch amp runs against must be the one it was compiled
// against. amp mirrors one LibTorch's autocast lists and calls its private
// ops; a libtorch swapped under a built program (another wheel on the
// library path) would otherwise miscast or crash far from the cause.
#pragma once

#include <string>
#include <string_view>

namespace amp::detail {

// "2.11.0" from LibTorch's build configuration (at::show_config()'s
// TORCH_VERSION=...), or "" where it says none.
std::string torch_version_in(std::string_view build_config);

// Throws c10::Error, saying what to do, when `running` ("2.12.0", or "" when
// unknown) is not of `compiled`'s major.minor version. Patch releases keep
// the ABI and pass.
void require_torch_version(std::string_view compiled, std::string_view running);

// require_torch_version for the LibTorch linked in: once per process (the
// first amp::initialize), then a no-op.
void require_linked_torch();

}  // namespace amp::detail
