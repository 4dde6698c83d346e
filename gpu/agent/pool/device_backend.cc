#include "gpu/agent/pool/device_backend.h"

#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// DRAM arena, freed by `release`. Thread-safe (see DeviceBackend).
class HostBackend final : public DeviceBackend {
 public:
  HostBackend(std::byte* arena, uint64_t bytes, std::string name, void (*release)(std::byte*))
      : arena_(arena, release), bytes_(bytes), name_(std::move(name)) {}

  std::string name() const override { return name_; }
  bool is_device() const override { return false; }
  std::byte* base() const override { return arena_.get(); }
  uint64_t arena_bytes() const override { return bytes_; }

  absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) override {
    if (absl::Status s = CheckRange(offset, src.size()); !s.ok()) return s;
    std::memcpy(arena_.get() + offset, src.data(), src.size());
    return absl::OkStatus();
  }
  absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) const override {
    if (absl::Status s = CheckRange(offset, dst.size()); !s.ok()) return s;
    std::memcpy(dst.data(), arena_.get() + offset, dst.size());
    return absl::OkStatus();
  }

 private:
  const std::unique_ptr<std::byte, void (*)(std::byte*)> arena_;
  const uint64_t bytes_;
  const std::string name_;
};

}  // namespace

absl::Status DeviceBackend::CheckRange(uint64_t offset, uint64_t bytes) const {
  if (offset > arena_bytes() || bytes > arena_bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", bytes,
                                              ") leaves the arena of ", arena_bytes(), " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateHostBackend(uint64_t arena_bytes) {
  if (arena_bytes < 1) return absl::InvalidArgumentError("arena_bytes must be >= 1");
  // Not value-initialised: the OS commits pages on first touch, as a GPU pool would be
  // filled only by writes.
  std::byte* arena = new (std::nothrow) std::byte[arena_bytes];
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a host arena of ", arena_bytes, " bytes"));
  }
  return AdoptHostArena(arena, arena_bytes, "host", [](std::byte* p) { delete[] p; });
}

std::unique_ptr<DeviceBackend> AdoptHostArena(std::byte* arena, uint64_t arena_bytes,
                                              std::string name, void (*release)(std::byte*)) {
  return std::make_unique<HostBackend>(arena, arena_bytes, std::move(name), release);
}

absl::StatusOr<BackendChoice> CreateBackend(const BackendOptions& options) {
  if (options.arena_bytes < 1) return absl::InvalidArgumentError("arena_bytes must be >= 1");
  BackendChoice choice;
#ifdef KVCM_CUDA_ENABLED
  if (options.allow_device) {
    absl::StatusOr<int> count = CudaDeviceCount();
    if (count.ok() && *count > 0) {
      if (options.device_index < 0 || options.device_index >= *count) {
        return absl::InvalidArgumentError(
            absl::StrCat("device_index must be in [0, ", *count, "), got ", options.device_index));
      }
      absl::StatusOr<std::unique_ptr<DeviceBackend>> cuda =
          CreateCudaBackend(options.device_index, options.arena_bytes);
      if (!cuda.ok()) return cuda.status();
      choice.backend = *std::move(cuda);
      choice.reason = absl::StrCat("CUDA device ", options.device_index, " of ", *count);
      return choice;
    }
    choice.reason = count.ok() ? "no CUDA device present: using host DRAM"
                               : absl::StrCat("no CUDA device (", count.status().message(),
                                              "): using host DRAM");
  } else {
    choice.reason = "device use disabled: using host DRAM";
  }
#else
  choice.reason = options.allow_device ? "built without CUDA: using host DRAM"
                                       : "device use disabled: using host DRAM";
#endif
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(options.arena_bytes);
  if (!host.ok()) return host.status();
  choice.backend = *std::move(host);
  return choice;
}

}  // namespace kvcm
