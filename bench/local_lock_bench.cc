// How long the local data path holds a pool's lock, seen by another tenant: the latency of a
// victim's ReadBlocks of one block over gRPC (BlockAgentService on loopback) while a neighbour
// LOADs batches of 64 blocks into its memfd region over the local socket (LocalSocketServer),
// all on one in-process host pool. Phases, in one run: the victim alone; beside the
// neighbour's LOADs with local_copy_chunk_bytes over a whole call (one critical section per
// LOAD, as before issue 35); beside them in chunks of 1 MiB (the default); and beside the
// same volume read by the neighbour over gRPC ReadBlocks instead.
//   kvcm_local_lock_bench [--smoke]
// Full: deepseek-v3's blocks (bf16, 64-token pages: 61 layers x 72 KiB = 4.3 MiB); smoke: 2
// layers of 16 KiB, a few reads, to keep the code path alive.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/or_die.h"
#include "bench/smoke_flag.h"
#include "common/authenticator.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "gpu/agent/local/local_client.h"
#include "gpu/agent/local/local_socket_server.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"

namespace kvcm::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kOwner = 1;
constexpr uint32_t kBatch = 64;  // the neighbour's blocks per LOAD (max_blocks_per_call)
constexpr uint32_t kVictim = 8;  // the victim's blocks, read one per call

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Latencies {
  double p50 = 0, p99 = 0, max = 0;
  int n = 0;
};

Latencies Summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  Latencies l;
  l.n = static_cast<int>(ms.size());
  if (ms.empty()) return l;
  l.p50 = ms[ms.size() / 2];
  l.p99 = ms[std::min(ms.size() - 1, ms.size() * 99 / 100)];
  l.max = ms.back();
  return l;
}

