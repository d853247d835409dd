// SPDX-License-Identifier: BSD-3-Clause
#include "fp8/fp8_linear.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <tuple>
#include <utility>

namespace amp::detail {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// _scaled_mm wants its second operand column-major: t's values, laid out
// as its transpose is.
at::Tensor column_major(const at::Tensor& t) { return fp8_transposed(t).t(); }

// a8 [m, k] . b8 [k, n] times the inverse scales, in `dtype`: the device's
// float8 GEMM. The CPU has none: ATen's _scaled_mm there runs oneDNN's
// reference matmul, a scalar loop (41 s for two iterations of the example
// transformer in tools/precision_report). Emulated instead as a float32
// GEMM of the float8 values (each exact in float32, as are their
// products), accumulated in float32 as that loop accumulates, then scaled:
// within float32 rounding of it, and 0.8 s for the same two iterations.
at::Tensor scaled_mm(const at::Tensor& a8, const at::Tensor& b8, const at::Tensor& a_inv, const at::Tensor& b_inv,
                     at::ScalarType dtype) {
  if (!a8.is_cpu()) return at::_scaled_mm(a8, b8, a_inv, b_inv, std::nullopt, std::nullopt, dtype);
  return at::mm(a8.to(at::kFloat), b8.to(at::kFloat)).mul_(a_inv * b_inv).to(dtype);
}

struct Fp8LinearBackward final : Node {
  std::shared_ptr<Fp8Site> site;
  at::Tensor input8, input_inv, weight8, weight_inv;
  std::vector<int64_t> input_sizes, bias_sizes;
  at::ScalarType input_dtype, weight_dtype, bias_dtype;

  std::string name() const override { return "amp::Fp8LinearBackward"; }

  variable_list apply(variable_list&& grads) override {
    // The float8 operands carry no graph: a second derivative would be
    // silently wrong.
    TORCH_CHECK(!at::GradMode::is_enabled(), "amp: the backward of a float8 GEMM (the fp8 property) cannot be "
                "differentiated again, as create_graph=true (a gradient penalty) asks. Keep the layers that loss "
                "reaches out of float8 (Options::keep_fp32, or a custom_fwd float32 region), or train without fp8.");
    variable_list out(3);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const at::Tensor grad2 = grad.reshape({-1, grad.size(-1)}).contiguous();
    // The weight's gradient takes the gradient transposed: written by the
    // pass that quantizes it.
    at::Tensor grad8, grad_inv, grad8_t;
    if (task_should_compute_output(1)) {
      std::tie(grad8, grad_inv, grad8_t) = site->grad_output.quantize_transposed(grad2);
    } else {
      std::tie(grad8, grad_inv) = site->grad_output.quantize(grad2);
    }
    if (task_should_compute_output(0)) {
      out[0] = fp8_input_gradient_gemm({grad8, grad_inv}, {weight8, weight_inv}, input_dtype).reshape(input_sizes);
    }
    if (task_should_compute_output(1)) {
      out[1] = fp8_weight_gradient_gemm({grad8_t, grad_inv}, {input8, input_inv}, weight_dtype);
    }
    if (task_should_compute_output(2)) out[2] = at::sum_to(grad2, bias_sizes).to(bias_dtype);
    return out;
  }
};

}  // namespace

at::Tensor fp8_forward_gemm(const Fp8Operand& input, const Fp8Operand& weight, at::ScalarType dtype) {
  return scaled_mm(input.values, weight.values.t(), input.inverse_scale, weight.inverse_scale, dtype);
}

at::Tensor fp8_input_gradient_gemm(const Fp8Operand& grad, const Fp8Operand& weight, at::ScalarType dtype) {
  return scaled_mm(grad.values, column_major(weight.values), grad.inverse_scale, weight.inverse_scale, dtype);
}

