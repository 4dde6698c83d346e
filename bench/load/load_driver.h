// kvcm-load's two ways of driving a kvcm-manager: RunStubLoad (the generated async stubs on
// completion queues; closed or open loop) and RunClientLoad (kvcm::Client's blocking calls,
// one thread per outstanding call; closed loop only).
#ifndef KVCM_BENCH_LOAD_LOAD_DRIVER_H_
#define KVCM_BENCH_LOAD_LOAD_DRIVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/load/load_stats.h"
#include "bench/load/prompt_set.h"
#include "client/client.h"
#include "common/types.h"

namespace kvcm::load {

using Clock = std::chrono::steady_clock;

struct LoadOptions {
  std::string address = "127.0.0.1:50051";
  // kStub: RunStubLoad; kClient: RunClientLoad (closed loop only).
  enum class Api { kStub, kClient };
  Api api = Api::kStub;
  // Open loop: calls are due at rate_per_s (all threads together), Poisson or evenly spaced
  // arrivals, and each call's latency counts from when it was due, not from when it was
  // sent, so queueing behind the outstanding limit is measured. Closed loop: each of
  // `concurrency` slots sends its next call when the last one finishes.
  bool open_loop = false;
  double rate_per_s = 1000;
  bool poisson = true;
  // Closed loop: calls outstanding at all times. Open loop: the most outstanding at once.
  uint32_t concurrency = 32;
  // Threads driving the completion queues (the stub driver; the client driver uses one
  // thread per outstanding call).
  uint32_t threads = 1;
  // gRPC channels (TCP connections) the calls are spread over.
  uint32_t channels = 1;
  double warmup_s = 1;
  double duration_s = 10;
  int64_t deadline_ms = 1000;
  // A Match pins when the mix has releases, and each thread holds at most this many pins
  // (a Release drawn with none held is sent as a pinning Match).
  uint32_t max_pins_per_thread = 64;

  // INVALID_ARGUMENT naming the first bad field.
  absl::Status Validate() const;
};

// One registered namespace and what the load sends to it.
struct NamespaceLoad {
  NamespaceId ns;
  uint64_t key_fingerprint = 0;
  PromptSet prompts;  // hashed with the namespace's key
  // Index-only pools the namespace's inserts go to (one drawn per call).
  std::vector<PoolRef> pools;
};

// What the set-up made, for the drivers. The pointees outlive the run.
struct LoadTarget {
  uint32_t page_size_tokens = 0;
  // Each call draws one, uniformly. Not empty.
  std::vector<NamespaceLoad> namespaces;
  RpcMix mix;
  // The client driver's clients (each its own channel), RegisterModel done on every
  // namespace.
  std::vector<Client*> clients;
};

// Runs from `start` until start + warmup + duration, then waits for the calls in flight.
// Thread i records into stats[i]; stats.size() is the number of threads (options.threads
// for the stub driver, options.concurrency for the client driver). A call counts in the
// totals when it was due in the measured window [start + warmup, end).
void RunStubLoad(const LoadOptions& options, const LoadTarget& target, Clock::time_point start,
                 std::span<std::unique_ptr<WorkerStats>> stats);
void RunClientLoad(const LoadOptions& options, const LoadTarget& target, Clock::time_point start,
                   std::span<std::unique_ptr<WorkerStats>> stats);

}  // namespace kvcm::load

#endif  // KVCM_BENCH_LOAD_LOAD_DRIVER_H_
