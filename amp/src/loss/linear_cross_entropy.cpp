// SPDX-License-Identifier: BSD-3-Clause
// amp::linear_cross_entropy (linear_cross_entropy.h): an autograd function
// whose forward walks the tokens in chunks - logits of one chunk, their
// log-sum-exp and losses, and (when forward computes them) the chunk's
// gradients - and whose backward either scales the gradients forward made or
// walks the chunks again from the kept log-sum-exp.
#include <amp/linear_cross_entropy.h>

#include <amp/casting_scope.h>

#include "fp8/fp8_gemms.h"
#include "interception/casting_session.h"
#include "interception/dispatch/cast.h"
#include "interception/dispatch/fp8_call.h"
#include "loss/logits_chunk.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <optional>
#include <variant>
#include <vector>

namespace amp {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class LossReduction : int64_t { kNone, kMean, kSum };

LossReduction reduction_of(const torch::nn::functional::CrossEntropyFuncOptions& options) {
  if (std::holds_alternative<torch::enumtype::kNone>(options.reduction())) return LossReduction::kNone;
  if (std::holds_alternative<torch::enumtype::kSum>(options.reduction())) return LossReduction::kSum;
  return LossReduction::kMean;
}

constexpr int64_t kChunkLogitBytes = int64_t{32} << 20;

// The call's constants, kept in the autograd context.
struct LossCall {
  CrossEntropyTerms terms;
  LossReduction reduction = LossReduction::kMean;
  int64_t chunk = 1;
  int64_t vocab_chunk = 1;  // classes a window of the vocabulary holds (all of them: one window)
  at::ScalarType acc = at::kFloat;
  bool bias = false;  // else the bias argument is an empty stand-in (autograd takes no undefined input)
  std::array<bool, 3> needed = {false, false, false};  // gradients of hidden, weight, bias
  // The fp8 property: the weight's site, when its GEMMs run in float8 (a
  // chunk whose shapes the device's kernel does not take runs in bfloat16).
  std::shared_ptr<Fp8Site> fp8;
};

// LossCall::fp8 kept in the autograd context until backward.
struct Fp8SiteHolder : torch::CustomClassHolder {
  explicit Fp8SiteHolder(std::shared_ptr<Fp8Site> s) : site(std::move(s)) {}
  std::shared_ptr<Fp8Site> site;
};

// The GEMM dtype's accumulation dtype: float32, or float64 for float64.
at::ScalarType accumulation_dtype(at::ScalarType compute) {
  return compute == at::kDouble ? at::kDouble : at::kFloat;
}

// A chunk of rows [begin, end) of the flattened tokens.
struct TokenChunk {
  int64_t begin, end;
  at::Tensor of(const at::Tensor& t) const { return t.slice(0, begin, end); }
  ChunkTargets of(const ChunkTargets& t) const { return {of(t.valid), of(t.safe), of(t.weight)}; }
};

template <class Fn>
void for_each_chunk(int64_t tokens, int64_t chunk, Fn&& fn) {
  for (int64_t begin = 0; begin < tokens; begin += chunk) fn(TokenChunk{begin, std::min(tokens, begin + chunk)});
}

// The windows of `call`'s vocabulary (`classes` in all).
std::vector<ClassWindow> windows_of(int64_t classes, const LossCall& call) {
  std::vector<ClassWindow> windows;
  for (int64_t begin = 0; begin < classes; begin += call.vocab_chunk) {
    windows.push_back({begin, std::min(classes, begin + call.vocab_chunk), classes});
  }
  return windows;
}

// One chunk's logits in the accumulation dtype, from GEMMs in the inputs'
// dtype, or in float8 (the hidden rows' float8 values kept for the weight's
// gradient). `tally`: the hidden rows' amax counts for their scale (not
// when backward computes the logits again).
struct ChunkLogits {
  at::Tensor logits;
  Fp8Operand hidden8;  // defined: the chunk ran in float8
};

ChunkLogits chunk_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                         const LossCall& call, bool tally, const ClassWindow& window) {
  // A window of the vocabulary never runs in float8 (fp8_site).
  if (!window.whole() || !call.fp8 || !fp8_shapes_fit(hidden, weight.size(0))) {
    const std::optional<at::Tensor> b = bias.defined() ? std::optional(window.rows_of(bias)) : std::nullopt;
    return {at::linear(hidden, window.rows_of(weight), b).to(call.acc), {}};
  }
  auto [values, inverse_scale] = call.fp8->input.quantize(hidden.contiguous(), tally);
  const Fp8Operand hidden8{std::move(values), std::move(inverse_scale)};
  auto [weight8, weight_inv] = call.fp8->quantized_weight(weight);
  at::Tensor logits = fp8_forward_gemm(hidden8, {weight8, weight_inv}, hidden.scalar_type());
  if (bias.defined()) logits.add_(bias);
  return {logits.to(call.acc), hidden8};
}

