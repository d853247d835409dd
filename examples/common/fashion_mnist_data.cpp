// SPDX-License-Identifier: BSD-3-Clause
#include "fashion_mnist_data.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <memory>
#include <stdexcept>
#include <vector>

namespace examples {
namespace {

std::vector<uint8_t> read_gzip(const std::string& path) {
  std::unique_ptr<gzFile_s, decltype(&gzclose)> file(gzopen(path.c_str(), "rb"), &gzclose);
  if (!file) {
    throw std::runtime_error("cannot open " + path +
                             " (install Debian's dataset-fashion-mnist, or pass --data_dir)");
  }
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  int n;
  while ((n = gzread(file.get(), chunk, sizeof(chunk))) > 0) bytes.insert(bytes.end(), chunk, chunk + n);
  if (n < 0) throw std::runtime_error("corrupt gzip file " + path);
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t(b[at]) << 24) | (uint32_t(b[at + 1]) << 16) | (uint32_t(b[at + 2]) << 8) | b[at + 3];
}

// The idx format: a magic number, the dimension sizes, then uint8 data.
at::Tensor read_idx(const std::string& path, uint32_t expected_magic, int dims) {
  const std::vector<uint8_t> bytes = read_gzip(path);
  if (bytes.size() < 4u + 4u * dims || big_endian(bytes, 0) != expected_magic) {
    throw std::runtime_error(path + " is not an idx file with magic " + std::to_string(expected_magic));
  }
  std::vector<int64_t> shape;
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    shape.push_back(big_endian(bytes, 4 + 4 * d));
    count *= shape.back();
  }
  const size_t offset = 4 + 4 * dims;
  if (bytes.size() != offset + static_cast<size_t>(count)) throw std::runtime_error(path + " is truncated");
  return at::from_blob(const_cast<uint8_t*>(bytes.data() + offset), shape, at::kByte).clone();
}

}  // namespace

ImageDataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit) {
  const std::string prefix = dir + (train ? "/train" : "/t10k");
  at::Tensor images = read_idx(prefix + "-images-idx3-ubyte.gz", 2051, 3);
  at::Tensor labels = read_idx(prefix + "-labels-idx1-ubyte.gz", 2049, 1);
  if (limit > 0 && limit < images.size(0)) {
    images = images.narrow(0, 0, limit);
    labels = labels.narrow(0, 0, limit);
  }
  // Fashion-MNIST's mean and standard deviation.
  images = (images.to(at::kFloat).div(255.0).sub(0.2860).div(0.3530)).unsqueeze(1).contiguous();
  return {images, labels.to(at::kLong)};
}

}  // namespace examples
