// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp's version: macros a program tests at compile time, and amp::version(),
/// the version of the library it runs with.
///
/// Versions follow README "Versions": a patch release fixes without changing
/// the API or the saved formats; before 1.0 a minor release may change the API
/// (CHANGELOG.md says how) and writes saved state that older releases refuse,
/// while it still reads every older format. CMake reads the version from this
/// header (project(amp VERSION ...)), so the two cannot disagree.
#pragma once

/// amp's major version.
#define AMP_VERSION_MAJOR 0
/// amp's minor version.
#define AMP_VERSION_MINOR 2
/// amp's patch version.
#define AMP_VERSION_PATCH 0
/// The version as "major.minor.patch".
#define AMP_VERSION_STRING "0.2.0"
/// The version as one number, major * 10000 + minor * 100 + patch, for `#if`.
#define AMP_VERSION (AMP_VERSION_MAJOR * 10000 + AMP_VERSION_MINOR * 100 + AMP_VERSION_PATCH)

namespace amp {

/// The version of the amp library linked into the program, "major.minor.patch":
/// the AMP_VERSION_STRING of the headers it was built from (a program built
/// against other headers than the library it links sees the two differ).
const char* version();

}  // namespace amp
