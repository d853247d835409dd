// SPDX-License-Identifier: BSD-3-Clause
// Ops that take module parameters and require their floating inputs to
// match them: normalization layers, recurrent layers, embeddings, bilinear
// layers. Intercepting them also lets O2/O5 lower a model's weights before
// the first of them reads them (model_weights.h).
//
// At the levels that cast the model (O2, O3, O5) existing forward code still
// feeds float32 batches and float32 tensors made inside forward. An op of
// this table that meets low-precision parameters with float32 activations
// casts the activations to the parameters' dtype (kMatchParameters), so
//   BatchNorm at O3 with an fp32 batch   -> runs in the model's dtype;
//   BatchNorm kept fp32 at O2 (affine)   -> untouched: an fp32 parameter is
//                                           there, low-precision input is fine.
// Linear, convolution and the other lower-precision ops follow their weights
// through their own table rows; elementwise ops promote by themselves. These
// rows apply on every device at those levels, except where the device's own
// table lists the op (layer_norm and group_norm are fp32 on CUDA).
#include "interception/policy_tables/table_entry.h"

namespace amp::detail {

const std::vector<TableEntry>& model_policy_table() {
  static const std::vector<TableEntry> table = {
      AMP_OP(batch_norm, kMatchParameters),
      AMP_OP(instance_norm, kMatchParameters),
      AMP_OP(group_norm, kMatchParameters),
      AMP_OP(layer_norm, kMatchParameters),
      AMP_OP(rms_norm, kMatchParameters),
      AMP_OP(embedding, kMatchParameters),
      AMP_OP(embedding_bag, kMatchParameters),
      AMP_OP_OVERLOAD(embedding_bag, padding_idx, kMatchParameters),
      AMP_OP_OVERLOAD(lstm, input, kMatchParameters),
      AMP_OP_OVERLOAD(lstm, data, kMatchParameters),
      AMP_OP_OVERLOAD(gru, input, kMatchParameters),
      AMP_OP_OVERLOAD(gru, data, kMatchParameters),
      AMP_OP_OVERLOAD(rnn_tanh, input, kMatchParameters),
      AMP_OP_OVERLOAD(rnn_tanh, data, kMatchParameters),
      AMP_OP_OVERLOAD(rnn_relu, input, kMatchParameters),
      AMP_OP_OVERLOAD(rnn_relu, data, kMatchParameters),
      AMP_OP(lstm_cell, kMatchParameters),
      AMP_OP(gru_cell, kMatchParameters),
      AMP_OP(rnn_tanh_cell, kMatchParameters),
      AMP_OP(rnn_relu_cell, kMatchParameters),
      AMP_OP(bilinear, kMatchParameters),
  };
  return table;
}

}  // namespace amp::detail
