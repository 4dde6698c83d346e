// RunStubLoad: the generated CacheManager async stubs, one completion queue per thread.
// Each thread sends and completes its own calls (the queue's poller is the thread itself),
// so no gRPC thread hands work over between a send and its completion.
#include <deque>
#include <random>
#include <thread>

#include "bench/load/load_driver.h"
#include "client/wire.h"
#include "common/credentials.h"
#include "grpcpp/grpcpp.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "proto/core_types.h"

namespace kvcm::load {
namespace {

using Stub = v1::CacheManager::Stub;
template <typename T>
using Reader = std::unique_ptr<grpc::ClientAsyncResponseReader<T>>;

// One call in flight; reused for the slot's next call.
struct Call {
  RpcKind kind = RpcKind::kMatch;
  size_t ns = 0;  // index into LoadTarget::namespaces
  bool pin = false;
  Clock::time_point due;
  std::unique_ptr<grpc::ClientContext> context;
  grpc::Status status;
  v1::MatchRequest match_request;
  v1::MatchResponse match_response;
  Reader<v1::MatchResponse> match_reader;
  v1::InsertRequest insert_request;
  v1::InsertResponse insert_response;
  Reader<v1::InsertResponse> insert_reader;
  v1::ReleaseRequest release_request;
  v1::ReleaseResponse release_response;
  Reader<v1::ReleaseResponse> release_reader;
  v1::RouteRequest route_request;
  v1::RouteResponse route_response;
  Reader<v1::RouteResponse> route_reader;
};

// gRPC takes deadlines on the system clock.
std::chrono::system_clock::time_point SystemTime(Clock::time_point t) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
}

class StubWorker {
 public:
  StubWorker(const LoadOptions& options, const LoadTarget& target,
             const std::vector<std::vector<v1::Prompt>>& prompts,
             const std::vector<std::unique_ptr<Stub>>& stubs, int index, WorkerStats* stats)
      : options_(options),
        target_(target),
        prompts_(prompts),
        stubs_(stubs),
        index_(index),
        stats_(stats),
        rng_(0x9e3779b97f4a7c15ULL * (index + 1)),
        pins_allowed_(target.mix.weight(RpcKind::kRelease) > 0) {
    for (const NamespaceLoad& n : target.namespaces) {
      NamespaceToProto(n.ns, &ns_.emplace_back());
    }
  }

  void Run(Clock::time_point start, Clock::time_point end) {
    measure_from_ = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(options_.warmup_s));
    end_ = end;
    const uint32_t slots = SlotsOfThread();
    std::vector<std::unique_ptr<Call>> calls;
    for (uint32_t i = 0; i < slots; ++i) {
      calls.push_back(std::make_unique<Call>());
    }
    std::vector<Call*> idle;
    idle.reserve(calls.size());
    for (auto& c : calls) {
      idle.push_back(c.get());
    }
    std::this_thread::sleep_until(start);

    if (!options_.open_loop) {
      for (Call* c : idle) {
        Send(c, Clock::now());
      }
      idle.clear();
      void* tag;
      bool ok;
      while (outstanding_ > 0 && cq_.Next(&tag, &ok)) {
        Call* c = static_cast<Call*>(tag);
        Complete(c);
        if (Clock::now() < end_) {
          Send(c, Clock::now());
        }
      }
    } else {
      const double mean_gap_s = options_.threads / options_.rate_per_s;
      std::exponential_distribution<double> exp_gap(1.0 / mean_gap_s);
      auto gap = [&] {
        const double s = options_.poisson ? exp_gap(rng_) : mean_gap_s;
        return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
      };
      // Threads start at staggered phases so that fixed arrivals do not come in bursts.
      Clock::time_point next =
          start + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(mean_gap_s * index_ / options_.threads));
      while (true) {
        const Clock::time_point now = Clock::now();
        if (next < end_ && next <= now && now < end_ && !idle.empty()) {
          Call* c = idle.back();
          idle.pop_back();
          Send(c, next);
          next += gap();
          continue;
        }
        if (next >= end_ && outstanding_ == 0) {
          break;
        }
        const Clock::time_point wake = (next < end_ && !idle.empty()) ? next : end_;
        void* tag;
        bool ok;
        const auto got = outstanding_ > 0
                             ? cq_.AsyncNext(&tag, &ok, SystemTime(std::max(wake, now)))
                             : grpc::CompletionQueue::TIMEOUT;
        if (got == grpc::CompletionQueue::GOT_EVENT) {
          Call* c = static_cast<Call*>(tag);
          Complete(c);
          idle.push_back(c);
        } else if (got == grpc::CompletionQueue::TIMEOUT && outstanding_ == 0) {
          std::this_thread::sleep_until(wake);
        } else if (got == grpc::CompletionQueue::SHUTDOWN) {
          break;
        }
        if (Clock::now() >= end_ && next < end_) {
          // Arrivals due before the end that the outstanding limit kept back.
          uint64_t unsent = 0;
          while (next < end_) {
            ++unsent;
            next += gap();
          }
          stats_->AddUnsent(unsent);
        }
      }
    }
    ReleaseHeldPins();
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

