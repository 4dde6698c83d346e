// Child processes for multi-process tests: posix_spawn (no shell), output captured through
// pipes or sent to a log file, and a free loopback port. Header-only, test code.
#ifndef KVCM_TESTS_UTIL_CHILD_PROCESS_H_
#define KVCM_TESTS_UTIL_CHILD_PROCESS_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace kvcm::testing {

// How a finished process ended, and what it printed.
struct ProcessResult {
  bool exited = false;  // normal exit (exit_code valid)
  int exit_code = -1;
  int term_signal = 0;  // set when killed by a signal
  bool timed_out = false;
  std::string out;
  std::string err;

  std::string Describe() const {
    return absl::StrCat(
        timed_out ? "timed out; " : "",
        exited ? absl::StrCat("exit ", exit_code) : absl::StrCat("signal ", term_signal),
        "\n--- stdout ---\n", out, "--- stderr ---\n", err);
  }
};

// A child process. Output goes to two pipes (captured by Finish) or, with a log path, to
// that file; a thread reads the pipes as the child writes. Not thread-safe.
class Subprocess {
 public:
  static std::unique_ptr<Subprocess> Start(const std::vector<std::string>& argv,
                                           const std::string& log_path = "") {
    auto p = std::unique_ptr<Subprocess>(new Subprocess());
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    if (log_path.empty()) {
      if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
        return nullptr;
      }
      posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
      posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
    } else {
      posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    }
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const std::string& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    const int rc = posix_spawn(&p->pid_, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (log_path.empty()) {
      close(out_pipe[1]);
      close(err_pipe[1]);
      if (rc == 0) {
        p->drain_ = std::thread(&Subprocess::Drain, p.get(), out_pipe[0], err_pipe[0]);
      } else {
        close(out_pipe[0]);
        close(err_pipe[0]);
      }
    } else {
      p->drained_ = true;  // the output is in the log file
    }
    if (rc != 0) {
      ADD_FAILURE() << "posix_spawn " << argv[0] << ": " << strerror(rc);
      return nullptr;
    }
    return p;
  }

  ~Subprocess() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    StopDrain();
  }

  // False once the process has ended (it is then reaped; Finish returns at once).
  bool Running() {
    if (reaped_) {
      return false;
    }
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      Reap(status);
    }
    return !reaped_;
  }

  void Signal(int sig) {
    if (!reaped_) {
      kill(pid_, sig);
    }
  }

  // Waits for the exit and for the output pipes to close, for at most `timeout`; then
  // SIGKILLs the process and reports timed_out.
  ProcessResult Finish(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (Running() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (!reaped_) {
      result_.timed_out = true;
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      Reap(status);
    }
    {
      // A grandchild may still hold the pipes; what arrived by the deadline is the output.
      std::unique_lock<std::mutex> lock(mu_);
      drained_cv_.wait_until(lock, absl::ToChronoTime(deadline), [this] { return drained_; });
    }
    StopDrain();
    std::lock_guard<std::mutex> lock(mu_);
    result_.out = out_;
    result_.err = err_;
    return result_;
  }

 private:
  Subprocess() = default;

  // Reads both pipes as the child writes, so that a child that logs a lot never blocks in a
  // write to a full pipe (a server whose timer thread blocks there stops closing sockets).
  void Drain(int out_fd, int err_fd) {
    int fds_open[2] = {out_fd, err_fd};
    while (!stop_.load() && (fds_open[0] >= 0 || fds_open[1] >= 0)) {
      pollfd fds[2] = {{fds_open[0], POLLIN, 0}, {fds_open[1], POLLIN, 0}};
      if (poll(fds, 2, 100) <= 0) {
        continue;
      }
      for (int i = 0; i < 2; ++i) {
        if (fds[i].fd < 0 || fds[i].revents == 0) {
          continue;
        }
        char buf[4096];
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        if (n > 0) {
          std::lock_guard<std::mutex> lock(mu_);
          (i == 0 ? out_ : err_).append(buf, static_cast<size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          close(fds_open[i]);
          fds_open[i] = -1;
        }
      }
    }
    for (int fd : fds_open) {
      if (fd >= 0) {
        close(fd);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    drained_ = true;
    drained_cv_.notify_all();
  }

  void StopDrain() {
    stop_.store(true);
    if (drain_.joinable()) {
      drain_.join();
    }
  }

  void Reap(int status) {
    reaped_ = true;
    result_.exited = WIFEXITED(status);
    if (result_.exited) {
      result_.exit_code = WEXITSTATUS(status);
    }
    if (WIFSIGNALED(status)) {
      result_.term_signal = WTERMSIG(status);
    }
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  ProcessResult result_;
  std::thread drain_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable drained_cv_;
  bool drained_ = false;  // guarded by mu_, as are out_ and err_
  std::string out_;
  std::string err_;
};

// A TCP port nothing was bound to on any address a moment ago. Ports come from below Linux's
// ephemeral range (32768-60999 by default), where the kernel also picks the local ports of
// outgoing connections: a port bound to 0 and closed could be taken by any client's connect()
// before the server binds it (a flood test beside these opens 12,000). Each process walks
// 20000-31999 from a random start, so it never hands out one port twice.
inline int FreePort() {
  constexpr int kLow = 20'000;
  constexpr int kHigh = 32'000;
  static std::atomic<int> next{kLow + static_cast<int>(getpid() * 7919u % (kHigh - kLow))};
  for (int tries = 0; tries < kHigh - kLow; ++tries) {
    const int port = kLow + (next.fetch_add(1) - kLow) % (kHigh - kLow);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);  // taken on any address is taken
    addr.sin_port = htons(static_cast<uint16_t>(port));
    // No SO_REUSEADDR: a port with a TIME_WAIT socket counts as taken too.
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) {
      return port;
    }
  }
  return 0;
}

// The whole file at `path`; "" when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The value of a "name: value" line of kvcmctl output; "" when absent.
inline std::string OutputField(const std::string& out, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::ConsumePrefix(&line, name + ": ")) return std::string(line);
  }
  return "";
}

// Polls `pred` every 20 ms until it holds (true) or `timeout` passes (false).
template <typename Pred>
bool WaitUntil(Pred pred, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_CHILD_PROCESS_H_
