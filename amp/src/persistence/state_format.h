// SPDX-License-Identifier: BSD-3-Clause
// Private: the format version amp's saved state and checkpoints carry, so a
// newer amp's files are told from older ones'. Format 1 had no version entry
// (amp 0.1); every amp reads each older format and refuses newer ones, before
// it changes anything.
#pragma once

#include <torch/serialize/archive.h>

#include <cstdint>

namespace amp::detail {

// The format this amp writes; bump it when what is written changes meaning.
constexpr int64_t kStateFormat = 2;
// The entry that holds it.
constexpr const char* kStateFormatEntry = "amp_format";

// Writes kStateFormat into `archive`.
void write_state_format(torch::serialize::OutputArchive& archive);
// The format `archive` was written in (1 without the entry). Throws
// c10::Error naming `what` ("state", "checkpoint 'path'") for a newer one.
int64_t read_state_format(torch::serialize::InputArchive& archive, const std::string& what);

}  // namespace amp::detail
