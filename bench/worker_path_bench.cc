// kvcm_worker_path_bench: the whole request of an inference worker, stage by stage, against a
// real manager and a real agent (issue 27), next to index-only Inserts in the same run.
//
//   kvcm_worker_path_bench [--smoke] [--requests=2000] [--warmup=200] [--prompt_pages=8]
//                          [--cached_pages=4] [--workers=1,8] [--throughput_requests=800]
//
// One process runs a ManagerServer (loopback, plaintext, metrics recorded, exporter off) and
// an Agent (host backend, its pool registered with the manager over AgentControl, commands
// over the Commands stream, the local data path on a Unix socket). Each worker has its own
// Client (client/), BlockAgent stub and local-path connection with a memfd region, and makes
// the requests an engine makes for a prompt of --prompt_pages pages whose first
// --cached_pages pages (the worker's shared prefix) are cached on the agent:
//   match:    Client::Match with pin, requester = the agent: the cached prefix and its blocks.
//   allocate: BlockAgent.Allocate of the missing pages' blocks, in the namespace, owner = the
//             agent's epoch (what CommitBlocks needs).
//   write:    a STORE over the local data path: the engine region's blocks into them.
//   insert:   Client::Insert of the whole prompt (cached blocks + new ones) into the agent's
//             pool: the manager sends CommitBlocks to the agent and indexes the pages on
//             its ack.
//   release:  Client::Release of the pin.
// "request" is the client's wall time of all five. "index-only insert" is Client::Insert of
// a prompt of the same shape (the same cached prefix, the same number of new pages) into a
// pool no agent registered: the manager's Insert without the commit. One worker alternates a
// request and an index-only insert, in rotated order every --block requests, for the latency
// table; then N workers (threads) run --throughput_requests requests between them for
// requests per second, and as many index-only inserts for inserts per second. Every answer is
// checked (the matched prefix, the new pages indexed). The workers, threads of one process, share
// one connection to the manager and one to the agent (gRPC's global subchannel pool), where engines
// in their own processes would not.
//
// The default page is 32 KiB (a GQA model of 2 layers, 4 KV heads of 64 dims, bf16, 16-token
// pages): the commit moves no bytes, and a small page keeps the write stage from hiding the
// rest; --page_kib sets another size. The pool holds every block the run commits: nothing
// is evicted; with --pool_blocks smaller, the pool fills during the warmup and every later
// Allocate makes room (AgentControl.MakeRoom, then the FreeBlocks commands). Before measuring,
// every block is allocated to the namespace once and freed
// (--reuse_blocks), as in a pool in steady state: a block's first allocation to a namespace
// zeroes it.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/or_die.h"
#include "bench/workload.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/program_flags.h"
#include "gpu/agent/local/local_client.h"
#include "gpu/agent/server/agent.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/local.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"

ABSL_FLAG(bool, smoke, false, "few requests: proves the benchmark runs (ctest)");
ABSL_FLAG(int, requests, 2'000, "measured requests (and index-only inserts) of the latency table");
ABSL_FLAG(int, warmup, 200, "unmeasured requests per worker before measuring");
ABSL_FLAG(int, block, 50, "requests in a row before the latency arms swap order");
ABSL_FLAG(int, prompt_pages, 8, "pages of each prompt");
ABSL_FLAG(int, cached_pages, 4, "leading pages of each prompt cached (the worker's prefix)");
ABSL_FLAG(std::string, workers, "1,8", "worker counts of the throughput runs, comma-separated");
ABSL_FLAG(int, throughput_requests, 800, "requests of each throughput run, all workers together");
ABSL_FLAG(int, page_kib, 32, "KiB of one page (one block): 2 layers x page_kib/2 KiB");
ABSL_FLAG(std::string, policy, "", "the manager's eviction policy; empty: its default");
ABSL_FLAG(int, pool_blocks, 0,
          "blocks of the agent's pool; 0: every block the run commits (nothing is evicted). "
          "Fewer: the pool fills, and from then on every Allocate waits while the manager "
          "evicts (a store into a full pool, issue 33)");
ABSL_FLAG(bool, reuse_blocks, true,
          "first allocate every block of the pool to the namespace and free it (untimed), as "
          "in a pool in steady state; false: each request's blocks are fresh, and Allocate "
          "zeroes them (a block's first allocation to a namespace) on memory touched for the "
          "first time");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "keep Abseil's Mutex deadlock detection on (Debian's Abseil is built without "
          "NDEBUG, so it is on unless turned off); false, the default, turns it off as "
          "kvcm-manager does");

