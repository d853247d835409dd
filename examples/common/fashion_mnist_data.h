// SPDX-License-Identifier: BSD-3-Clause
// Fashion-MNIST from Debian's dataset-fashion-mnist package: the four idx
// files, gzip-compressed, in /usr/share/datasets/fashion-mnist.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace examples {

// Debian's dataset-fashion-mnist, or where the build was told it lies
// (AMP_FASHION_MNIST_DIR: tools/gpu_run.sh unpacks the package elsewhere).
#ifndef AMP_FASHION_MNIST_DIR
#define AMP_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#endif
inline constexpr const char* kDefaultFashionMnistDir = AMP_FASHION_MNIST_DIR;

struct ImageDataset {
  at::Tensor images;  // [N, 1, 28, 28] float32, normalized
  at::Tensor labels;  // [N] int64, 0..9
};

// Reads train (60k) or test (10k) images; `limit` > 0 keeps the first
// `limit` examples. Throws std::runtime_error naming the missing file and
// the package that provides it.
ImageDataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit = 0);

}  // namespace examples
