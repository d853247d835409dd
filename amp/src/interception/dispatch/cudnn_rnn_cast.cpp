// SPDX-License-Identifier: BSD-3-Clause
// aten::_cudnn_rnn (nn::LSTM, GRU and RNN on CUDA) in amp's dtype.
//
// LibTorch's autocast kernel for it packs the weights into a float16 copy of
// cuDNN's flat weight buffer, whatever the autocast dtype, with ATen helpers
// LibTorch does not install. amp casts the weights one by one instead (each
// through the cast cache) and passes no buffer: _cudnn_rnn then packs them
// itself, one copy, as the native kernel's packing is. bfloat16 runs in
// cuDNN only where LibTorch says cuDNN has bfloat16 RNNs (9.13 and later);
// elsewhere the RNN runs in float32, as LibTorch would run it without
// autocast, rather than in a dtype the level did not ask for.
#include "interception/dispatch/typed_kernel.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <string_view>

namespace amp::detail {
namespace {

// _cudnn_rnn warns on every call without a packed buffer; amp chose that.
// Warning handlers are per thread, so this guard affects this call only.
class QuietUnpackedWeights final : public c10::WarningHandler {
 public:
  QuietUnpackedWeights() : outer_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~QuietUnpackedWeights() override { c10::WarningUtils::set_warning_handler(outer_); }
  QuietUnpackedWeights(const QuietUnpackedWeights&) = delete;
  QuietUnpackedWeights& operator=(const QuietUnpackedWeights&) = delete;

  void process(const c10::Warning& warning) override {
    constexpr std::string_view kUnpacked = "RNN module weights are not part of single contiguous";
    if (std::string_view(warning.msg()).find(kUnpacked) != std::string_view::npos) return;
    outer_->process(warning);
  }

 private:
  c10::WarningHandler* outer_;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
CastCall<at::_ops::_cudnn_rnn>::call(
    at::_ops::_cudnn_rnn::schema* op, at::ScalarType to, c10::DeviceType device, const at::Tensor& input,
    at::TensorList weight, int64_t weight_stride0, const std::optional<at::Tensor>& weight_buf, const at::Tensor& hx,
    const std::optional<at::Tensor>& cx, int64_t mode, const c10::SymInt& hidden_size,
    const c10::SymInt& proj_size, int64_t num_layers, bool batch_first, double dropout, bool train,
    bool bidirectional, c10::SymIntArrayRef batch_sizes, const std::optional<at::Tensor>& dropout_state) {
  if (to == at::kBFloat16 && !at::detail::getCUDAHooks().supportsBFloat16RNNWithCuDNN()) {
    return op(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
                    num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state);
  }
  ArgCast</*kTensors=*/3, /*kLists=*/1> cast(to, device);  // input, hx, cx; weight
  const bool cast_weights = !weight.empty() && cast.casts(weight[0]);
  if (!cast_weights) {  // already in a low dtype (a converted model): its buffer stays
    return op(cast(input), weight, weight_stride0, weight_buf, cast(hx), cast(cx), mode,
                    hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional,
                    batch_sizes, dropout_state);
  }
  const at::TensorList low = cast(weight);
  QuietUnpackedWeights quiet;
  return op(cast(input), low, weight_stride0, /*weight_buf=*/std::nullopt, cast(hx), cast(cx),
                  mode, hidden_size, proj_size,
                  num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state);
}

}  // namespace amp::detail