 private:
  uint32_t SlotsOfThread() const {
    const uint32_t n = options_.concurrency / options_.threads;
    return n + (static_cast<uint32_t>(index_) < options_.concurrency % options_.threads ? 1 : 0);
  }

  Stub* NextStub() { return stubs_[next_stub_++ % stubs_.size()].get(); }

  void Send(Call* c, Clock::time_point due) {
    c->due = due;
    c->kind = target_.mix.Draw(rng_);
    c->pin = false;
    if (c->kind == RpcKind::kRelease && pins_.empty()) {
      c->kind = RpcKind::kMatch;
    }
    c->context = std::make_unique<grpc::ClientContext>();
    c->context->set_deadline(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(options_.deadline_ms));
    const size_t n = rng_() % ns_.size();
    const size_t p = rng_() % prompts_[n].size();
    c->ns = n;
    switch (c->kind) {
      case RpcKind::kMatch:
      case RpcKind::kProbe: {
        const bool probe = c->kind == RpcKind::kProbe;
        c->pin = !probe && pins_allowed_ &&
                 pins_.size() + pins_in_flight_ < options_.max_pins_per_thread;
        if (c->pin) {
          ++pins_in_flight_;
        }
        v1::MatchRequest& r = c->match_request;
        *r.mutable_namespace_() = ns_[n];
        *r.mutable_prompt() = prompts_[n][p];
        r.set_pin(c->pin);
        r.set_probe(probe);
        c->match_reader = NextStub()->PrepareAsyncMatch(c->context.get(), r, &cq_);
        c->match_reader->StartCall();
        c->match_reader->Finish(&c->match_response, &c->status, c);
        break;
      }
      case RpcKind::kInsert: {
        v1::InsertRequest& r = c->insert_request;
        *r.mutable_namespace_() = ns_[n];
        *r.mutable_prompt() = prompts_[n][p];
        const NamespaceLoad& load = target_.namespaces[n];
        PoolToProto(load.pools[rng_() % load.pools.size()], r.mutable_pool());
        const std::vector<BlockId>& ids = load.prompts[p].block_ids;
        r.mutable_block_ids()->Assign(ids.begin(), ids.end());
        c->insert_reader = NextStub()->PrepareAsyncInsert(c->context.get(), r, &cq_);
        c->insert_reader->StartCall();
        c->insert_reader->Finish(&c->insert_response, &c->status, c);
        break;
      }
      case RpcKind::kRelease: {
        v1::ReleaseRequest& r = c->release_request;
        *r.mutable_namespace_() = ns_[pins_.front().first];
        r.set_pin_id(pins_.front().second);
        pins_.pop_front();
        c->release_reader = NextStub()->PrepareAsyncRelease(c->context.get(), r, &cq_);
        c->release_reader->StartCall();
        c->release_reader->Finish(&c->release_response, &c->status, c);
        break;
      }
      case RpcKind::kRoute: {
        v1::RouteRequest& r = c->route_request;
        *r.mutable_namespace_() = ns_[n];
        *r.mutable_prompt() = prompts_[n][p];
        r.set_policy(v1::ROUTE_POLICY_PREFILL_SAVED);
        c->route_reader = NextStub()->PrepareAsyncRoute(c->context.get(), r, &cq_);
        c->route_reader->StartCall();
        c->route_reader->Finish(&c->route_response, &c->status, c);
        break;
      }
    }
    ++outstanding_;
  }

