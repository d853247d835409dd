// SPDX-License-Identifier: BSD-3-Clause
#include <amp/memory.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

namespace amp {
namespace {

// Wraps LibTorch's CPU allocator. Each block carries its size in a header
// of kHeader bytes before the data (keeping the allocator's 64-byte
// alignment), so freeing needs no lookup and the data pointer stays the
// context, as oneDNN's raw allocations require.
class CountingAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;

  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_free_(base->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n + kHeader);
    TORCH_INTERNAL_ASSERT(inner.get() == inner.get_context(), "amp: the CPU allocator's blocks are not simple");
    const c10::Device device = inner.device();
    auto* base = static_cast<char*>(inner.release_context());
    *reinterpret_cast<size_t*>(base) = n;
    add(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &CountingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, size_t count) const override { base_->copy_data(dest, src, count); }

  AllocatedBytes bytes() const { return {current_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

  static CountingAllocator* instance;

 private:
  void add(int64_t n) {
    const int64_t now = current_.fetch_add(n) + n;
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  static void release(void* data) {
    char* base = static_cast<char*>(data) - kHeader;
    instance->current_.fetch_sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
    instance->base_free_(base);
  }

  c10::Allocator* base_;
  c10::DeleterFnPtr base_free_;
  std::atomic<int64_t> current_{0}, peak_{0};
};

CountingAllocator* CountingAllocator::instance = nullptr;

CountingAllocator& cpu_counter(const char* what) {
  TORCH_CHECK(CountingAllocator::instance != nullptr, "amp: ", what, " for the CPU needs "
              "amp::track_allocations() first (LibTorch does not count CPU bytes); call it before "
              "building the model.");
  return *CountingAllocator::instance;
}

void check_device(c10::Device device, const char* what) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "amp: ", what, " counts CPU and CUDA memory, got ",
              device, ".");
}

c10::DeviceIndex index_of(c10::Device device) { return device.has_index() ? device.index() : 0; }

}  // namespace

void track_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: tensors may be freed during static destruction.
    CountingAllocator::instance = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(CountingAllocator::instance, /*priority=*/100);
  });
}

bool tracking_allocations() { return CountingAllocator::instance != nullptr; }

AllocatedBytes allocated_bytes(c10::Device device) {
  check_device(device, "allocated_bytes");
  if (device.is_cpu()) return cpu_counter("allocated_bytes").bytes();
  const auto stats = c10::getDeviceAllocator(c10::kCUDA)->getDeviceStats(index_of(device));
  const auto& all = stats.allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
  return {all.current, all.peak};
}

void reset_peak_allocated(c10::Device device) {
  check_device(device, "reset_peak_allocated");
  if (device.is_cpu()) return cpu_counter("reset_peak_allocated").reset_peak();
  c10::getDeviceAllocator(c10::kCUDA)->resetPeakStats(index_of(device));
}

}  // namespace amp
