// RunClientLoad: kvcm::Client's blocking calls (what an inference worker or router links),
// one thread per outstanding call. Closed loop only: a blocking thread cannot keep a
// schedule while its call is in flight.
#include <deque>
#include <random>
#include <thread>

#include "bench/load/load_driver.h"

namespace kvcm::load {
namespace {

void RunClientThread(const LoadOptions& options, const LoadTarget& target, int index,
                     Clock::time_point start, Clock::time_point end, WorkerStats* stats) {
  Client& client = *target.clients[index % target.clients.size()];
  std::mt19937_64 rng(0x9e3779b97f4a7c15ULL * (index + 1));
  const bool pins_allowed = target.mix.weight(RpcKind::kRelease) > 0;
  const Clock::time_point measure_from =
      start +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.warmup_s));
  CallOptions call;
  call.deadline_ms = options.deadline_ms;
  std::deque<std::pair<size_t, uint64_t>> pins;  // (namespace, pin id)
  std::this_thread::sleep_until(start);
  for (Clock::time_point t = Clock::now(); t < end; t = Clock::now()) {
    RpcKind kind = target.mix.Draw(rng);
    if (kind == RpcKind::kRelease && pins.empty()) {
      kind = RpcKind::kMatch;
    }
    const size_t n = rng() % target.namespaces.size();
    const NamespaceLoad& load = target.namespaces[n];
    const LoadPrompt& prompt = load.prompts[rng() % load.prompts.size()];
    absl::Status status;
    switch (kind) {
      case RpcKind::kMatch:
      case RpcKind::kProbe: {
        MatchParams params;
        params.probe = kind == RpcKind::kProbe;
        params.pin = !params.probe && pins_allowed && pins.size() < options.max_pins_per_thread;
        absl::StatusOr<MatchReply> r = client.MatchHashes(load.ns, prompt.pages, params, call);
        status = r.status();
        if (r.ok()) {
          if (r->pin_id != 0) {
            pins.emplace_back(n, r->pin_id);
          }
          stats->RecordPages(kind, r->prompt_pages, r->matched_pages, t >= measure_from);
        }
        break;
      }
      case RpcKind::kInsert: {
        absl::StatusOr<InsertReply> r = client.InsertHashes(
            load.ns, prompt.pages, load.pools[rng() % load.pools.size()], prompt.block_ids, call);
        status = r.status();
        if (r.ok()) {
          stats->RecordPages(kind, prompt.pages.size(), r->already_present_pages,
                             t >= measure_from);
        }
        break;
      }
      case RpcKind::kRelease:
        status =
            client.Release(target.namespaces[pins.front().first].ns, pins.front().second, call);
        pins.pop_front();
        break;
      case RpcKind::kRoute: {
        // Route takes tokens and hashes them itself (PromptSetOptions::keep_tokens).
        absl::StatusOr<RouteReply> r = client.Route(load.ns, prompt.tokens, {}, call);
        status = r.status();
        if (r.ok()) {
          stats->RecordPages(kind, r->match.prompt_pages, r->match.matched_pages,
                             t >= measure_from);
        }
        break;
      }
    }
    // absl::StatusCode and grpc::StatusCode share their numbers.
    stats->Record(kind, static_cast<int>(status.code()),
                  std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count(),
                  t >= measure_from);
  }
  for (const auto& [ns, pin] : pins) {
    (void)client.Release(target.namespaces[ns].ns, pin, call);
  }
}

}  // namespace

void RunClientLoad(const LoadOptions& options, const LoadTarget& target, Clock::time_point start,
                   std::span<std::unique_ptr<WorkerStats>> stats) {
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(options.warmup_s + options.duration_s));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < stats.size(); ++i) {
    threads.emplace_back(RunClientThread, std::cref(options), std::cref(target),
                         static_cast<int>(i), start, end, stats[i].get());
  }
  for (std::thread& t : threads) {
    t.join();
  }
}

}  // namespace kvcm::load
