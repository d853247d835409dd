// SPDX-License-Identifier: BSD-3-Clause
// The translation unit that carries the precompiled header the examples,
// tools and test programs share (CMakeLists.txt: amp_program_pch).
