// Private: amp's log lines, on stderr, prefixed "amp: ".
#pragma once

#include <iostream>
#include <string_view>

namespace amp::detail {

inline void log_line(std::string_view line) {
  std::cerr << "amp: " << line << std::endl;
}

}  // namespace amp::detail
