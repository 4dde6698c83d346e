#include "gpu/agent/local/engine_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// A memfd mapped MAP_SHARED read/write: every segment lives in the one mapping.
class MemfdRegion final : public EngineRegion {
 public:
  MemfdRegion(std::byte* base, uint64_t bytes) : base_(base), bytes_(bytes) {}
  ~MemfdRegion() override { munmap(base_, bytes_); }

  std::string Describe() const override { return absl::StrCat("memfd of ", bytes_, " bytes"); }

  // The backend's copies: memcpy on a host pool, cudaMemcpy on a device pool.
  absl::Status Load(DeviceBackend& pool, uint64_t pool_offset, size_t /*segment*/, uint64_t offset,
                    uint64_t bytes) override {
    return pool.CopyOut(pool_offset, {base_ + offset, bytes});
  }
  absl::Status Store(DeviceBackend& pool, uint64_t pool_offset, size_t /*segment*/, uint64_t offset,
                     uint64_t bytes) override {
    return pool.CopyIn(pool_offset, {base_ + offset, bytes});
  }

 private:
  std::byte* const base_;
  const uint64_t bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineRegion>> MapMemfdRegion(int fd, uint64_t region_bytes) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("fd: not a regular file (send a memfd)");
  }
  if (static_cast<uint64_t>(st.st_size) < region_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("region_bytes ", region_bytes, " exceed the fd's ", st.st_size, " bytes"));
  }
  // A file that could shrink would fault the agent (SIGBUS) on its next copy.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "fd: must be sealed against shrinking (memfd_create with MFD_ALLOW_SEALING, then "
        "fcntl F_ADD_SEALS F_SEAL_SHRINK)");
  }
  // MAP_POPULATE fills the page tables once here, not by a fault on every 4 KiB page of the
  // first copy into each engine block (measured: a 16 MB load 4x slower without). Only over
  // memory the engine has already allocated: populating a sparse file would allocate its
  // holes, so an engine could make the agent allocate up to region_bytes (1 TiB).
  const bool allocated = static_cast<uint64_t>(st.st_blocks) * 512 >= region_bytes;
  void* map = mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (allocated ? MAP_POPULATE : 0), fd, 0);
  if (map == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("fd: mmap of ", region_bytes, " bytes failed: ", std::strerror(errno)));
  }
  return std::make_unique<MemfdRegion>(static_cast<std::byte*>(map), region_bytes);
}

}  // namespace kvcm
