// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_kernels.h"

#ifdef AMP_WITH_CUDA_KERNELS

#include "optim/eight_bit_state.h"
#include "optim/widened_step_launch.h"
#include "support/kernel_image.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>

namespace amp::detail {
namespace {

constexpr int64_t kLanes = 4;
constexpr int64_t kRowValues = 256, kRowBytes = kRowValues + 1;  // eight_bit_state.h's packed rows

// The threads ATen's distribution kernel launches for `numel` values on
// the current device (calc_execution_policy): blocks of 256, at most as
// many as the device keeps resident.
int64_t aten_grid_threads(int64_t numel) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t blocks_per_sm = props->maxThreadsPerMultiProcessor / widened_step::kThreads;
  const int64_t blocks = std::min<int64_t>(props->multiProcessorCount * blocks_per_sm,
                                           (numel + widened_step::kThreads - 1) / widened_step::kThreads);
  return blocks * widened_step::kThreads;
}

int64_t rows_of(int64_t numel) { return (numel + kRowValues - 1) / kRowValues; }

// Whether `packed` holds the rows of `numel` values, coded with `table`, on `device`.
bool fits_packed(int64_t numel, const at::Tensor& packed, const at::Tensor& table, c10::Device device) {
  return packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == rows_of(numel) * kRowBytes &&
         table.scalar_type() == at::kFloat && packed.device() == device && table.device() == device;
}

bool fits_values(const at::Tensor& values, c10::Device device) {
  return values.scalar_type() == at::kFloat && values.is_contiguous() && values.device() == device;
}

widened_step::CodeBook code_book(const at::Tensor& table, bool non_negative) {
  const int last = static_cast<int>(table.numel()) - 1;
  return {table.const_data_ptr<float>(), last, non_negative ? 0 : last / 2, non_negative ? 4 : 8};
}

// The noise of coding `numel` values' rows from stream `seed` (none: to nearest).
widened_step::StateNoise coding_noise(int64_t numel, std::optional<uint64_t> seed) {
  return {seed.value_or(0), aten_grid_threads(rows_of(numel) * kRowValues), seed.has_value()};
}

std::atomic<bool> fused_steps{true};

}  // namespace

bool widened_step_kernels_apply(const at::Tensor& t) {
  static std::array<std::atomic<uint8_t>, 64> answers{};
  return t.is_cuda() && has_image_for(widened_step::rounding_kernel(), t.device().index(), answers);
}

