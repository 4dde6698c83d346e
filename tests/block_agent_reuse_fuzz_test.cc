// Two tenants' workers interleave BlockAgent calls and streams over a small pool whose blocks
// are freed and reallocated all the time (real gRPC, a tokens file, an in-process service):
// Allocate, Free, WriteBlocks streams advanced one chunk at a time, ReadBlocks streams read
// one chunk at a time, all interleaved at random, so streams outlive the allocations they
// were opened on. Every chunk written is a pattern of 8-byte words naming the write; after
// every step:
//   - no byte any stream or read returned was written by the other tenant (every word is 0,
//     the scrub, or a write of the reader's own tenant);
//   - every block of a live allocation whose last write finished holds exactly that write;
//   - a stream over a block freed (and maybe reallocated) since it opened ends ABORTED (or
//     FAILED_PRECONDITION at its header), never OK past the Free.
// KVCM_FUZZ_SEED=<n> picks the seed, KVCM_FUZZ_STEPS=<n> the steps.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/authenticator.h"
#include "common/credentials.h"
#include "common/token_table.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

constexpr uint32_t kBlocks = 6;
constexpr char kTokens[2][32] = {"acme-worker-token-5d1c0f", "evil-worker-token-88a2e1"};
const NamespaceId kNs[2] = {{"acme", "meta/small-gqa"}, {"evil", "meta/small-gqa"}};
constexpr uint64_t kOwner = 9;

struct Alloc {
  BlockId id;
  uint64_t gen;
  uint64_t written = 0;  // the write id whose stream finished OK last (0: none)
};

struct WriteStream {
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  v1::WriteBlocksResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> writer;
  std::vector<Alloc> blocks;  // as they were when the stream opened
  uint64_t write_id = 0;
  uint64_t sent = 0;
  bool open = true;
};

struct ReadStream {
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> reader;
  std::vector<Alloc> blocks;
  uint64_t got = 0;
};

class ReuseFuzzer {
 public:
  ReuseFuzzer(v1::BlockAgent::Stub* stubs[2], uint64_t bpb, uint32_t seed)
      : stubs_{stubs[0], stubs[1]}, bpb_(bpb), rng_(seed) {}

  void Step() {
    const int t = Uniform(0, 1);
    switch (Uniform(0, 7)) {
      case 0:
        Allocate(t);
        break;
      case 1:
        Free(t);
        break;
      case 2:
        OpenWrite(t);
        break;
      case 3:
      case 4:
        AdvanceWrite(t);
        break;
      case 5:
        OpenRead(t);
        break;
      default:
        AdvanceRead(t);
        break;
    }
    CheckAll();
  }

  void Drain() {
    for (int t = 0; t < 2; ++t) {
      while (!writes_[t].empty()) AdvanceWrite(t, /*to_end=*/true);
      while (!reads_[t].empty()) AdvanceRead(t, /*to_end=*/true);
    }
    CheckAll();
  }

  int aborted() const { return aborted_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  bool Live(int t, const Alloc& a) const {
    for (const Alloc& h : held_[t]) {
      if (h.id == a.id && h.gen == a.gen) return true;
    }
    return false;
  }

  // Every word of `data` (starting at a block boundary of tenant t's stream) is 0 or a
  // write of tenant t.
  void CheckWords(int t, const std::string& data, const char* what) {
    for (size_t i = 0; i + 8 <= data.size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, data.data() + i, 8);
      if (w == 0) continue;
      auto it = writer_of_.find(w);
      ASSERT_TRUE(it != writer_of_.end()) << what << ": word " << w << " is no write's";
      ASSERT_EQ(it->second, t) << what << ": tenant " << t << " got bytes of tenant " << it->second
                               << " (write " << w << ")";
    }
  }

  std::vector<Alloc> Pick(int t) {
    std::vector<Alloc> out;
    if (held_[t].empty()) return out;
    const int n = Uniform(1, std::min<int>(3, held_[t].size()));
    std::vector<Alloc> pool = held_[t];
    std::shuffle(pool.begin(), pool.end(), rng_);
    out.assign(pool.begin(), pool.begin() + n);
    return out;
  }

  void Allocate(int t) {
    std::vector<BlockId> ids;
    std::vector<uint64_t> gens;
    const grpc::Status s =
        testing::AllocateTo(*stubs_[t], Uniform(1, 2), kOwner, kNs[t], &ids, &gens);
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return;
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (size_t i = 0; i < ids.size(); ++i) held_[t].push_back({ids[i], gens[i]});
  }