// out += a b, summed in out's dtype (the accumulation dtype), from `a` in it
// (`a_low`: the same in the GEMMs' dtype, made on demand) and `b` in the
// GEMMs' dtype (`b_acc`: b in out's dtype where the caller keeps it). On
// CUDA cuBLAS takes the GEMMs' dtype and writes float32 (addmm's
// out_dtype); ATen's CPU GEMMs take one dtype, so there from float32
// operands.
template <class Low>
void add_summed(at::Tensor out, const at::Tensor& a, Low&& a_low, const at::Tensor& b, const at::Tensor& b_acc = {}) {
  const at::ScalarType acc = out.scalar_type();
  if (b.scalar_type() == acc) {
    out.addmm_(a, b);
  } else if (out.is_cuda()) {
    at::addmm_out(out, out, a_low(), b, acc);
  } else {
    out.addmm_(a, b_acc.defined() ? b_acc : b.to(acc));
  }
}

// The gradients of the inputs, summed over chunks of tokens and windows of
// the vocabulary in the accumulation dtype, as one GEMM over all tokens and
// classes sums them, and rounded to the inputs' dtype once: added into a
// running sum in the GEMMs' dtype, each chunk's share would be rounded to
// the sum's last bit - and over many chunks, a share under half of it lost.
// The weight's rows are summed a window at a time (begin_window, add for
// each chunk, end_window): its float32 sum takes 4 bytes a weight element
// of the window. With one window, forward adds each chunk's share as it
// makes the chunk's logits; with several, the tokens' log-sum-exp comes
// first and the windows are walked after it (walk_windows).
class ChunkedGradients {
 public:
  ChunkedGradients(const at::Tensor& h, const at::Tensor& w, const at::Tensor& b, std::array<bool, 3> needed,
                   const LossCall& call)
      : several_windows_(call.vocab_chunk < w.size(0)), weight_needed_(needed[1]), acc_(call.acc) {
    // With one window a chunk's rows take one GEMM over all classes; with
    // several they are summed over windows.
    if (needed[0]) {
      hidden_ = several_windows_ ? at::zeros(h.sizes(), h.options().dtype(acc_))
                                 : at::empty_like(h, at::MemoryFormat::Contiguous);
    }
    // The weight's gradient in its dtype is made when the first window is
    // summed: with one window, after the chunks' logits are gone.
    if (needed[1] && w.scalar_type() == acc_) weight_ = at::zeros(w.sizes(), w.options());
    if (needed[2] && b.defined()) bias_ = at::zeros(b.sizes(), b.options().dtype(acc_));
  }

  void begin_window(const ClassWindow& window, const at::Tensor& w) {
    if (!weight_needed_) return;
    weight_sum_ = w.scalar_type() == acc_ ? window.rows_of(weight_)
                                          : at::zeros({window.width(), w.size(1)}, w.options().dtype(acc_));
    // The CPU's float32 GEMM for the hidden rows reads the window's weight
    // rows in float32: converted once a window, not once a chunk.
    if (hidden_.defined() && several_windows_ && w.is_cpu() && w.scalar_type() != acc_) {
      window_weight_acc_ = window.rows_of(w).to(acc_);
    }
  }

