// The engine's end of the local data path (proto/kvcm/v1/local.proto), in C++: a memfd region
// to register and a connection that sends requests and reads their replies. What the Python
// client (client/python/kvcm/agent_local.py) does, for the agent's tests and benchmarks.
//
// Not thread-safe: one caller per object.
#ifndef KVCM_GPU_AGENT_LOCAL_LOCAL_CLIENT_H_
#define KVCM_GPU_AGENT_LOCAL_LOCAL_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcm/v1/local.pb.h"

namespace kvcm {

// `bytes` of shared memory: a memfd (allocated and sealed against shrinking, as a hello
// requires) mapped read/write. Owns the fd and the mapping.
class MemfdRegion {
 public:
  // INTERNAL when the memfd cannot be made, sized, allocated, sealed or mapped. With `seal`
  // false the memfd is left unsealed, with `allocate` false sparse (for tests of the agent's
  // refusals).
  static absl::StatusOr<std::unique_ptr<MemfdRegion>> Create(uint64_t bytes, bool seal = true,
                                                             bool allocate = true);
  ~MemfdRegion();
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;

  int fd() const { return fd_; }
  std::byte* data() const { return data_; }
  uint64_t size() const { return bytes_; }

 private:
  MemfdRegion(int fd, std::byte* data, uint64_t bytes) : fd_(fd), data_(data), bytes_(bytes) {}
  const int fd_;
  std::byte* const data_;
  const uint64_t bytes_;
};

class LocalClient {
 public:
  // Connects to the agent's local socket at `path`. UNAVAILABLE when it cannot.
  static absl::StatusOr<std::unique_ptr<LocalClient>> Connect(const std::string& path);
  ~LocalClient();
  LocalClient(const LocalClient&) = delete;
  LocalClient& operator=(const LocalClient&) = delete;

  // Sends `req` (with `fds` as SCM_RIGHTS; they stay the caller's) and returns the reply.
  // UNAVAILABLE when the connection broke (the agent closed it).
  absl::StatusOr<v1::LocalReply> Call(const v1::LocalRequest& req, std::span<const int> fds = {});
  // The same for any bytes, well-formed or not (tests).
  absl::StatusOr<v1::LocalReply> CallRaw(absl::string_view datagram, std::span<const int> fds = {});

  int fd() const { return fd_; }

 private:
  explicit LocalClient(int fd) : fd_(fd) {}
  const int fd_;
};

// A reply as a Status: its code and message.
absl::Status LocalReplyStatus(const v1::LocalReply& reply);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_LOCAL_LOCAL_CLIENT_H_