namespace kvcm::bench {
namespace {

using SteadyClock = std::chrono::steady_clock;

const NamespaceId kAgentNs{"bench", "wpath"};
const NamespaceId kIndexNs{"bench-index", "wpath"};
const char kAgentId[] = "gpu-0";
const PoolRef kIndexPool{"index-only-0", Tier::kGpu};

enum Stage { kMatch, kAllocate, kWrite, kInsert, kRelease, kRequest, kStages };
const char* const kStageNames[kStages] = {"match",  "allocate", "write",
                                          "insert", "release",  "request"};

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "check failed: %s\n", what.c_str());
    std::exit(1);
  }
}

// A GQA model of 2 layers whose page is `page_kib` KiB: 4 KV heads of 64 dims, bf16, K and V
// (1 KiB per token and layer), page_kib / 2 tokens per page.
ModelSpec BenchSpec(int page_kib) {
  return ModelSpec{.attention = AttentionKind::kGqa,
                   .num_layers = 2,
                   .num_heads = 8,
                   .num_kv_heads = 4,
                   .head_dim = 64,
                   .dtype = KvDtype::kBf16,
                   .page_size_tokens = static_cast<uint32_t>(std::max(1, page_kib / 2))};
}

struct Shape {
  uint32_t page_tokens = 0;
  uint32_t prompt_pages = 0;
  uint32_t cached_pages = 0;
  uint32_t new_pages() const { return prompt_pages - cached_pages; }
};

// Worker w's prompt number `n`: its prefix (the same for every n) then pages of its own.
std::vector<int32_t> PromptTokens(const Shape& shape, uint32_t worker, uint32_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(shape.prompt_pages) * shape.page_tokens);
  const size_t prefix = static_cast<size_t>(shape.cached_pages) * shape.page_tokens;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t seed = i < prefix ? worker * 2'654'435'761u : (n + 1) * 40'503u + worker;
    tokens[i] = static_cast<int32_t>((seed + i * 7) & 0x7fffffff);
  }
  return tokens;
}

// One worker: its client, its BlockAgent stub, its local-path connection and region.
// Not thread-safe: one thread per worker.
class Worker {
 public:
  static std::unique_ptr<Worker> Create(uint32_t id, const Shape& shape, const ModelSpec& spec,
                                        const std::string& manager_address, const Agent& agent) {
    auto w = std::unique_ptr<Worker>(new Worker(id, shape));
    ClientOptions co;
    co.insecure = true;
    co.address = manager_address;
    w->client_ = OrDie(Client::Connect(co), "Client::Connect");
    OrDie(w->client_->RegisterModel(kAgentNs, spec), "RegisterModel");
    OrDie(w->client_->RegisterModel(kIndexNs, spec), "RegisterModel (index-only)");
    w->agent_ = v1::BlockAgent::NewStub(MakeInsecureChannel(agent.address()));
    w->epoch_ = agent.epoch();
    const uint64_t block_bytes = spec.BytesPerPage();
    w->region_ = OrDie(MemfdRegion::Create(shape.new_pages() * block_bytes), "MemfdRegion");
    for (uint64_t i = 0; i < w->region_->size(); ++i) {
      w->region_->data()[i] = static_cast<std::byte>((i * 13 + id) & 0xff);
    }
    w->local_ = OrDie(LocalClient::Connect(agent.local_socket()), "LocalClient::Connect");
    v1::LocalRequest hello;
    hello.mutable_hello()->set_region_bytes(w->region_->size());
    hello.mutable_hello()->add_segment_offsets(0);
    hello.mutable_hello()->set_segment_bytes(block_bytes);
    hello.mutable_hello()->set_segment_stride(block_bytes);
    hello.mutable_hello()->set_num_engine_blocks(shape.new_pages());
    const int fd = w->region_->fd();
    CheckOk(LocalReplyStatus(OrDie(w->local_->Call(hello, {&fd, 1}), "hello")), "LocalHello");
    return w;
  }

