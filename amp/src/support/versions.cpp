// SPDX-License-Identifier: BSD-3-Clause
#include "support/versions.h"

#include <amp/version.h>

#include <ATen/Version.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/headeronly/version.h>

#include <mutex>
#include <regex>

namespace amp {

const char* version() { return AMP_VERSION_STRING; }

namespace detail {
namespace {

// "2.11" of "2.11.0" (or of "2.11.0a0+git...").
std::string major_minor(std::string_view version) {
  std::smatch m;
  const std::string text(version);
  return std::regex_search(text, m, std::regex(R"(^(\d+\.\d+))")) ? m[1].str() : "";
}

}  // namespace

std::string torch_version_in(std::string_view build_config) {
  std::smatch m;
  const std::string text(build_config);
  return std::regex_search(text, m, std::regex(R"(TORCH_VERSION=([0-9][^,\s]*))")) ? m[1].str() : "";
}

void require_torch_version(std::string_view compiled, std::string_view running) {
  const std::string want = major_minor(compiled);
  TORCH_CHECK(!want.empty() && want == major_minor(running), "amp: this amp was compiled against LibTorch ",
              compiled, " but runs against LibTorch ", running.empty() ? "of unknown version" : running,
              " (the libtorch found on the library path). amp mirrors one LibTorch's autocast lists and calls its "
              "private ops, and LibTorch keeps no ABI across minor versions: rebuild amp and the program against "
              "the LibTorch they run with, or put LibTorch ", compiled, "'s libraries first on the library path.");
}

void require_linked_torch() {
  static std::once_flag checked;
  static std::string error;
  std::call_once(checked, [] {
    try {
      require_torch_version(c10::str(TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".", TORCH_VERSION_PATCH),
                            torch_version_in(at::show_config()));
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  });
  TORCH_CHECK(error.empty(), error);
}

}  // namespace detail
}  // namespace amp