  // Adds one chunk's, from its logits of `window` [C, width] (accumulation
  // dtype, overwritten by their gradient) and the tokens' log-sum-exp, for
  // its hidden rows `h` [C, H]; `row_scale` [C]: the incoming gradient of
  // each token's loss.
  void add(const TokenChunk& rows, const ClassWindow& window, ChunkLogits& chunk, const at::Tensor& lse,
           const ChunkTargets& targets, const LossCall& call, const at::Tensor& row_scale, const at::Tensor& h,
           const at::Tensor& w) {
    logits_to_gradient_(chunk.logits, window, lse, targets, call.terms, row_scale);
    const at::Tensor& grad_logits = chunk.logits;
    at::Tensor g;  // in the GEMMs' dtype, made where a GEMM takes it
    auto low = [&]() -> const at::Tensor& {
      if (!g.defined()) g = grad_logits.to(w.scalar_type());
      return g;
    };
    if (chunk.hidden8.values.defined()) {
      add_in_float8(rows, low(), chunk.hidden8, *call.fp8, w);
    } else {
      const at::Tensor w_window = window.rows_of(w);
      if (hidden_.defined() && !several_windows_) {
        at::Tensor out = rows.of(hidden_);
        at::mm_out(out, low(), w_window);
      } else if (hidden_.defined()) {
        add_summed(rows.of(hidden_), grad_logits, low, w_window, window_weight_acc_);
      }
      if (weight_sum_.defined()) add_summed(weight_sum_, grad_logits.t(), [&] { return low().t(); }, h);
    }
    if (bias_.defined()) window.rows_of(bias_).add_(grad_logits.sum(0));
  }

  // Rounds the window's weight rows to the weight's dtype.
  void end_window(const ClassWindow& window, const at::Tensor& w) {
    if (weight_sum_.defined() && w.scalar_type() != acc_) {
      if (!weight_.defined()) weight_ = at::empty(w.sizes(), w.options());
      window.rows_of(weight_).copy_(weight_sum_);
    }
    weight_sum_ = window_weight_acc_ = at::Tensor();
  }

  variable_list finish(const at::Tensor& h, const at::Tensor& b) {
    at::Tensor hidden = hidden_.defined() ? hidden_.to(h.scalar_type()) : at::Tensor();
    at::Tensor bias = bias_.defined() ? bias_.to(b.scalar_type()) : at::Tensor();
    return {std::move(hidden), weight_, std::move(bias)};
  }

 private:
  // The hidden rows' and the weight's gradients from the chunk's logit
  // gradient `g` in float8, as a float8 linear layer's backward computes them.
  void add_in_float8(const TokenChunk& rows, const at::Tensor& g, const Fp8Operand& hidden8, Fp8Site& site,
                     const at::Tensor& w) {
    auto [weight8, weight_inv] = site.quantized_weight(w);
    if (weight_sum_.defined()) {
      auto [g8, g_inv, g8_t] = site.grad_output.quantize_transposed(g.contiguous());
      if (hidden_.defined()) rows.of(hidden_).copy_(fp8_input_gradient_gemm({g8, g_inv}, {weight8, weight_inv}, hidden_.scalar_type()));
      weight_sum_.add_(fp8_weight_gradient_gemm({g8_t, g_inv}, hidden8, acc_));
    } else if (hidden_.defined()) {
      auto [g8, g_inv] = site.grad_output.quantize(g.contiguous());
      rows.of(hidden_).copy_(fp8_input_gradient_gemm({g8, g_inv}, {weight8, weight_inv}, hidden_.scalar_type()));
    }
  }