  void Complete(Call* c) {
    --outstanding_;
    const Clock::time_point now = Clock::now();
    const bool measured = c->due >= measure_from_ && c->due < end_;
    stats_->Record(c->kind, c->status.error_code(),
                   std::chrono::duration_cast<std::chrono::nanoseconds>(now - c->due).count(),
                   measured);
    if (c->status.ok()) {
      switch (c->kind) {
        case RpcKind::kMatch:
        case RpcKind::kProbe:
          stats_->RecordPages(c->kind, c->match_response.prompt_pages(),
                              c->match_response.matched_pages(), measured);
          break;
        case RpcKind::kInsert:
          stats_->RecordPages(c->kind, c->insert_request.block_ids_size(),
                              c->insert_response.already_present_pages(), measured);
          break;
        case RpcKind::kRoute:
          stats_->RecordPages(c->kind, c->route_response.match().prompt_pages(),
                              c->route_response.match().matched_pages(), measured);
          break;
        case RpcKind::kRelease:
          break;
      }
    }
    if (c->pin) {
      --pins_in_flight_;
      if (c->status.ok() && c->match_response.pin_id() != 0) {
        pins_.emplace_back(c->ns, c->match_response.pin_id());
      }
    }
  }

  // Pins still held at the end, released with blocking calls (not measured).
  void ReleaseHeldPins() {
    for (const auto& [n, pin] : pins_) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(options_.deadline_ms));
      v1::ReleaseRequest r;
      *r.mutable_namespace_() = ns_[n];
      r.set_pin_id(pin);
      v1::ReleaseResponse response;
      (void)NextStub()->Release(&context, r, &response);
    }
    pins_.clear();
  }

  const LoadOptions& options_;
  const LoadTarget& target_;
  const std::vector<std::vector<v1::Prompt>>& prompts_;  // [namespace][prompt]
  const std::vector<std::unique_ptr<Stub>>& stubs_;
  const int index_;
  WorkerStats* const stats_;
  std::mt19937_64 rng_;
  const bool pins_allowed_;
  std::vector<v1::Namespace> ns_;  // target_.namespaces as protos
  grpc::CompletionQueue cq_;
  Clock::time_point measure_from_;
  Clock::time_point end_;
  uint64_t outstanding_ = 0;
  size_t next_stub_ = 0;
  std::deque<std::pair<size_t, uint64_t>> pins_;  // (namespace, pin id)
  uint32_t pins_in_flight_ = 0;
};

}  // namespace

void RunStubLoad(const LoadOptions& options, const LoadTarget& target, Clock::time_point start,
                 std::span<std::unique_ptr<WorkerStats>> stats) {
  std::vector<std::unique_ptr<Stub>> stubs;
  for (uint32_t i = 0; i < options.channels; ++i) {
    grpc::ChannelArguments args;
    // A channel of its own subchannel pool opens its own TCP connection.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("kvcm.load.channel", static_cast<int>(i));
    stubs.push_back(v1::CacheManager::NewStub(MakeInsecureChannel(options.address, args)));
  }
  std::vector<std::vector<v1::Prompt>> prompts;
  for (const NamespaceLoad& n : target.namespaces) {
    std::vector<v1::Prompt>& protos = prompts.emplace_back(n.prompts.size());
    for (size_t i = 0; i < protos.size(); ++i) {
      wire::SetHashes(n.prompts[i].pages, target.page_size_tokens, n.key_fingerprint, &protos[i]);
    }
  }
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(options.warmup_s + options.duration_s));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < stats.size(); ++i) {
    threads.emplace_back([&, i] {
      StubWorker worker(options, target, prompts, stubs, static_cast<int>(i), stats[i].get());
      worker.Run(start, end);
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
}

}  // namespace kvcm::load
