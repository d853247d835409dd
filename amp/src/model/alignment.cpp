// SPDX-License-Identifier: BSD-3-Clause
#include <amp/alignment.h>

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <sstream>

namespace amp {
namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// "torch::nn::Conv2dImpl" -> "Conv2d".
std::string kind_of(const torch::nn::Module& m) {
  std::string name = m.name();
  if (const size_t colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

// The GEMM dimensions a convolution multiplies over: the input channels
// per group (K, with the kernel's volume) and the output channels (N); a
// transposed one groups its outputs instead. ConvTransposeNdImpl derives
// from ConvNdImpl, whose options say which it is.
template <size_t D, class Derived>
bool add_conv(const torch::nn::Module& m, std::vector<std::pair<std::string, int64_t>>& dims) {
  const auto* conv = dynamic_cast<const torch::nn::ConvNdImpl<D, Derived>*>(&m);
  if (conv == nullptr) return false;
  const auto& o = conv->options;
  if (o.transposed()) {
    dims.emplace_back("in_channels", o.in_channels());
    dims.emplace_back("out_channels per group", o.out_channels() / o.groups());
  } else {
    dims.emplace_back("in_channels per group", o.in_channels() / o.groups());
    dims.emplace_back("out_channels", o.out_channels());
  }
  return true;
}

// The checked dimensions of one module (none for other kinds).
std::vector<std::pair<std::string, int64_t>> gemm_dimensions(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, int64_t>> dims;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&m)) {
    dims.emplace_back("in_features", linear->options.in_features());
    dims.emplace_back("out_features", linear->options.out_features());
    return dims;
  }
  using namespace torch::nn;
  add_conv<1, Conv1dImpl>(m, dims) || add_conv<2, Conv2dImpl>(m, dims) || add_conv<3, Conv3dImpl>(m, dims) ||
      add_conv<1, ConvTranspose1dImpl>(m, dims) || add_conv<2, ConvTranspose2dImpl>(m, dims) ||
      add_conv<3, ConvTranspose3dImpl>(m, dims);
  return dims;
}

}  // namespace

int64_t preferred_multiple(c10::ScalarType dtype, c10::Device device, const CpuPrecision& cpu) {
  const bool float8 = dtype == c10::kFloat8_e4m3fn || dtype == c10::kFloat8_e5m2;
  const bool half = dtype == c10::kHalf || dtype == c10::kBFloat16;
  if (device.is_cuda()) return float8 ? 16 : half ? 8 : 0;
  if (device.is_cpu() && half && cpu.runs_natively(dtype)) return 16;
  return 0;
}

std::vector<MisalignedLayer> misaligned_layers(const torch::nn::Module& model, c10::ScalarType dtype,
                                               c10::Device device, const CpuPrecision& cpu) {
  std::vector<MisalignedLayer> out;
  const int64_t multiple = preferred_multiple(dtype, device, cpu);
  if (multiple == 0) return out;
  auto check = [&](const std::string& path, const torch::nn::Module& m) {
    for (const auto& [dimension, size] : gemm_dimensions(m)) {
      if (size % multiple != 0) out.push_back({path, kind_of(m), dimension, size, round_up(size, multiple)});
    }
  };
  check("", model);
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    check(item.key(), *item.value());
  }
  return out;
}

std::string format_misaligned_layers(const std::vector<MisalignedLayer>& layers, int64_t multiple) {
  std::ostringstream out;
  if (multiple == 0) {
    out << "No preferred multiple for this dtype on this device: nothing to pad.\n";
    return out.str();
  }
  if (layers.empty()) {
    out << "Every Linear and convolution dimension is a multiple of " << multiple << ".\n";
    return out.str();
  }
  out << "| module | kind | dimension | size | pad to (multiple of " << multiple << ") |\n|---|---|---|---:|---:|\n";
  for (const MisalignedLayer& l : layers) {
    out << "| " << (l.module.empty() ? "(the model)" : l.module) << " | " << l.kind << " | " << l.dimension << " | "
        << l.size << " | " << l.padded << " |\n";
  }
  return out.str();
}

}  // namespace amp
