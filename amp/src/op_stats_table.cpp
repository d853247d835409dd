#include <amp/op_stats.h>

#include <c10/core/DeviceType.h>

#include <sstream>

namespace amp {

std::string format_op_stats(const std::vector<OpStats>& rows) {
  std::ostringstream out;
  out << "| op | device | policy | input dtypes | output | calls | casts | cache hits | bytes cast |\n"
      << "|---|---|---|---|---|---:|---:|---:|---:|\n";
  for (const OpStats& r : rows) {
    out << "| " << r.op << " | " << c10::DeviceTypeName(r.device, /*lower_case=*/true) << " | "
        << to_string(r.policy) << (r.in_backward ? " (backward)" : "") << " | " << r.input_dtypes
        << " | " << r.output_dtype << " | " << r.calls << " | " << r.casts << " | " << r.cache_hits
        << " | " << r.bytes_cast << " |\n";
  }
  return out.str();
}

}  // namespace amp