  bool several_windows_;
  bool weight_needed_;
  at::ScalarType acc_;
  at::Tensor hidden_;  // [N, H]: the inputs' dtype with one window, else the accumulation dtype
  at::Tensor weight_;  // [V, H] in the weight's dtype
  at::Tensor bias_;    // [V] in the accumulation dtype
  at::Tensor weight_sum_;         // the window's rows of the weight's gradient, accumulation dtype
  at::Tensor window_weight_acc_;  // CPU, several windows: the window's weight rows in it
};

// Every window of the vocabulary in turn over every chunk of tokens: the
// logits again, their gradient from the tokens' log-sum-exp `lse` [N] and
// incoming gradient `token_scale` [N], added to `grads`.
void walk_windows(ChunkedGradients& grads, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                  const ChunkTargets& targets, const at::Tensor& lse, const at::Tensor& token_scale,
                  const LossCall& call) {
  for (const ClassWindow& window : windows_of(weight.size(0), call)) {
    grads.begin_window(window, weight);
    for_each_chunk(hidden.size(0), call.chunk, [&](const TokenChunk& rows) {
      const at::Tensor h = rows.of(hidden);
      ChunkLogits chunk = chunk_logits(h, weight, bias, call, /*tally=*/false, window);
      grads.add(rows, window, chunk, rows.of(lse), rows.of(targets), call, rows.of(token_scale), h, weight);
    });
    grads.end_window(window, weight);
  }
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  // hidden [N, H], weight [V, H], bias [V] or undefined, all one dtype;
  // target [N] int64. Returns the loss (a scalar, or [N] for kNone).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& bias_or_empty, const at::Tensor& target, LossCall call) {
    const at::Tensor bias = call.bias ? bias_or_empty : at::Tensor();
    const std::array<bool, 3>& needed = call.needed;
    const bool any_needed = needed[0] || needed[1] || needed[2];
    // Unscaled gradients need float16's range only in float16.
    const bool in_forward = any_needed && call.reduction != LossReduction::kNone && hidden.scalar_type() != at::kHalf;
    const std::vector<ClassWindow> windows = windows_of(weight.size(0), call);
    // With one window a chunk's logits stay for its gradients; with several
    // the gradients walk the windows after the log-sum-exp.
    const bool one_pass = in_forward && windows.size() == 1;
    const int64_t tokens = hidden.size(0);
    const ChunkTargets targets = chunk_targets(target, call.terms, call.acc);
    // The mean's denominator, as ATen's: the sum of w[y] over valid tokens.
    const at::Tensor denominator = call.reduction == LossReduction::kMean
                                       ? targets.weight.sum()
                                       : at::ones({}, hidden.options().dtype(call.acc));
    at::Tensor losses = at::empty({tokens}, hidden.options().dtype(call.acc));
    at::Tensor lse = any_needed && !one_pass ? at::empty({tokens}, losses.options()) : at::Tensor();
    std::optional<ChunkedGradients> grads;
    if (in_forward) grads.emplace(hidden, weight, bias, needed, call);
    const at::Tensor row_scale = denominator.reciprocal().expand({tokens});  // forward's gradients: an incoming 1
    if (one_pass) grads->begin_window(windows[0], weight);
    for_each_chunk(tokens, call.chunk, [&](const TokenChunk& rows) {
      const at::Tensor h = rows.of(hidden);
      const ChunkTargets row_targets = rows.of(targets);
      at::Tensor chunk_lse;
      LogitSums sums;
      std::optional<ChunkLogits> kept;
      for (const ClassWindow& window : windows) {
        ChunkLogits chunk = chunk_logits(h, weight, bias, call, /*tally=*/true, window);
        const at::Tensor window_lse = chunk.logits.logsumexp(1);
        chunk_lse = chunk_lse.defined() ? at::logaddexp(chunk_lse, window_lse) : window_lse;
        sums.add(chunk.logits, window, row_targets, call.terms);
        if (one_pass) kept = std::move(chunk);
      }
      rows.of(losses).copy_(token_losses(chunk_lse, sums, row_targets, call.terms, weight.size(0)));
      if (lse.defined()) rows.of(lse).copy_(chunk_lse);
      if (one_pass) grads->add(rows, windows[0], *kept, chunk_lse, row_targets, call, rows.of(row_scale), h, weight);
    });
    if (one_pass) grads->end_window(windows[0], weight);
    if (in_forward && !one_pass) walk_windows(*grads, hidden, weight, bias, targets, lse, row_scale, call);
    ctx->saved_data["reduction"] = static_cast<int64_t>(call.reduction);
    ctx->saved_data["in_forward"] = in_forward;
    if (in_forward) {
      const variable_list g = grads->finish(hidden, bias);
      ctx->save_for_backward({g[0], g[1], g[2]});
    } else if (any_needed) {
      ctx->save_for_backward({hidden, weight, bias, target, lse, denominator, call.terms.class_weights});
      ctx->saved_data["ignore_index"] = call.terms.ignore_index;
      ctx->saved_data["smoothing"] = call.terms.smoothing;
      ctx->saved_data["chunk"] = call.chunk;
      ctx->saved_data["vocab_chunk"] = call.vocab_chunk;
      if (call.fp8) ctx->saved_data["fp8"] = c10::IValue::make_capsule(c10::make_intrusive<Fp8SiteHolder>(call.fp8));
    }
    if (call.reduction == LossReduction::kNone) return losses;
    const at::Tensor total = losses.sum();
    return call.reduction == LossReduction::kMean ? total / denominator : total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "amp::linear_cross_entropy is not twice differentiable: "
                "backward with create_graph=true reached it. Compute a loss that needs double backward "
                "(a gradient penalty) with torch::nn::functional::linear and cross_entropy.");
    const at::Tensor& g = grad_outputs[0];
    const variable_list saved = ctx->get_saved_variables();
    const auto reduction = static_cast<LossReduction>(ctx->saved_data["reduction"].toInt());
    variable_list out(5);
    if (ctx->saved_data["in_forward"].toBool()) {
      // Scaled where they lie unless the graph is kept for another backward.
      const bool keep = torch::autograd::get_current_graph_task_keep_graph();
      for (size_t i = 0; i < 3; ++i) {
        if (saved[i].defined()) out[i] = keep ? saved[i] * g : at::Tensor(saved[i]).mul_(g);
      }
      return out;
    }
    const at::Tensor &hidden = saved[0], &weight = saved[1], &bias = saved[2], &target = saved[3];
    const at::Tensor &lse = saved[4], &denominator = saved[5];
    LossCall call;
    call.terms = {ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["smoothing"].toDouble(), saved[6]};
    call.reduction = reduction;
    call.chunk = ctx->saved_data["chunk"].toInt();
    call.vocab_chunk = ctx->saved_data["vocab_chunk"].toInt();
    call.acc = lse.scalar_type();
    if (ctx->saved_data.count("fp8")) {
      call.fp8 = c10::static_intrusive_pointer_cast<Fp8SiteHolder>(ctx->saved_data["fp8"].toCapsule())->site;
    }
    // The incoming gradient of each token's loss, in float32 before any
    // float16 GEMM (the loss scale keeps small gradients in range).
    at::Tensor token_scale = g.to(call.acc);
    if (reduction == LossReduction::kMean) token_scale = token_scale / denominator;
    const int64_t tokens = hidden.size(0);
    const std::array<bool, 3> needed = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                        bias.defined() && ctx->needs_input_grad(2)};
    ChunkedGradients grads(hidden, weight, bias, needed, call);
    walk_windows(grads, hidden, weight, bias, chunk_targets(target, call.terms, call.acc), lse,
                 token_scale.expand({tokens}), call);
    const variable_list g3 = grads.finish(hidden, bias);
    std::copy(g3.begin(), g3.end(), out.begin());
    return out;
  }
};

