// Host code linked with the CUDA runtime and NCCL; no kernels here.
#include "gpu/agent/transport/nccl/nccl_link.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gpu/kernels/cuda_status.h"

namespace kvcm {
namespace {

static_assert(NCCL_UNIQUE_ID_BYTES == 128, "agent.proto documents 128-byte ncclUniqueIds");

// The one place an NCCL result becomes a Status: bad arguments or use -> INVALID_ARGUMENT,
// system and remote errors (a peer or the network failed) -> UNAVAILABLE, anything else ->
// INTERNAL. ncclInProgress is not an error of a non-blocking call; callers poll for it.
absl::Status NcclErrorToStatus(ncclResult_t r, const char* expr, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  const std::string msg =
      absl::StrCat(expr, ": ", ncclGetErrorString(r), last != nullptr && *last != '\0' ? ": " : "",
                   last != nullptr ? last : "");
  switch (r) {
    case ncclSuccess:
    case ncclInProgress:
      return absl::OkStatus();
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(msg);
    case ncclSystemError:
    case ncclRemoteError:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

#define KVCM_NCCL_RETURN_IF_ERROR(expr, comm)                            \
  do {                                                                   \
    const ncclResult_t kvcm_nccl_r_ = (expr);                            \
    if (kvcm_nccl_r_ != ncclSuccess && kvcm_nccl_r_ != ncclInProgress) { \
      return NcclErrorToStatus(kvcm_nccl_r_, #expr, comm);               \
    }                                                                    \
  } while (0)

constexpr uint64_t kWarmupBytes = 8;
constexpr absl::Duration kPollInterval = absl::Microseconds(20);

class NcclLink final : public BlockLink {
 public:
  NcclLink(int device, int rank, uint64_t staging_bytes)
      : device_(device), peer_(1 - rank), staging_bytes_(staging_bytes) {}

  // Aborts the communicator (whatever is pending on it ends), then frees the stream and the
  // staging buffer.
  ~NcclLink() override {
    cudaSetDevice(device_);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (staging_ != nullptr) cudaFree(staging_);
    cudaGetLastError();  // leave no sticky error behind for the thread's next CUDA call
  }

  // Allocates the stream and staging buffer and joins `id` as rank 1 - peer_.
  absl::Status Init(const ncclUniqueId& id, absl::Duration timeout, const std::atomic<bool>& stop) {
    const absl::Time deadline = absl::Now() + timeout;
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    void* staging = nullptr;
    KVCM_CUDA_RETURN_IF_ERROR(cudaMalloc(&staging, staging_bytes_));
    staging_ = static_cast<std::byte*>(staging);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    KVCM_NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&comm_, 2, id, 1 - peer_, &config), comm_);
    if (absl::Status s = Wait(deadline, &stop, nullptr, /*query_stream=*/false); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("joining the communicator: ", s.message()));
    }
    // Warm-up: 8 bytes each way in one group.
    KVCM_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
    KVCM_NCCL_RETURN_IF_ERROR(ncclSend(staging_, kWarmupBytes, ncclUint8, peer_, comm_, stream_),
                              comm_);
    KVCM_NCCL_RETURN_IF_ERROR(
        ncclRecv(staging_ + kWarmupBytes, kWarmupBytes, ncclUint8, peer_, comm_, stream_), comm_);
    KVCM_NCCL_RETURN_IF_ERROR(ncclGroupEnd(), comm_);
    if (absl::Status s = Wait(deadline, &stop, nullptr, /*query_stream=*/true); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("warm-up: ", s.message()));
    }
    return absl::OkStatus();
  }

  uint64_t staging_bytes() const override { return staging_bytes_; }

  absl::Status StageIn(const std::byte* src, uint64_t offset, uint64_t bytes) override {
    if (offset > staging_bytes_ || bytes > staging_bytes_ - offset) {
      return absl::OutOfRangeError("StageIn leaves the staging buffer");
    }
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_ + offset, src, bytes, cudaMemcpyDefault, stream_));
    KVCM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status StageOut(uint64_t offset, std::byte* dst, uint64_t bytes) override {
    if (offset > staging_bytes_ || bytes > staging_bytes_ - offset) {
      return absl::OutOfRangeError("StageOut leaves the staging buffer");
    }
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, staging_ + offset, bytes, cudaMemcpyDefault, stream_));
    KVCM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Send(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) override {
    return Transfer(/*send=*/true, bytes, timeout, check);
  }
  absl::Status Recv(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) override {
    return Transfer(/*send=*/false, bytes, timeout, check);
  }

  void Cancel() override { cancelled_.store(true); }

 private:
  absl::Status Transfer(bool send, uint64_t bytes, absl::Duration timeout, const WaitCheck& check) {
    if (cancelled_.load()) return absl::CancelledError("the link was cancelled");
    if (bytes > staging_bytes_) return absl::OutOfRangeError("more bytes than the staging");
    const absl::Time deadline = absl::Now() + timeout;
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
    if (send) {
      KVCM_NCCL_RETURN_IF_ERROR(ncclSend(staging_, bytes, ncclUint8, peer_, comm_, stream_), comm_);
    } else {
      KVCM_NCCL_RETURN_IF_ERROR(ncclRecv(staging_, bytes, ncclUint8, peer_, comm_, stream_), comm_);
    }
    KVCM_NCCL_RETURN_IF_ERROR(ncclGroupEnd(), comm_);
    return Wait(deadline, &cancelled_, &check, /*query_stream=*/true);
  }

  // Polls until the communicator has no operation in progress and (query_stream) the stream
  // has drained; the first of the deadline, `stop`, `check`'s error or an NCCL / CUDA error
  // ends the wait early. Never blocks in NCCL or CUDA.
  absl::Status Wait(absl::Time deadline, const std::atomic<bool>* stop, const WaitCheck* check,
                    bool query_stream) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      KVCM_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &state), comm_);
      if (state != ncclSuccess && state != ncclInProgress) {
        return NcclErrorToStatus(state, "ncclCommGetAsyncError", comm_);
      }
      if (state == ncclSuccess) {
        if (!query_stream) return absl::OkStatus();
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) {
          return gpu::CudaErrorToStatus(q, "cudaStreamQuery", __FILE__, __LINE__);
        }
      }
      if (stop != nullptr && stop->load()) return absl::CancelledError("the link was cancelled");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("the NCCL operation did not complete in time");
      }
      if (check != nullptr && *check) {
        if (absl::Status s = (*check)(); !s.ok()) return s;
      }
      absl::SleepFor(kPollInterval);
    }
  }

  const int device_;
  const int peer_;
  const uint64_t staging_bytes_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::byte* staging_ = nullptr;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  KVCM_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id), nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<BlockLink>> MakeNcclLink(const NcclLinkOptions& options,
                                                        const std::string& unique_id, int rank,
                                                        const std::atomic<bool>& stop) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("unique_id must be ", NCCL_UNIQUE_ID_BYTES, " bytes, got ", unique_id.size()));
  }
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank must be 0 or 1, got ", rank));
  }
  if (options.staging_bytes < 2 * kWarmupBytes) {
    return absl::InvalidArgumentError("staging_bytes must be >= 16");
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  auto link = std::make_unique<NcclLink>(options.device, rank, options.staging_bytes);
  if (absl::Status s = link->Init(id, options.connect_timeout, stop); !s.ok()) {
    return s;  // the destructor aborts the communicator and frees the rest
  }
  return std::unique_ptr<BlockLink>(std::move(link));
}

}  // namespace kvcm