void round_on_cuda(const std::vector<CudaRounding>& roundings) {
  if (roundings.empty()) return;
  const c10::Device device = roundings.front().src.device();
  const c10::cuda::CUDAGuard guard(device);  // ATen's grid is this device's
  std::vector<widened_step::RoundingJob> jobs;
  for (const CudaRounding& r : roundings) {
    TORCH_INTERNAL_ASSERT(r.src.scalar_type() == at::kFloat && r.dst.scalar_type() == at::kBFloat16 &&
                          r.src.numel() == r.dst.numel() && r.src.is_contiguous() && r.dst.is_contiguous() &&
                          r.src.device() == device && r.dst.device() == device,
                          "amp: the CUDA rounding kernel got an unfit tensor");
    const int64_t numel = r.src.numel();
    if (numel == 0) continue;
    const int64_t stride = aten_grid_threads(numel);
    const int64_t passes = (numel + kLanes * stride - 1) / (kLanes * stride);
    jobs.push_back({reinterpret_cast<const uint32_t*>(r.src.const_data_ptr<float>()),
                    reinterpret_cast<uint16_t*>(r.dst.mutable_data_ptr<at::BFloat16>()), numel, r.seed, stride,
                    passes * stride / widened_step::kThreads, 0});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

void pack_on_cuda(const std::vector<CudaPacking>& packings) {
  if (packings.empty()) return;
  const c10::Device device = packings.front().values.device();
  const c10::cuda::CUDAGuard guard(device);  // at::rand's grid is this device's
  std::vector<widened_step::PackingJob> jobs;
  for (const CudaPacking& p : packings) {
    const int64_t numel = p.values.numel();
    TORCH_INTERNAL_ASSERT(fits_values(p.values, device) && fits_packed(numel, p.packed, p.table, device),
                          "amp: the CUDA state coding kernel got an unfit tensor");
    if (numel == 0) continue;
    jobs.push_back({p.values.const_data_ptr<float>(), p.packed.mutable_data_ptr<uint8_t>(),
                    code_book(p.table, p.non_negative), coding_noise(numel, p.seed), numel, rows_of(numel), 0});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

void unpack_on_cuda(const std::vector<CudaUnpacking>& unpackings) {
  if (unpackings.empty()) return;
  const c10::Device device = unpackings.front().values.device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<widened_step::UnpackingJob> jobs;
  for (const CudaUnpacking& u : unpackings) {
    const int64_t numel = u.values.numel();
    TORCH_INTERNAL_ASSERT(fits_values(u.values, device) && fits_packed(numel, u.packed, u.table, device),
                          "amp: the CUDA state decoding kernel got an unfit tensor");
    if (numel == 0) continue;
    jobs.push_back({u.packed.const_data_ptr<uint8_t>(), u.values.mutable_data_ptr<float>(),
                    code_book(u.table, u.non_negative), numel, rows_of(numel), 0});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

namespace {

// `piece` of a slice of `numel` values as the fused kernel takes it.
widened_step::ColumnJob column_job(const CudaWidePiece& piece, int64_t numel, c10::Device device) {
  widened_step::ColumnJob job{};
  job.kept = widened_step::Kept::kFloat32;
  if (!piece.t.defined()) return job;
  const at::Tensor& t = piece.t;
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.device() == device, "amp: the fused CUDA step got an unfit tensor");
  job.data = t.data_ptr();
  switch (t.scalar_type()) {
    case at::kFloat:
      TORCH_INTERNAL_ASSERT(t.numel() == numel, "amp: the fused CUDA step got pieces of different sizes");
      break;
    case at::kBFloat16:
      TORCH_INTERNAL_ASSERT(t.numel() == numel, "amp: the fused CUDA step got pieces of different sizes");
      job.kept = widened_step::Kept::kBFloat16;
      job.noise = {piece.seed, aten_grid_threads(numel), true};  // round_on_cuda's grid
      break;
    case at::kByte:
      TORCH_INTERNAL_ASSERT(fits_packed(numel, t, piece.table, device), "amp: the fused CUDA step got unfit state");
      job.kept = widened_step::Kept::kPacked;
      job.book = code_book(piece.table, piece.non_negative);
      job.noise = coding_noise(numel, piece.seed);  // pack_on_cuda's
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "amp: the fused CUDA step takes float32, bfloat16 or packed state, got ",
                            t.scalar_type());
  }
  return job;
}

// The overflow flag as the kernels read it (null: none).
const float* found_inf_of(const at::Tensor& found_inf, c10::Device device) {
  if (!found_inf.defined()) return nullptr;
  TORCH_INTERNAL_ASSERT(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1 && found_inf.device() == device,
                        "amp: the fused CUDA step's overflow flag is unfit");
  return found_inf.const_data_ptr<float>();
}

}  // namespace

void adam_on_cuda(const std::vector<std::vector<CudaWidePiece>>& slices, const CudaAdamStep& step) {
  if (slices.empty()) return;
  const c10::Device device = slices.front().front().t.device();
  const c10::cuda::CUDAGuard guard(device);  // ATen's grids are this device's
  std::vector<widened_step::AdamJob> jobs;
  for (const std::vector<CudaWidePiece>& s : slices) {
    TORCH_INTERNAL_ASSERT(s.size() == 6 && s[5].t.scalar_type() == at::kFloat && s[5].t.numel() == 1 &&
                          s[5].t.device() == device && s[4].t.defined() == step.amsgrad,
                          "amp: the fused CUDA Adam step got an unfit slice");
    const int64_t numel = s[0].t.numel();
    if (numel == 0) continue;
    jobs.push_back({column_job(s[0], numel, device), column_job(s[1], numel, device), column_job(s[2], numel, device),
                    column_job(s[3], numel, device), column_job(s[4], numel, device),
                    s[5].t.const_data_ptr<float>(), numel, rows_of(numel), 0});
  }
  // ATen's functor takes its options as float32 (opmath) values.
  const widened_step::AdamStep shared{static_cast<float>(step.lr), static_cast<float>(step.beta1),
                                      static_cast<float>(step.beta2), static_cast<float>(step.weight_decay),
                                      static_cast<float>(step.eps), found_inf_of(step.found_inf, device),
                                      step.adamw, step.amsgrad};
  C10_CUDA_CHECK(widened_step::launch(jobs, shared, at::cuda::getCurrentCUDAStream()));
}

void sgd_on_cuda(const std::vector<std::vector<CudaWidePiece>>& slices, const CudaSgdStep& step) {
  if (slices.empty()) return;
  const c10::Device device = slices.front().front().t.device();
  const c10::cuda::CUDAGuard guard(device);  // ATen's grids are this device's
  const bool momentum = step.momentum != 0;
  std::vector<widened_step::SgdJob> jobs;
  for (const std::vector<CudaWidePiece>& s : slices) {
    TORCH_INTERNAL_ASSERT(s.size() == 3 && s[2].t.defined() == momentum, "amp: the fused CUDA SGD step got an unfit slice");
    const int64_t numel = s[0].t.numel();
    if (numel == 0) continue;
    jobs.push_back({column_job(s[0], numel, device), column_job(s[1], numel, device), column_job(s[2], numel, device),
                    numel, rows_of(numel), 0});
  }
  // ATen's functor takes its options as float32 (opmath) values.
  const widened_step::SgdStep shared{static_cast<float>(step.lr),       static_cast<float>(step.weight_decay),
                                     static_cast<float>(step.momentum), static_cast<float>(step.dampening),
                                     found_inf_of(step.found_inf, device), step.nesterov, step.first_step};
  C10_CUDA_CHECK(widened_step::launch(jobs, shared, at::cuda::getCurrentCUDAStream()));
}

void set_widened_steps_fused(bool fused) { fused_steps = fused; }

bool widened_steps_fused() { return fused_steps; }

}  // namespace amp::detail

#endif  // AMP_WITH_CUDA_KERNELS