  // One request, timed by stage into `times` (nanoseconds). `expect_cached`: whether the
  // prefix must be cached already (false for the worker's first, and in a pool that fills).
  void Request(uint32_t n, bool expect_cached, int64_t times[kStages]) {
    const std::vector<int32_t> tokens = PromptTokens(shape_, id_, n);
    const auto t0 = SteadyClock::now();
    // match
    MatchReply match = OrDie(
        client_->Match(kAgentNs, tokens, {.requester_agent_id = kAgentId, .pin = true}), "Match");
    std::vector<BlockId> blocks;
    for (const MatchReply::Segment& seg : match.segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        if (r.pool.agent_id != kAgentId) continue;
        blocks.insert(blocks.end(), r.block_ids.begin(), r.block_ids.end());
        break;
      }
    }
    const auto t1 = SteadyClock::now();
    if (expect_cached) {
      Check(match.matched_pages == shape_.cached_pages && blocks.size() == shape_.cached_pages &&
                match.pin_id != 0,
            absl::StrCat("worker ", id_, " request ", n, " matched ", match.matched_pages,
                         " pages, wanted ", shape_.cached_pages, " pinned"));
    }
    const uint32_t cached = static_cast<uint32_t>(blocks.size());
    const uint32_t missing = shape_.prompt_pages - cached;
    // allocate
    v1::AllocateBlocksRequest alloc;
    alloc.set_count(missing);
    alloc.set_owner_epoch(epoch_);
    NamespaceToProto(kAgentNs, alloc.mutable_namespace_());
    v1::AllocateBlocksResponse allocated;
    {
      grpc::ClientContext ctx;
      const grpc::Status s = agent_->Allocate(&ctx, alloc, &allocated);
      Check(s.ok() && allocated.block_ids_size() == static_cast<int>(missing),
            absl::StrCat("Allocate: ", s.error_message()));
    }
    const auto t2 = SteadyClock::now();
    // write: engine blocks 0.. of the region into the new blocks (missing <= the region's
    // blocks once the prefix is cached; the first request writes its prefix's blocks twice).
    v1::LocalRequest store;
    v1::LocalCopy* copy = store.mutable_copy();
    copy->set_direction(v1::LOCAL_DIRECTION_STORE);
    copy->set_tier(v1::TIER_GPU);
    copy->set_owner_epoch(epoch_);
    for (int i = 0; i < allocated.block_ids_size(); ++i) {
      copy->add_block_ids(allocated.block_ids(i));
      copy->add_block_generations(allocated.block_generations(i));
      copy->add_engine_blocks(static_cast<uint32_t>(i) % shape_.new_pages());
    }
    v1::LocalReply stored = OrDie(local_->Call(store), "STORE");
    CheckOk(LocalReplyStatus(stored), "STORE");
    const auto t3 = SteadyClock::now();
    // insert
    blocks.insert(blocks.end(), allocated.block_ids().begin(), allocated.block_ids().end());
    InsertReply ins = OrDie(client_->Insert(kAgentNs, tokens, PoolRef{kAgentId, Tier::kGpu}, blocks,
                                            {.agent_epoch = epoch_}),
                            "Insert");
    const auto t4 = SteadyClock::now();
    Check(ins.new_pages == missing && ins.already_present_pages == cached,
          absl::StrCat("Insert indexed ", ins.new_pages, " new pages, wanted ", missing));
    // release
    if (match.pin_id != 0) CheckOk(client_->Release(kAgentNs, match.pin_id), "Release");
    const auto t5 = SteadyClock::now();
    const auto ns = [](auto d) {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    };
    times[kMatch] = ns(t1 - t0);
    times[kAllocate] = ns(t2 - t1);
    times[kWrite] = ns(t3 - t2);
    times[kInsert] = ns(t4 - t3);
    times[kRelease] = ns(t5 - t4);
    times[kRequest] = ns(t5 - t0);
  }

  // An index-only Insert of prompt `n`'s shape (the worker's prefix, fresh pages after it);
  // its client wall time.
  SteadyClock::duration IndexOnlyInsert(uint32_t n) {
    const std::vector<int32_t> tokens = PromptTokens(shape_, id_, n);
    std::vector<BlockId> blocks(shape_.prompt_pages);
    for (uint32_t p = 0; p < shape_.prompt_pages; ++p) {
      blocks[p] = p < shape_.cached_pages ? first_index_block_ + p : next_index_block_++;
    }
    const auto start = SteadyClock::now();
    InsertReply ins = OrDie(client_->Insert(kIndexNs, tokens, kIndexPool, blocks), "Insert");
    const auto end = SteadyClock::now();
    Check(ins.new_pages + ins.already_present_pages == shape_.prompt_pages,
          "index-only Insert did not index the prompt");
    return end - start;
  }

 private:
  Worker(uint32_t id, const Shape& shape) : id_(id), shape_(shape) {}

  const uint32_t id_;
  const Shape shape_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::BlockAgent::Stub> agent_;
  uint64_t epoch_ = 0;
  std::unique_ptr<MemfdRegion> region_;
  std::unique_ptr<LocalClient> local_;
  // The index-only pool's blocks: any ids distinct across the workers will do.
  const BlockId first_index_block_ = id_ * 10'000'000u;
  BlockId next_index_block_ = first_index_block_ + 1'000;
};