void Run(const ModelSpec& spec, int reads) {
  const PoolGeometry g{spec, kBatch + kVictim};
  CheckOk(g.Validate(), "geometry");
  const uint64_t bpb = g.bytes_per_block();
  std::unique_ptr<BlockPool> pool =
      OrDie(BlockPool::Create(g, OrDie(CreateHostBackend(g.pool_bytes()), "backend")), "pool");
  std::memset(pool->backend().base(), 0x5A, g.pool_bytes());
  const NamespaceId neighbour_ns{"neighbour", "m"}, victim_ns{"victim", "m"};
  std::vector<uint64_t> ngens, vgens;
  const std::vector<BlockId> nids =
      OrDie(pool->Allocate(kBatch, kOwner, &neighbour_ns, &ngens), "allocate");
  const std::vector<BlockId> vids =
      OrDie(pool->Allocate(kVictim, kOwner, &victim_ns, &vgens), "allocate");

  AgentOptions options;
  options.max_blocks_per_call = kBatch;
  AgentEpoch epoch;
  AgentMetrics metrics("bench", AgentPools{.main = pool.get()}, &epoch);
  std::unique_ptr<Authenticator> open = Authenticator::Open();
  BlockAgentService service(&options, AgentPools{.main = pool.get()}, &epoch, &metrics,
                            /*fetcher=*/nullptr, open.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  if (grpc_server == nullptr) {
    std::fprintf(stderr, "cannot serve BlockAgent\n");
    std::exit(1);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  // Separate channels: the neighbour's gRPC reads do not queue the victim's on one connection.
  auto victim_stub = v1::BlockAgent::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  args.SetInt("kvcm.bench.channel", 2);
  auto neighbour_stub = v1::BlockAgent::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  auto read_blocks = [&](v1::BlockAgent::Stub& stub, const std::vector<BlockId>& ids) {
    v1::ReadBlocksRequest req;
    req.mutable_block_ids()->Add(ids.begin(), ids.end());
    req.set_owner_epoch(kOwner);
    grpc::ClientContext ctx;
    auto reader = stub.ReadBlocks(&ctx, req);
    v1::ReadBlocksResponse chunk;
    uint64_t got = 0;
    while (reader->Read(&chunk)) got += chunk.data().size();
    CheckOk(reader->Finish().ok() && got == ids.size() * bpb ? absl::OkStatus()
                                                             : absl::InternalError("ReadBlocks"),
            "ReadBlocks");
  };

  const std::string path = absl::StrCat("/tmp/kvcm_local_lock_bench_", getpid(), ".sock");
  std::unique_ptr<LocalSocketServer> local =
      OrDie(LocalSocketServer::Start({.path = path},
                                     LocalSessionEnv{.options = &options,
                                                     .pools = AgentPools{.main = pool.get()},
                                                     .epoch = &epoch,
                                                     .authenticator = open.get(),
                                                     .metrics = &metrics}),
            "local socket");
  // The neighbour's region: per layer a [kBatch, segment] tensor, as a vLLM CPU engine's.
  const uint32_t layers = spec.num_layers;
  const uint64_t segment = bpb / layers;
  std::unique_ptr<MemfdRegion> region = OrDie(MemfdRegion::Create(kBatch * bpb), "memfd");
  std::unique_ptr<LocalClient> client = OrDie(LocalClient::Connect(path), "connect");
  v1::LocalRequest hello;
  v1::LocalHello* h = hello.mutable_hello();
  h->set_region_bytes(kBatch * bpb);
  for (uint32_t l = 0; l < layers; ++l) h->add_segment_offsets(uint64_t{l} * kBatch * segment);
  h->set_segment_bytes(segment);
  h->set_segment_stride(segment);
  h->set_num_engine_blocks(kBatch);
  const int fd = region->fd();
  CheckOk(LocalReplyStatus(OrDie(client->Call(hello, {&fd, 1}), "hello")), "hello");
  v1::LocalRequest load;
  load.mutable_copy()->set_direction(v1::LOCAL_DIRECTION_LOAD);
  load.mutable_copy()->set_owner_epoch(kOwner);
  for (uint32_t i = 0; i < kBatch; ++i) {
    load.mutable_copy()->add_block_ids(nids[i]);
    load.mutable_copy()->add_engine_blocks(i);
  }

  enum class Neighbour { kNone, kLocalLoad, kGrpcRead };
  struct Phase {
    const char* name;
    Neighbour neighbour;
    uint64_t chunk_bytes;
  };
  const Phase phases[] = {
      {"victim alone", Neighbour::kNone, 1 << 20},
      {"+ 64-block LOADs, whole call per lock hold", Neighbour::kLocalLoad, kBatch * bpb},
      {"+ 64-block LOADs, 1 MiB chunks (default)", Neighbour::kLocalLoad, 1 << 20},
      {"+ 64-block ReadBlocks over gRPC", Neighbour::kGrpcRead, 1 << 20},
  };
  std::printf("blocks of %llu bytes (%u segments of %llu); victim: ReadBlocks of 1 block x %d\n",
              static_cast<unsigned long long>(bpb), layers,
              static_cast<unsigned long long>(segment), reads);
  std::fflush(stdout);
  std::printf("%-46s %9s %9s %9s %12s %12s\n", "phase", "p50 ms", "p99 ms", "max ms", "nbr calls",
              "nbr ms/call");
  for (const Phase& p : phases) {
    options.local_copy_chunk_bytes = p.chunk_bytes;  // no copy runs between phases
    std::atomic<bool> stop{false};
    std::vector<double> neighbour_ms;
    std::thread neighbour([&] {
      while (p.neighbour != Neighbour::kNone && !stop.load()) {
        const Clock::time_point start = Clock::now();
        if (p.neighbour == Neighbour::kLocalLoad) {
          CheckOk(LocalReplyStatus(OrDie(client->Call(load), "load")), "load");
        } else {
          read_blocks(*neighbour_stub, nids);
        }
        neighbour_ms.push_back(Ms(Clock::now() - start));
      }
    });
    std::vector<double> victim_ms;
    for (int i = 0; i < reads; ++i) {
      const Clock::time_point start = Clock::now();
      read_blocks(*victim_stub, {vids[i % kVictim]});
      victim_ms.push_back(Ms(Clock::now() - start));
    }
    stop = true;
    neighbour.join();
    const Latencies v = Summarize(victim_ms);
    const Latencies nb = Summarize(neighbour_ms);
    std::printf("%-46s %9.1f %9.1f %9.1f %12d %12.1f\n", p.name, v.p50, v.p99, v.max, nb.n, nb.p50);
  }
  client.reset();
  local.reset();
  grpc_server->Shutdown();
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::HandleHelpAndVersion(
      argc, argv, "kvcm_local_lock_bench",
      "kvcm_local_lock_bench [--smoke]: a victim's ReadBlocks latency beside local LOADs");
  const bool smoke = kvcm::bench::SmokeFlagOnly(argc, argv, "kvcm_local_lock_bench [--smoke]");
  const kvcm::ModelSpec spec = kvcm::bench::DeepSeekV3OrSmokeSpec(smoke);
  std::printf("kvcm_local_lock_bench%s\n", smoke ? " --smoke" : "");
  kvcm::bench::Run(spec, smoke ? 20 : 300);
  return 0;
}