  void Free(int t) {
    if (held_[t].empty()) return;
    const size_t k = Uniform(0, held_[t].size() - 1);
    const Alloc a = held_[t][k];
    const grpc::Status s = testing::FreeAsWorker(*stubs_[t], {&a.id, 1}, kOwner, {&a.gen, 1});
    ASSERT_TRUE(s.ok()) << s.error_message();
    held_[t].erase(held_[t].begin() + k);
  }

  void OpenWrite(int t) {
    std::vector<Alloc> blocks = Pick(t);
    if (blocks.empty()) return;
    auto w = std::make_unique<WriteStream>();
    w->blocks = blocks;
    w->write_id = next_write_++;
    writer_of_[w->write_id] = t;
    w->writer = stubs_[t]->WriteBlocks(w->ctx.get(), &w->resp);
    v1::WriteBlocksRequest header;
    for (const Alloc& a : blocks) {
      header.mutable_header()->add_block_ids(a.id);
      header.mutable_header()->add_block_generations(a.gen);
    }
    header.mutable_header()->set_owner_epoch(kOwner);
    w->open = w->writer->Write(header);
    writes_[t].push_back(std::move(w));
  }

  void AdvanceWrite(int t, bool to_end = false) {
    if (writes_[t].empty()) return;
    const size_t k = to_end ? 0 : Uniform(0, writes_[t].size() - 1);
    WriteStream& w = *writes_[t][k];
    const uint64_t total = w.blocks.size() * bpb_;
    do {
      if (w.open && w.sent < total) {
        const uint64_t n = std::min<uint64_t>(total - w.sent, 8 * Uniform(1, 128));
        std::string data(n, '\0');
        for (uint64_t i = 0; i < n; i += 8) std::memcpy(data.data() + i, &w.write_id, 8);
        v1::WriteBlocksRequest chunk;
        chunk.set_data(std::move(data));
        w.open = w.writer->Write(chunk);
        w.sent += n;
      }
    } while (to_end && w.open && w.sent < total);
    if (w.open && w.sent < total) return;
    w.writer->WritesDone();
    const grpc::Status s = w.writer->Finish();
    bool all_live = true;
    for (const Alloc& a : w.blocks) all_live = all_live && Live(t, a);
    if (s.ok()) {
      // OK only if every block was still its allocation at every chunk: it still is, or
      // it was freed after its last chunk.
      for (Alloc& h : held_[t]) {
        for (const Alloc& a : w.blocks) {
          if (h.id == a.id && h.gen == a.gen) h.written = w.write_id;
        }
      }
    } else {
      ASSERT_TRUE(s.error_code() == grpc::StatusCode::ABORTED ||
                  s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
          << s.error_message();
      ASSERT_FALSE(all_live) << "a write over live blocks failed: " << s.error_message();
      ++aborted_;
      // Blocks of the stream still live may hold part of it.
      for (Alloc& h : held_[t]) {
        for (const Alloc& a : w.blocks) {
          if (h.id == a.id && h.gen == a.gen) h.written = kPartial;
        }
      }
    }
    writes_[t].erase(writes_[t].begin() + k);
  }

  void OpenRead(int t) {
    std::vector<Alloc> blocks = Pick(t);
    if (blocks.empty()) return;
    auto r = std::make_unique<ReadStream>();
    r->blocks = blocks;
    v1::ReadBlocksRequest req;
    for (const Alloc& a : blocks) {
      req.add_block_ids(a.id);
      req.add_block_generations(a.gen);
    }
    req.set_owner_epoch(kOwner);
    r->reader = stubs_[t]->ReadBlocks(r->ctx.get(), req);
    reads_[t].push_back(std::move(r));
  }

  void AdvanceRead(int t, bool to_end = false) {
    if (reads_[t].empty()) return;
    const size_t k = to_end ? 0 : Uniform(0, reads_[t].size() - 1);
    ReadStream& r = *reads_[t][k];
    v1::ReadBlocksResponse msg;
    bool more;
    do {
      more = r.reader->Read(&msg);
      if (more) {
        ASSERT_NO_FATAL_FAILURE(CheckWords(t, msg.data(), "ReadBlocks chunk"));
        r.got += msg.data().size();
      }
    } while (to_end && more);
    if (more) return;
    const grpc::Status s = r.reader->Finish();
    if (!s.ok()) {
      ASSERT_TRUE(s.error_code() == grpc::StatusCode::ABORTED ||
                  s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
          << s.error_message();
      bool all_live = true;
      for (const Alloc& a : r.blocks) all_live = all_live && Live(t, a);
      ASSERT_FALSE(all_live) << "a read over live blocks failed: " << s.error_message();
      ++aborted_;
    } else {
      EXPECT_EQ(r.got, r.blocks.size() * bpb_);
    }
    reads_[t].erase(reads_[t].begin() + k);
  }

  // Every live block of both tenants, read by its tenant: only its own tenant's words, and
  // exactly its last finished write when no write stream is open on it.
  void CheckAll() {
    if (::testing::Test::HasFatalFailure()) return;
    for (int t = 0; t < 2; ++t) {
      for (const Alloc& a : held_[t]) {
        absl::StatusOr<std::string> got =
            testing::ReadAll(*stubs_[t], {&a.id, 1}, kOwner, v1::TIER_UNSPECIFIED, {&a.gen, 1});
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_NO_FATAL_FAILURE(CheckWords(t, *got, "a live block"));
        if (a.written == 0 || a.written == kPartial || Writing(t, a)) continue;
        std::string want(bpb_, '\0');
        for (uint64_t i = 0; i < bpb_; i += 8) std::memcpy(want.data() + i, &a.written, 8);
        ASSERT_EQ(*got, want) << "block " << a.id << " lost write " << a.written;
      }
    }
  }

  bool Writing(int t, const Alloc& a) const {
    for (const auto& w : writes_[t]) {
      for (const Alloc& b : w->blocks) {
        if (b.id == a.id && b.gen == a.gen) return true;
      }
    }
    return false;
  }

  static constexpr uint64_t kPartial = ~uint64_t{0};
  v1::BlockAgent::Stub* stubs_[2];
  const uint64_t bpb_;
  std::mt19937 rng_;
  std::vector<Alloc> held_[2];
  std::vector<std::unique_ptr<WriteStream>> writes_[2];
  std::vector<std::unique_ptr<ReadStream>> reads_[2];
  std::map<uint64_t, int> writer_of_;  // write id -> tenant
  uint64_t next_write_ = 1;
  int aborted_ = 0;
};

uint32_t EnvOr(const char* name, uint32_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? static_cast<uint32_t>(std::strtoul(v, nullptr, 10)) : fallback;
}

TEST(BlockAgentReuseFuzzTest, InterleavedStreamsOfTwoTenantsNeverSeeEachOthersBytes) {
  const std::string tokens_path =
      absl::StrCat(::testing::TempDir(), "/kvcm_reuse_tokens_", getpid());
  {
    std::FILE* f = std::fopen(tokens_path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(absl::StrCat(Sha256Hex(kTokens[0]), " acme-vllm roles=worker tenant=acme\n",
                            Sha256Hex(kTokens[1]), " evil-vllm roles=worker tenant=evil\n")
                   .c_str(),
               f);
    std::fclose(f);
  }
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::FromFile(tokens_path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  AgentOptions options;
  options.max_message_bytes = 1024;
  options.read_chunk_bytes = 256;
  options.max_blocks_per_call = 4;
  options.max_streams_per_principal = 256;
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), kBlocks);
  AgentEpoch epoch;
  AgentMetrics metrics{"agent-1", AgentPools{.main = pool.get()}, &epoch};
  BlockAgentService service{&options,
                            AgentPools{.main = pool.get()},
                            &epoch,
                            &metrics,
                            /*fetcher=*/nullptr,
                            auth->get()};
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<v1::BlockAgent::Stub> owned[2];
  v1::BlockAgent::Stub* stubs[2];
  for (int t = 0; t < 2; ++t) {
    absl::StatusOr<ChannelFactory> f =
        ChannelFactory::Create(TlsOptions{.insecure = true}, kTokens[t]);
    ASSERT_TRUE(f.ok());
    owned[t] = v1::BlockAgent::NewStub(f->Open(absl::StrCat("127.0.0.1:", port)));
    stubs[t] = owned[t].get();
  }
  const uint32_t seed = EnvOr("KVCM_FUZZ_SEED", 20261127);
  const uint32_t steps = EnvOr("KVCM_FUZZ_STEPS", 1500);
  std::cout << "KVCM_FUZZ_SEED=" << seed << " KVCM_FUZZ_STEPS=" << steps << "\n";
  ReuseFuzzer fuzz(stubs, pool->geometry().bytes_per_block(), seed);
  for (uint32_t i = 0; i < steps && !::testing::Test::HasFatalFailure(); ++i) {
    SCOPED_TRACE(absl::StrCat("KVCM_FUZZ_SEED=", seed, " step ", i));
    fuzz.Step();
  }
  if (!::testing::Test::HasFatalFailure()) fuzz.Drain();
  std::cout << fuzz.aborted() << " streams ended by a block's allocation ending\n";
  EXPECT_GT(fuzz.aborted(), 0) << "no stream outlived its blocks: the test tested nothing";
  server->Shutdown();
  std::remove(tokens_path.c_str());
}

}  // namespace
}  // namespace kvcm
