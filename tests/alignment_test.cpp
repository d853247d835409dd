// SPDX-License-Identifier: BSD-3-Clause
// The shapes check (amp/alignment.h): layers whose GEMM dimensions miss the
// hardware's preferred multiple are named with the padding that fixes
// them; aligned ones are not.
#include "test_util.h"

#include <amp/alignment.h>

namespace amp::testing {
namespace {

using torch::nn::Conv2dOptions;

std::vector<std::string> rows(const std::vector<MisalignedLayer>& layers) {
  std::vector<std::string> out;
  for (const auto& l : layers) {
    out.push_back(l.module + " " + l.kind + " " + l.dimension + " " + std::to_string(l.size) + "->" +
                  std::to_string(l.padded));
  }
  return out;
}

torch::nn::ModuleList model() {
  return torch::nn::ModuleList(torch::nn::Linear(30, 64),                              // 0: K misses
                               torch::nn::Linear(64, 64),                              // 1: aligned
                               torch::nn::Conv2d(Conv2dOptions(3, 13, 3)),             // 2: both miss
                               torch::nn::Conv2d(Conv2dOptions(16, 32, 3).groups(4)),  // 3: 4 per group
                               torch::nn::Sequential(torch::nn::Linear(64, 50257)),    // 4.0: a vocabulary
                               torch::nn::ConvTranspose2d(
                                   torch::nn::ConvTranspose2dOptions(16, 20, 3).groups(4)));  // 5: 5 per group
}

TEST(AlignmentTest, TensorCoresWantMultiplesOfEightAndFloat8Sixteen) {
  const auto m = model();
  EXPECT_EQ(preferred_multiple(at::kHalf, torch::kCUDA), 8);
  EXPECT_EQ(rows(misaligned_layers(*m, at::kHalf, torch::kCUDA)),
            std::vector<std::string>({"0 Linear in_features 30->32", "2 Conv2d in_channels per group 3->8",
                                      "2 Conv2d out_channels 13->16", "3 Conv2d in_channels per group 4->8",
                                      "4.0 Linear out_features 50257->50264",
                                      "5 ConvTranspose2d out_channels per group 5->8"}));
  EXPECT_EQ(preferred_multiple(at::kFloat8_e4m3fn, torch::kCUDA), 16);
  EXPECT_EQ(rows(misaligned_layers(*m, at::kFloat8_e4m3fn, torch::kCUDA)),
            std::vector<std::string>({"0 Linear in_features 30->32", "2 Conv2d in_channels per group 3->16",
                                      "2 Conv2d out_channels 13->16", "3 Conv2d in_channels per group 4->16",
                                      "4.0 Linear out_features 50257->50272",
                                      "5 ConvTranspose2d out_channels per group 5->16"}));
  EXPECT_TRUE(misaligned_layers(*m, at::kFloat, torch::kCUDA).empty()) << "float32 has no preference";
  const std::string table = format_misaligned_layers(misaligned_layers(*m, at::kHalf, torch::kCUDA), 8);
  EXPECT_NE(table.find("| 4.0 | Linear | out_features | 50257 | 50264 |"), std::string::npos) << table;
}

TEST(AlignmentTest, CpusWithLowPrecisionArithmeticWantSixteen) {
  const auto m = model();
  const CpuPrecision zen4 = cpu_precision_from("AMD EPYC", {"avx512_bf16", "avx512_bw", "avx512_vl", "avx512_dq"});
  const CpuPrecision avx2 = cpu_precision_from("laptop", {"avx2"});
  EXPECT_EQ(preferred_multiple(at::kBFloat16, torch::kCPU, zen4), 16);
  EXPECT_EQ(rows(misaligned_layers(*m, at::kBFloat16, torch::kCPU, zen4)).front(), "0 Linear in_features 30->32");
  EXPECT_EQ(misaligned_layers(*m, at::kBFloat16, torch::kCPU, zen4).size(), 6u);
  EXPECT_EQ(preferred_multiple(at::kBFloat16, torch::kCPU, avx2), 0) << "it converts, it does not compute bfloat16";
  EXPECT_TRUE(misaligned_layers(*m, at::kBFloat16, torch::kCPU, avx2).empty());
  EXPECT_NE(format_misaligned_layers({}, 0).find("No preferred multiple"), std::string::npos);
  EXPECT_NE(format_misaligned_layers({}, 16).find("multiple of 16"), std::string::npos);
}

}  // namespace
}  // namespace amp::testing