void PrintRow(const char* name, LatencyHistogram& h) {
  std::printf("  %-18s %7zu %9.1f %9.1f %9.1f %9.1f\n", name, h.size(), h.Percentile(0.5) / 1e3,
              h.Percentile(0.9) / 1e3, h.Percentile(0.99) / 1e3, h.mean_ns() / 1e3);
}

int Run() {
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  const int requests = smoke ? 60 : absl::GetFlag(FLAGS_requests);
  const int warmup = std::max(1, smoke ? 5 : absl::GetFlag(FLAGS_warmup));
  const int block = std::max(1, smoke ? 10 : absl::GetFlag(FLAGS_block));
  const int throughput_requests = smoke ? 40 : absl::GetFlag(FLAGS_throughput_requests);
  std::vector<uint32_t> worker_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
    uint32_t n = 0;
    Check(absl::SimpleAtoi(s, &n) && n >= 1 && n <= 256, "--workers: counts 1..256");
    worker_counts.push_back(n);
  }
  const uint32_t max_workers = *std::max_element(worker_counts.begin(), worker_counts.end());
  const ModelSpec spec = BenchSpec(absl::GetFlag(FLAGS_page_kib));
  CheckOk(spec.Validate(), "--page_kib");
  const Shape shape{.page_tokens = spec.page_size_tokens,
                    .prompt_pages = static_cast<uint32_t>(absl::GetFlag(FLAGS_prompt_pages)),
                    .cached_pages = static_cast<uint32_t>(absl::GetFlag(FLAGS_cached_pages))};
  Check(shape.cached_pages < shape.prompt_pages, "--cached_pages must be < --prompt_pages");

  std::printf("kvcm_worker_path_bench%s: %s\n", smoke ? " --smoke" : "", MachineSummary().c_str());
  std::printf("  prompt %u pages (%u cached, %u new) of %u tokens, %llu bytes per page\n",
              shape.prompt_pages, shape.cached_pages, shape.new_pages(), shape.page_tokens,
              static_cast<unsigned long long>(spec.BytesPerPage()));

  ServerOptions mo;
  mo.tls.insecure = true;
  mo.listen_address = "127.0.0.1:0";
  mo.metrics_address = "";
  mo.shutdown_grace_ms = 100;
  mo.hash_secret_hex = "6b76636d2d62656e63682d7365637265";
  mo.default_pool_capacity_bytes = ~uint64_t{0} / 2;  // the index-only pool never evicts
  if (!absl::GetFlag(FLAGS_policy).empty()) mo.policy = absl::GetFlag(FLAGS_policy);
  std::unique_ptr<ManagerServer> manager = OrDie(ManagerServer::Start(mo), "ManagerServer::Start");

  // Every block the run commits, and then some: the agent's pool never evicts.
  // A request commits its new pages' blocks; a worker's first also its prefix's.
  const uint64_t requests_total = static_cast<uint64_t>(requests) +
                                  throughput_requests * worker_counts.size() +
                                  static_cast<uint64_t>(warmup) * max_workers;
  const uint64_t blocks =
      absl::GetFlag(FLAGS_pool_blocks) > 0
          ? static_cast<uint64_t>(absl::GetFlag(FLAGS_pool_blocks))
          : requests_total * shape.new_pages() + max_workers * shape.prompt_pages + 64;
  AgentOptions ao;
  ao.tls.insecure = true;
  ao.agent_id = kAgentId;
  ao.manager_address = manager->address();
  ao.use_device = false;
  ao.model = "";
  ao.spec = spec;
  ao.capacity_bytes = blocks * spec.BytesPerPage();
  ao.heartbeat_interval_ms = 100;
  ao.max_blocks_per_call = std::max<uint32_t>(64, shape.prompt_pages);
  ao.local_socket = absl::StrCat("/tmp/kvcm_worker_path_bench.", getpid(), ".sock");
  std::unique_ptr<Agent> agent = OrDie(Agent::Start(ao), "Agent::Start");
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!agent->registered() || manager->commands().open_streams() != 1) {
    Check(absl::Now() < give_up, "the agent did not register and open its Commands stream");
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::printf("  agent %s: %s, %llu blocks, local path %s\n", kAgentId,
              agent->backend_reason().c_str(), static_cast<unsigned long long>(blocks),
              ao.local_socket.c_str());

  if (absl::GetFlag(FLAGS_reuse_blocks)) {
    auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
    for (uint64_t done = 0; done < blocks;) {
      v1::AllocateBlocksRequest req;
      req.set_count(
          static_cast<uint32_t>(std::min<uint64_t>(blocks - done, ao.max_blocks_per_call)));
      req.set_owner_epoch(agent->epoch());
      NamespaceToProto(kAgentNs, req.mutable_namespace_());
      v1::AllocateBlocksResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = stub->Allocate(&ctx, req, &resp);
      Check(s.ok(), absl::StrCat("Allocate: ", s.error_message()));
      v1::FreeBlocksRequest free;
      *free.mutable_block_ids() = resp.block_ids();
      *free.mutable_block_generations() = resp.block_generations();
      free.set_owner_epoch(agent->epoch());
      v1::FreeBlocksResponse freed;
      grpc::ClientContext free_ctx;
      s = stub->Free(&free_ctx, free, &freed);
      Check(s.ok(), absl::StrCat("Free: ", s.error_message()));
      done += resp.block_ids_size();
    }
  }

  std::vector<std::unique_ptr<Worker>> workers;
  for (uint32_t w = 0; w < max_workers; ++w) {
    workers.push_back(Worker::Create(w, shape, spec, manager->address(), *agent));
  }
  // A pool that fills may evict a worker's prefix (the request then recomputes it): the
  // prefix is checked cached only in a pool that holds everything.
  const bool prefix_stays = absl::GetFlag(FLAGS_pool_blocks) == 0;
  // Each worker's prompt counter: every request is a prompt never seen before.
  std::vector<uint32_t> next(max_workers, 0);
  int64_t times[kStages];
  for (uint32_t w = 0; w < max_workers; ++w) {
    for (int i = 0; i < warmup; ++i) {
      workers[w]->Request(next[w], /*expect_cached=*/prefix_stays && i > 0, times);
      workers[w]->IndexOnlyInsert(next[w]++);
    }
  }

  // Latency: worker 0, a request and an index-only insert of the same shape, in rotated
  // order every `block` requests.
  std::vector<LatencyHistogram> stage(kStages);
  LatencyHistogram index_only;
  for (LatencyHistogram& h : stage) h.Reserve(requests);
  index_only.Reserve(requests);
  const double cpu_start = ProcessCpuSeconds();
  for (int i = 0; i < requests; ++i) {
    const bool index_first = (i / block) % 2 == 1;
    const uint32_t n = next[0]++;
    if (index_first) index_only.Add(workers[0]->IndexOnlyInsert(n));
    workers[0]->Request(n, prefix_stays, times);
    for (int s = 0; s < kStages; ++s) stage[s].Add(std::chrono::nanoseconds(times[s]));
    if (!index_first) index_only.Add(workers[0]->IndexOnlyInsert(n));
  }
  const double cpu_per_request_us = (ProcessCpuSeconds() - cpu_start) / requests * 1e6;

  std::printf("\nlatency, one worker (us; request = the five stages, client wall time)\n");
  std::printf("  %-18s %7s %9s %9s %9s %9s\n", "stage", "calls", "p50", "p90", "p99", "mean");
  for (int s = 0; s < kStages; ++s) PrintRow(kStageNames[s], stage[s]);
  PrintRow("index-only insert", index_only);
  const double ratio50 = stage[kInsert].Percentile(0.5) / index_only.Percentile(0.5);
  const double ratio99 = stage[kInsert].Percentile(0.99) / index_only.Percentile(0.99);
  std::printf(
      "  insert with commit / index-only insert: p50 %.2fx, p99 %.2fx (target p50 <= 1.5x)\n",
      ratio50, ratio99);
  std::printf("  process CPU per request + index-only insert: %.0f us\n", cpu_per_request_us);

  // Throughput: N workers on N threads, whole requests, then index-only inserts alone.
  std::printf("\nthroughput, N workers on N threads (latencies in us)\n");
  std::printf("  %-7s %8s %8s %9s %9s %9s %9s %9s %11s %9s\n", "workers", "requests", "req/s",
              "cpu/req", "req p50", "req p99", "ins p50", "ins p99", "idx-ins/s", "idx p50");
  for (uint32_t n_workers : worker_counts) {
    const int per_worker = std::max(1, throughput_requests / static_cast<int>(n_workers));
    const int total = per_worker * static_cast<int>(n_workers);
    // Runs body(w) per_worker times on each of n_workers threads; the wall time, seconds.
    auto run_threads = [&](const std::function<void(uint32_t w)>& body) {
      std::atomic<uint32_t> ready{0};
      std::atomic<bool> go{false};
      std::vector<std::thread> threads;
      for (uint32_t w = 0; w < n_workers; ++w) {
        threads.emplace_back([&, w] {
          ready.fetch_add(1);
          while (!go.load()) std::this_thread::yield();
          for (int i = 0; i < per_worker; ++i) body(w);
        });
      }
      while (ready.load() != n_workers) std::this_thread::yield();
      const auto start = SteadyClock::now();
      go.store(true);
      for (std::thread& t : threads) t.join();
      return std::chrono::duration<double>(SteadyClock::now() - start).count();
    };
    // Per worker, its samples (ns): whole requests, their inserts, index-only inserts.
    std::vector<std::vector<int64_t>> req(n_workers), ins(n_workers), idx(n_workers);
    const double cpu_before = ProcessCpuSeconds();
    const double req_seconds = run_threads([&](uint32_t w) {
      int64_t t[kStages];
      workers[w]->Request(next[w]++, prefix_stays, t);
      req[w].push_back(t[kRequest]);
      ins[w].push_back(t[kInsert]);
    });
    const double req_cpu_us = (ProcessCpuSeconds() - cpu_before) / total * 1e6;
    const double idx_seconds = run_threads([&](uint32_t w) {
      idx[w].push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           workers[w]->IndexOnlyInsert(next[w]++))
                           .count());
    });
    auto merged = [](const std::vector<std::vector<int64_t>>& per_worker_ns) {
      LatencyHistogram h;
      for (const std::vector<int64_t>& v : per_worker_ns) {
        for (int64_t ns : v) h.Add(std::chrono::nanoseconds(ns));
      }
      return h;
    };
    LatencyHistogram req_h = merged(req), ins_h = merged(ins), idx_h = merged(idx);
    std::printf("  %-7u %8d %8.0f %9.0f %9.1f %9.1f %9.1f %9.1f %11.0f %9.1f\n", n_workers, total,
                total / req_seconds, req_cpu_us, req_h.Percentile(0.5) / 1e3,
                req_h.Percentile(0.99) / 1e3, ins_h.Percentile(0.5) / 1e3,
                ins_h.Percentile(0.99) / 1e3, total / idx_seconds, idx_h.Percentile(0.5) / 1e3);
  }
  std::printf("\nafter: %s\n", MachineSummary().c_str());

  workers.clear();
  agent->Shutdown();
  manager->Shutdown();
  unlink(ao.local_socket.c_str());
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::ParseProgramFlags(argc, argv,
                          {.name = "kvcm_worker_path_bench",
                           .usage = "kvcm_worker_path_bench [--option=value ...]: an inference "
                                    "worker's whole request against a real manager and agent",
                           .flag_files = {"bench/worker_path_bench.cc"}});
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  return kvcm::bench::Run();
}
