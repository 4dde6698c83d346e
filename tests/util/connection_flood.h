// ConnectionFlood: the data-port adversary of issue 35 for tests. It holds connections to a
// listener from several loopback source addresses (127.0.0.2, 127.0.0.3, ...: all loopback on
// Linux), never sends a byte, and reopens each connection as soon as the server closes it,
// on a thread of its own until destroyed. Thread-safe: opened() may be read meanwhile.
#ifndef KVCM_TESTS_UTIL_CONNECTION_FLOOD_H_
#define KVCM_TESTS_UTIL_CONNECTION_FLOOD_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcm::testing {

class ConnectionFlood {
 public:
  // `per_source` connections to `target` ("127.0.0.1:port" as sockaddr) from each of
  // `sources` (numeric IPv4 loopback addresses).
  ConnectionFlood(const sockaddr_in& target, std::vector<std::string> sources, int per_source)
      : target_(target), sources_(std::move(sources)), per_source_(per_source) {
    thread_ = std::thread([this] { Run(); });
  }
  ~ConnectionFlood() {
    stop_ = true;
    thread_.join();
  }
  ConnectionFlood(const ConnectionFlood&) = delete;
  ConnectionFlood& operator=(const ConnectionFlood&) = delete;

  // `count` loopback source addresses, 127.0.0.10 upward.
  static std::vector<std::string> LoopbackSources(int count) {
    std::vector<std::string> sources;
    for (int i = 0; i < count; ++i) sources.push_back(absl::StrCat("127.0.0.", 10 + i));
    return sources;
  }

  // Polls `done` every 20 ms for at most `limit`; whether it became true (e.g. the port
  // timed out the flood's first handshakes, so the budget holds its reopened ones).
  template <typename Done>
  static bool WaitFor(Done done, absl::Duration limit = absl::Seconds(10)) {
    const absl::Time end = absl::Now() + limit;
    while (!done()) {
      if (absl::Now() >= end) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  // Connections opened so far, first ones and reopened ones.
  uint64_t opened() const { return opened_.load(); }
  // Connections the server closed so far.
  uint64_t closed_by_server() const { return closed_.load(); }

 private:
  // A connection from `source`, or -1. connect() gives up after 200 ms (a full backlog).
  int Open(const std::string& source) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    timeval tv{.tv_sec = 0, .tv_usec = 200'000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in src{};
    src.sin_family = AF_INET;
    inet_pton(AF_INET, source.c_str(), &src.sin_addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
        connect(fd, reinterpret_cast<const sockaddr*>(&target_), sizeof(target_)) != 0) {
      close(fd);
      return -1;
    }
    opened_.fetch_add(1);
    return fd;
  }

  void Run() {
    std::vector<pollfd> fds;
    std::vector<size_t> source_of;
    for (size_t s = 0; s < sources_.size(); ++s) {
      for (int i = 0; i < per_source_; ++i) {
        fds.push_back({.fd = Open(sources_[s]), .events = POLLIN, .revents = 0});
        source_of.push_back(s);
      }
    }
    char buf[256];
    while (!stop_) {
      (void)poll(fds.data(), fds.size(), 20);
      for (size_t i = 0; i < fds.size() && !stop_; ++i) {
        bool reopen = fds[i].fd < 0;
        if (!reopen && fds[i].revents != 0) {
          const ssize_t got = recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
          reopen = got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR);
          if (reopen) {
            closed_.fetch_add(1);
            close(fds[i].fd);
          }
        }
        if (reopen) fds[i].fd = Open(sources_[source_of[i]]);
        fds[i].revents = 0;
      }
    }
    for (const pollfd& p : fds) {
      if (p.fd >= 0) close(p.fd);
    }
  }

  const sockaddr_in target_;
  const std::vector<std::string> sources_;
  const int per_source_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> opened_{0};
  std::atomic<uint64_t> closed_{0};
  std::thread thread_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_CONNECTION_FLOOD_H_