void check_target(const at::Tensor& target, int64_t vocabulary, int64_t ignore_index) {
  const at::Tensor outside = (target.lt(0) | target.ge(vocabulary)) & target.ne(ignore_index);
  if (target.is_cpu()) {
    TORCH_CHECK(!outside.any().item<bool>(), "amp::linear_cross_entropy: a target is outside [0, ", vocabulary,
                ") and is not ignore_index (", ignore_index, "): ", target.masked_select(outside)[0].item<int64_t>(),
                ". Targets index the rows of the weight (the vocabulary).");
  } else {
    at::_assert_async(outside.any().logical_not(), "amp::linear_cross_entropy: a target is outside [0, vocabulary) "
                      "and is not ignore_index");
  }
}

// The dtype the GEMMs run in, as amp's policy casts at::linear here.
at::ScalarType gemm_dtype(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias) {
  const CastingState state = CastingState::current();
  if (state.casts() && is_castable(weight, weight.device().type())) {
    const at::ScalarType w = weight.scalar_type();
    return w == at::kHalf || w == at::kBFloat16 ? w : state.dtype(weight.device().type());
  }
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type() &&
                  (!bias.defined() || bias.scalar_type() == weight.scalar_type()),
              "amp::linear_cross_entropy: hidden (", hidden.scalar_type(), "), weight (", weight.scalar_type(),
              ")", bias.defined() ? " and bias (" + std::string(c10::toString(bias.scalar_type())) + ")" : "",
              " differ in dtype and amp does not cast here. Cast them to one dtype, or call it where amp's "
              "casts are on.");
  return weight.scalar_type();
}

