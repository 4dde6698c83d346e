#include "gpu/agent/local/engine_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvcm {
namespace {

#ifndef MADV_POPULATE_READ
constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14
#endif

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

// cachestat(2) (Linux 6.5; the same number on every architecture), which older headers lack.
#ifndef SYS_cachestat
constexpr long SYS_cachestat = 451;
#endif
struct CachestatRange {
  uint64_t off, len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

// OK when every page of [0, region_bytes) of the shared-memory file `fd` is allocated (in
// memory, or swapped out): touching a hole would allocate it, charged to the agent.
// cachestat counts the pages (SEEK_HOLE would not do: it takes fallocated pages never written
// for holes). Without cachestat (before Linux 6.5) the whole file must be allocated
// (st_blocks), which pages allocated past its end (FALLOC_FL_KEEP_SIZE) can fool.
absl::Status CheckAllocated(int fd, uint64_t region_bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t pages = (region_bytes + page - 1) / page;
  CachestatRange range{.off = 0, .len = region_bytes};
  Cachestat stat{};
  uint64_t allocated = 0;
  if (syscall(SYS_cachestat, fd, &range, &stat, 0) == 0) {
    allocated = stat.nr_cache + stat.nr_evicted;  // a shmem page swapped out is "evicted"
  } else if (errno == ENOSYS) {
    struct stat st {};
    if (fstat(fd, &st) != 0) return absl::InternalError("fd: fstat failed");
    const uint64_t file_pages = (static_cast<uint64_t>(st.st_size) + page - 1) / page;
    allocated = static_cast<uint64_t>(st.st_blocks) * 512 / page >= file_pages ? pages : 0;
  } else if (errno == EOPNOTSUPP) {
    return absl::InvalidArgumentError(
        "fd: cannot tell whether its region is allocated (a hugetlbfs file?); register a memfd "
        "of ordinary shared memory");
  } else {
    return absl::InternalError(absl::StrCat("fd: cachestat failed: ", std::strerror(errno)));
  }
  if (allocated < pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd: ", pages - allocated, " of the region's ", pages,
                     " pages are not allocated; allocate all of it first (posix_fallocate)"));
  }
  return absl::OkStatus();
}

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
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::InvalidArgumentError(
        "fd: sealed against writes, so the agent cannot map it writable (a memfd registers "
        "once: the agent sealed it at its first hello); register a new memfd");
  }
  // A region the engine has not allocated is refused before anything is mapped or sealed;
  // looked for again once sealed (below), when no hole can appear any more.
  KVCM_RETURN_IF_ERROR(CheckAllocated(fd, region_bytes));
  // Mapped before the seal below, which forbids new writable mappings; populated only after
  // it (a hole punched meanwhile would be allocated by the populating faults).
  void* map = mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("fd: mmap of ", region_bytes, " bytes failed: ", std::strerror(errno)));
  }
  auto region = std::make_unique<MemfdRegion>(static_cast<std::byte*>(map), region_bytes);
  // From here no hole can appear: F_SEAL_FUTURE_WRITE makes punching one (fallocate
  // PUNCH_HOLE, madvise MADV_REMOVE), write() and new writable mappings EPERM, while the
  // mappings made before (the engine's, the agent's) keep working. A hole would make the
  // agent's copies allocate shared memory charged to the agent.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fd: cannot add F_SEAL_FUTURE_WRITE (", std::strerror(errno),
        "): the agent seals the region against hole punching; do not seal it with F_SEAL_SEAL"));
  }
  KVCM_RETURN_IF_ERROR(CheckAllocated(fd, region_bytes));
  // Fills the page tables once here, not by a fault on every 4 KiB page of the first copy
  // into each engine block (measured: a 16 MB load 4x slower without). Allocates nothing: the
  // region has no hole. Best effort (Linux 5.14+).
  (void)madvise(map, region_bytes, MADV_POPULATE_READ);
  return region;
}

}  // namespace kvcm
