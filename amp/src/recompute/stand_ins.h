// Private: the nodes through which a recomputed block's rerun reaches
// tensors from outside the block (recompute.cpp). They only hand
// gradients on, so walks that measure distance along the graph (overflow
// provenance's nearest module) step through them.
#pragma once

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

bool is_stand_ins(const torch::autograd::Node& node);

}  // namespace amp::detail