at::Tensor fp8_weight_gradient_gemm(const Fp8Operand& grad_t, const Fp8Operand& input, at::ScalarType dtype) {
  return scaled_mm(grad_t.values, column_major(input.values), grad_t.inverse_scale, input.inverse_scale, dtype);
}

at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      std::shared_ptr<Fp8Site> site, bool rerun) {
  const at::Tensor input2 = input.reshape({-1, input.size(-1)}).contiguous();
  auto [input8, input_inv] = site->input.quantize(input2.detach(), /*tally=*/!rerun);
  auto [weight8, weight_inv] = site->quantized_weight(weight);
  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    output = fp8_forward_gemm({input8, input_inv}, {weight8, weight_inv}, input.scalar_type());
    if (bias && bias->defined()) output.add_(*bias);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes.back() = weight.size(0);
    output = at::_unsafe_view(output, sizes);  // not a view: autograd takes it as the node's own output
  }
  const bool with_bias = bias && bias->defined();
  if (at::GradMode::is_enabled() &&
      (input.requires_grad() || weight.requires_grad() || (with_bias && bias->requires_grad()))) {
    auto node = std::make_shared<Fp8LinearBackward>();
    node->site = std::move(site);
    node->input8 = std::move(input8);
    node->input_inv = std::move(input_inv);
    node->weight8 = std::move(weight8);
    node->weight_inv = std::move(weight_inv);
    node->input_sizes = input.sizes().vec();
    node->input_dtype = input.scalar_type();
    node->weight_dtype = weight.scalar_type();
    node->bias_dtype = with_bias ? bias->scalar_type() : input.scalar_type();
    if (with_bias) node->bias_sizes = bias->sizes().vec();
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, with_bias ? *bias : at::Tensor()));
    torch::autograd::set_history(output, node);
  }
  return output;
}

std::pair<at::Tensor, at::Tensor> Fp8Site::quantized_weight(const at::Tensor& w) {
  std::lock_guard<std::mutex> lock(mutex_);
  // O2/O5 allocate a parameter's low-precision copy anew each time its model
  // enters computing (micro-batches): the parameter is the same weight while
  // its version (which its views share) stands.
  const at::TensorBase& root = w.is_view() ? w._base() : w;  // the layer reads its weight through a view
  const void* identity = root.is_leaf() ? static_cast<const void*>(root.unsafeGetTensorImpl()) : w.const_data_ptr();
  const uint32_t version = w._version();
  std::vector<int64_t> geometry{w.storage_offset()};
  geometry.insert(geometry.end(), w.sizes().begin(), w.sizes().end());
  geometry.insert(geometry.end(), w.strides().begin(), w.strides().end());
  if (cached_.first.defined() && identity == cached_identity_ && geometry == cached_geometry_ &&
      version == cached_version_ && weight.generation() == cached_generation_ && w.scalar_type() == cached_dtype_) {
    return cached_;
  }
  cached_ = weight.quantize(w.detach());
  cached_identity_ = identity;
  cached_geometry_ = std::move(geometry);
  cached_version_ = version;
  cached_generation_ = weight.generation();
  cached_dtype_ = w.scalar_type();
  ++quantizations_;
  return cached_;
}

int64_t Fp8Site::weight_quantizations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return quantizations_;
}

bool fp8_shapes_fit(const at::Tensor& input, int64_t out_features) {
  if (!input.is_cuda()) return true;
  const int64_t in = input.size(-1), rows = in > 0 ? input.numel() / in : 0;
  return in % 16 == 0 && out_features % 16 == 0 && rows % 16 == 0;
}

std::string float8_unavailable(c10::Device device) {
  if (!device.is_cuda()) return "";
  try {
    const at::Tensor probe = at::zeros({16, 16}, at::TensorOptions(device)).to(at::kFloat8_e4m3fn);
    const at::Tensor one = at::ones({}, at::TensorOptions(device));
    at::_scaled_mm(probe, probe.t(), one, one, std::nullopt, std::nullopt, at::kBFloat16);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace amp::detail