// The weight's float8 site where the fp8 property runs this layer's GEMMs
// in float8 - a layer's weight whose GEMMs would run in bfloat16 and pay by
// the rule (Fp8Gemms::choose, over all tokens) - or null.
std::shared_ptr<Fp8Site> fp8_site(const at::Tensor& hidden, const at::Tensor& weight, at::ScalarType compute) {
  if (compute != at::kBFloat16 || !is_layer_weight(weight)) return nullptr;
  const std::shared_ptr<CastingSession> session = live_casting_session();
  if (!session || !CastingState::current().casts()) return nullptr;
  for (const DeviceCasting& casting : session->casting()) {
    if (casting.device != weight.device().type() || casting.fp8 == nullptr) continue;
    if (!casting.fp8->choose(hidden, weight.size(0), weight_key(weight))) return nullptr;
    return casting.fp8->site_for(weight_key(weight));
  }
  return nullptr;
}

}  // namespace
}  // namespace detail

int64_t default_loss_chunk_tokens(int64_t tokens, int64_t vocabulary) {
  const int64_t fits = std::max<int64_t>(1, detail::kChunkLogitBytes / (std::max<int64_t>(vocabulary, 1) * 4));
  int64_t chunk = 1;
  while (chunk * 2 <= fits) chunk *= 2;
  return std::max<int64_t>(1, std::min(chunk, tokens));
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& target,
                                const torch::nn::functional::CrossEntropyFuncOptions& options, int64_t chunk_tokens,
                                int64_t chunk_vocabulary) {
  using namespace detail;
  constexpr const char* kName = "amp::linear_cross_entropy: ";
  TORCH_CHECK(weight.defined() && weight.dim() == 2, kName, "weight must be [vocabulary, width], got ",
              weight.defined() ? weight.sizes() : c10::IntArrayRef{});
  const int64_t vocabulary = weight.size(0), width = weight.size(1);
  TORCH_CHECK(hidden.defined() && hidden.dim() >= 1 && hidden.size(-1) == width, kName, "hidden must be [..., ",
              width, "] (weight's width), got ", hidden.defined() ? hidden.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == vocabulary), kName, "bias must be [",
              vocabulary, "] (weight's vocabulary) or undefined, got ", bias.defined() ? bias.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(target.defined() && !target.is_floating_point() && !target.is_complex() &&
                  target.scalar_type() != at::kBool,
              kName, "target must be an integer tensor of class indices, got ",
              target.defined() ? c10::toString(target.scalar_type()) : "an undefined tensor");
  TORCH_CHECK(target.sizes() == hidden.sizes().slice(0, hidden.dim() - 1), kName, "target must have hidden's shape "
              "without its last dimension, ", hidden.sizes().slice(0, hidden.dim() - 1), ", got ", target.sizes());
  TORCH_CHECK(hidden.device() == weight.device() && target.device() == weight.device() &&
                  (!bias.defined() || bias.device() == weight.device()),
              kName, "hidden, weight, bias and target must be on one device (weight is on ", weight.device(), ")");
  const double smoothing = options.label_smoothing();
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, kName, "label smoothing must be in [0, 1], got ", smoothing);
  TORCH_CHECK(chunk_tokens >= 0, kName, "chunk_tokens must be >= 0 (0 picks the chunk), got ", chunk_tokens);
  TORCH_CHECK(chunk_vocabulary >= 0, kName, "chunk_vocabulary must be >= 0 (0: the whole vocabulary at once), got ",
              chunk_vocabulary);
  const at::Tensor& class_weights = options.weight();
  TORCH_CHECK(!class_weights.defined() || (class_weights.is_floating_point() && class_weights.dim() == 1 &&
                                           class_weights.size(0) == vocabulary),
              kName, "class weights must be a floating [", vocabulary, "] tensor, got ",
              class_weights.defined() ? class_weights.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!class_weights.defined() || !class_weights.requires_grad(), kName, "class weights are constants here; "
              "pass weight.detach(), or use linear and cross_entropy for gradients of the class weights");
  check_target(target, vocabulary, options.ignore_index());
  // Read as an op reads them, so amp first gathers sharded weights (ZeRO-3)
  // or lowers O2/O5 masters; inside, the reads are amp's own.
  const at::Tensor weight_read = at::alias(weight);
  const at::Tensor bias_read = bias.defined() ? at::alias(bias) : at::Tensor();
  const at::ScalarType compute = gemm_dtype(hidden, weight_read, bias_read);

  LossCall call;
  call.acc = accumulation_dtype(compute);
  call.terms.ignore_index = options.ignore_index();
  call.terms.smoothing = smoothing;
  if (class_weights.defined()) call.terms.class_weights = class_weights.to(weight.device(), call.acc);
  call.reduction = reduction_of(options);
  const int64_t tokens = target.numel();
  call.vocab_chunk = chunk_vocabulary > 0 ? std::min(chunk_vocabulary, vocabulary) : vocabulary;
  call.chunk = chunk_tokens > 0 ? chunk_tokens : default_loss_chunk_tokens(tokens, call.vocab_chunk);

  // Casts as amp casts at::linear's arguments (the weight through the cast
  // cache), recorded by autograd; inside, the ops run in these dtypes.
  auto cast = [&](const at::Tensor& t) {
    return t.defined() && t.scalar_type() != compute ? cast_uncached_or_cached(t, compute) : t;
  };
  const at::Tensor h = cast(hidden).reshape({tokens, width});
  const at::Tensor w = cast(weight_read), b = cast(bias_read);
  const at::Tensor flat_target = target.reshape({tokens}).to(at::kLong);
  if (call.vocab_chunk == vocabulary) call.fp8 = fp8_site(h, weight, compute);
  at::Tensor loss;
  {
    disable_casts no_casts;
    call.bias = b.defined();
    const bool grad = at::GradMode::is_enabled();
    call.needed = {grad && h.requires_grad(), grad && w.requires_grad(), grad && call.bias && b.requires_grad()};
    loss = LinearCrossEntropyFunction::apply(h, w, call.bias ? b : at::empty({0}, w.options()), flat_target, call);
  }
  return call.reduction == LossReduction::kNone ? loss.view(target.sizes()) : loss;
}

}  // namespace amp
