// Randomized BlockAgent calls over real gRPC against an in-process Agent (host backend, a
// small MLA bf16 pool, limits small enough to reach), checked against a model of the pools:
// Allocate / Free / WriteBlocks / ReadBlocks / RunAttention with random, often bad, input
// (empty, repeated, foreign and out-of-range ids, wrong owners, missing or repeated headers,
// empty and oversized chunks, short and long streams, cancelled streams, bad tiers, bad
// attention shapes). After every call:
//   - the status code is one the RPC documents for what was wrong with the call (OK when
//     nothing was), and an INVALID_ARGUMENT / OUT_OF_RANGE message names a field;
//   - Stats (used_bytes, free_blocks, the host pool's) equals the model, so an error
//     changed nothing;
//   - Allocate returned distinct ids that were free, ReadBlocks the bytes last written,
//     RunAttention what MlaDecodeCpu computes over the model's bytes;
// and every 64 calls, and at the end, every written block reads back as the model says.
// Runs once for an agent without a host pool and once with one (filled in-process: only
// the manager's demotions allocate there). 60% of the calls carry random faults, the rest
// are well-formed (so that blocks get written and read). A message that gRPC refuses as too
// large after the blocks' last byte is also tested on its own
// (WriteRefusedByGrpcAfterItsLastByteChangesNothing).
//
// KVCM_FUZZ_SEED=<n> picks the seed (printed; a failure names the seed and the step) and
// KVCM_FUZZ_STEPS=<n> the calls per configuration.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/credentials.h"
#include "gpu/agent/server/agent.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/agent_pools.h"
#include "tests/util/agent_rpc.h"

namespace kvcm {
namespace {

using ::kvcm::testing::StatsOf;
using Codes = std::set<grpc::StatusCode>;

// The pool: MLA bf16 latents (kv_lora_rank 512 + rope 64 = 1,152 B per token per layer),
// 2 layers, 4-token pages: 9,216 B blocks.
constexpr uint32_t kLayers = 2;
constexpr uint32_t kPageTokens = 4;
constexpr uint32_t kRank = 512;
constexpr uint32_t kHeadDim = 576;
constexpr uint64_t kTokenBytes = kHeadDim * 2;
constexpr uint64_t kBlockBytes = kTokenBytes * kLayers * kPageTokens;
constexpr uint32_t kBlocks = 12;
constexpr uint32_t kHostBlocks = 4;
// Agent limits, small so that calls reach them.
constexpr uint32_t kMaxBlocksPerCall = 5;
constexpr uint64_t kMaxMessageBytes = 16 << 10;
constexpr uint64_t kReadChunkBytes = 5'000;

// Owners that allocate; any other non-zero epoch owns nothing.
constexpr uint64_t kOwners[] = {3, 7, 11};

constexpr int kSweepEvery = 64;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

std::string CodesToString(const Codes& codes) {
  if (codes.empty()) return "OK";
  return absl::StrJoin(codes, ", ", [](std::string* out, grpc::StatusCode c) {
    absl::StrAppend(out, static_cast<int>(c));
  });
}

bool HasDuplicate(std::span<const BlockId> ids) {
  std::vector<BlockId> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
}

// What a pool must hold: each block's owner (0 = free) and, once written while allocated,
// its bytes (`known`); a block's bytes are unknown again once it is freed.
struct PoolModel {
  explicit PoolModel(uint32_t blocks)
      : owner(blocks, 0), known(blocks, false), bytes(blocks * kBlockBytes, '\0') {}

  uint64_t free_blocks() const { return std::count(owner.begin(), owner.end(), 0); }
  uint64_t used_bytes() const { return (owner.size() - free_blocks()) * kBlockBytes; }
  absl::string_view block(BlockId id) const {
    return absl::string_view(bytes).substr(id * kBlockBytes, kBlockBytes);
  }
  std::vector<BlockId> OwnedBy(uint64_t epoch) const {
    std::vector<BlockId> out;
    for (BlockId id = 0; id < owner.size(); ++id) {
      if (owner[id] == epoch && epoch != 0) out.push_back(id);
    }
    return out;
  }
  std::set<uint64_t> Owners() const {
    std::set<uint64_t> out(owner.begin(), owner.end());
    out.erase(0);
    return out;
  }
  void Write(std::span<const BlockId> ids, absl::string_view data) {
    for (size_t i = 0; i < ids.size(); ++i) {
      std::memcpy(bytes.data() + ids[i] * kBlockBytes, data.data() + i * kBlockBytes, kBlockBytes);
      known[ids[i]] = true;
    }
  }

  std::vector<uint64_t> owner;
  std::vector<bool> known;
  std::string bytes;  // [blocks, kBlockBytes]
};

// The codes BlockPool::CheckOwned may answer for `ids` and `owner`; empty when it passes.
Codes OwnershipErrors(const PoolModel& m, std::span<const BlockId> ids, uint64_t owner) {
  Codes c;
  if (ids.empty() || owner == 0 || HasDuplicate(ids)) c.insert(grpc::INVALID_ARGUMENT);
  for (BlockId id : ids) {
    if (id >= m.owner.size()) {
      c.insert(grpc::INVALID_ARGUMENT);
    } else if (m.owner[id] != owner) {
      c.insert(grpc::FAILED_PRECONDITION);
    }
  }
  return c;
}

std::unique_ptr<Agent> StartAgent(bool with_host_pool) {
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "fuzz";
  o.manager_address = "127.0.0.1:1";  // unreachable; BlockAgent does not need the manager
  o.use_device = false;
  o.model = "";
  o.spec.attention = AttentionKind::kMla;
  o.spec.num_layers = kLayers;
  o.spec.num_heads = 16;
  o.spec.kv_lora_rank = kRank;
  o.spec.rope_dim = kHeadDim - kRank;
  o.spec.dtype = KvDtype::kBf16;
  o.spec.page_size_tokens = kPageTokens;
  o.page_size_tokens = kPageTokens;
  o.capacity_bytes = kBlocks * kBlockBytes + kBlockBytes / 2;
  o.host_capacity_bytes = with_host_pool ? kHostBlocks * kBlockBytes : 0;
  o.heartbeat_interval_ms = 60'000;
  o.max_blocks_per_call = kMaxBlocksPerCall;
  o.max_message_bytes = kMaxMessageBytes;
  o.read_chunk_bytes = kReadChunkBytes;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? *std::move(agent) : nullptr;
}

// Drives one agent with random calls and checks each against the model. Not thread-safe.
class BlockAgentFuzzer {
 public:
  BlockAgentFuzzer(Agent* agent, uint64_t seed)
      : agent_(agent),
        stub_(v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()))),
        rng_(seed),
        main_(kBlocks) {
    if (agent_->host_pool() != nullptr) host_.emplace(kHostBlocks);
  }

  // Fills part of the host pool in-process (BlockAgent cannot allocate there): two blocks
  // for kOwners[0], one for kOwners[1], one left free.
  void FillHostPool() {
    BlockPool& pool = *agent_->host_pool();
    for (auto [count, owner] : {std::pair{2u, kOwners[0]}, std::pair{1u, kOwners[1]}}) {
      absl::StatusOr<std::vector<BlockId>> ids = pool.Allocate(count, owner);
      ASSERT_TRUE(ids.ok()) << ids.status();
      const std::string data = RandomBlocks(ids->size());
      ASSERT_TRUE(pool.WriteBlocks(*ids, owner, std::as_bytes(std::span(data))).ok());
      for (BlockId id : *ids) host_->owner[id] = owner;
      host_->Write(*ids, data);
    }
  }

  // One random call and its checks.
  void Step(int step) {
    faults_ = Chance(0.6);
    const int pick = static_cast<int>(Uniform(0, 99));
    if (pick < 16) {
      Allocate();
    } else if (pick < 36) {
      Free();
    } else if (pick < 64) {
      Write();
    } else if (pick < 84) {
      Read();
    } else {
      Attention();
    }
    if (::testing::Test::HasFailure()) return;
    CheckStats();
    if ((step + 1) % kSweepEvery == 0) CheckAllBytes();
  }

  // Calls per RPC and status code, e.g. "Free: 0 x 120, 3 x 41".
  std::string Summary() const {
    std::string out;
    for (const auto& [rpc, codes] : outcomes_) {
      absl::StrAppend(&out, rpc, ":");
      for (const auto& [code, n] : codes) absl::StrAppend(&out, " ", code, " x ", n);
      absl::StrAppend(&out, "\n");
    }
    absl::StrAppend(&out, "blocks read and compared: ", blocks_compared_,
                    ", attention outputs compared: ", attention_compared_, "\n");
    return out;
  }

  void CheckStats() {
    const v1::BlockAgentStatsResponse s = StatsOf(*stub_);
    EXPECT_EQ(s.geometry().num_blocks(), kBlocks);
    EXPECT_EQ(s.geometry().bytes_per_block(), kBlockBytes);
    EXPECT_EQ(s.capacity_bytes(), kBlocks * kBlockBytes);
    EXPECT_EQ(s.used_bytes(), main_.used_bytes()) << "an error changed the pool, or a success "
                                                     "did not change it as it should";
    EXPECT_EQ(s.free_blocks(), main_.free_blocks());
    EXPECT_EQ(s.has_host_pool(), host_.has_value());
    if (host_.has_value()) {
      EXPECT_EQ(s.host_pool().num_blocks(), kHostBlocks);
      EXPECT_EQ(s.host_pool().used_bytes(), host_->used_bytes());
      EXPECT_EQ(s.host_pool().free_blocks(), host_->free_blocks());
    }
  }

  // Reads every allocated block of both pools through ReadBlocks and compares the written
  // ones with the model.
  void CheckAllBytes() {
    CheckPoolBytes(main_, v1::TIER_UNSPECIFIED);
    if (host_.has_value()) CheckPoolBytes(*host_, v1::TIER_HOST);
  }

  // Frees every block through Free (the host pool's in-process) and checks the pools empty.
  void FreeEverything() {
    for (uint64_t owner : main_.Owners()) {
      v1::FreeBlocksRequest req;
      const std::vector<BlockId> ids = main_.OwnedBy(owner);
      req.mutable_block_ids()->Add(ids.begin(), ids.end());
      req.set_owner_epoch(owner);
      v1::FreeBlocksResponse resp;
      grpc::ClientContext ctx;
      const grpc::Status st = stub_->Free(&ctx, req, &resp);
      ASSERT_TRUE(st.ok()) << "owner " << owner << ": " << st.error_message();
      for (BlockId id : ids) main_.owner[id] = 0;
    }
    if (host_.has_value()) {
      for (uint64_t owner : host_->Owners()) {
        ASSERT_TRUE(agent_->host_pool()->Free(host_->OwnedBy(owner), owner).ok());
      }
      host_.emplace(kHostBlocks);
    }
    const v1::BlockAgentStatsResponse s = StatsOf(*stub_);
    EXPECT_EQ(s.used_bytes(), 0u);
    EXPECT_EQ(s.free_blocks(), kBlocks);
    EXPECT_EQ(s.host_pool().used_bytes(), 0u);
    EXPECT_EQ(s.host_pool().free_blocks(), host_.has_value() ? kHostBlocks : 0);
  }

 private:
  uint64_t Uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  // Chance(p) in a step that injects faults; false in a clean one.
  bool Fault(double p) { return faults_ && Chance(p); }
  template <typename T>
  T OneOf(std::initializer_list<T> values) {
    return *(values.begin() + Uniform(0, values.size() - 1));
  }

  // Mostly an allocating owner; sometimes 0 or one that owns nothing.
  uint64_t PickOwner() {
    if (Fault(0.06)) return 0;
    if (Fault(0.08)) return OneOf<uint64_t>({1, 99, std::numeric_limits<uint64_t>::max()});
    std::vector<uint64_t> holders;
    for (uint64_t owner : kOwners) {
      if (!main_.OwnedBy(owner).empty()) holders.push_back(owner);
    }
    if (!faults_ && !holders.empty()) return holders[Uniform(0, holders.size() - 1)];
    return kOwners[Uniform(0, std::size(kOwners) - 1)];
  }

  // An id list that is mostly `owner`'s blocks of `m`, up to `max_len` long, with random
  // faults: empty, too long, foreign or free ids, ids past the pool, repeated ids.
  std::vector<BlockId> PickIds(const PoolModel& m, uint64_t owner, size_t max_len) {
    std::vector<BlockId> owned = m.OwnedBy(owner);
    std::shuffle(owned.begin(), owned.end(), rng_);
    size_t len = Uniform(1, max_len);
    if (!owned.empty() && (!faults_ || Chance(0.7))) {
      len = Uniform(1, std::min(owned.size(), max_len));
    }
    if (Fault(0.05)) len = 0;
    if (Fault(0.05)) len = max_len + Uniform(1, 3);
    const bool clean = !faults_ || Chance(0.6);  // the owner's blocks only, as far as they go
    const uint32_t n = static_cast<uint32_t>(m.owner.size());
    std::vector<BlockId> ids;
    for (size_t i = 0; i < len; ++i) {
      if (i < owned.size() && (clean || Chance(0.75))) {
        ids.push_back(owned[i]);
      } else if (Chance(0.1)) {
        ids.push_back(OneOf<BlockId>({n, n + 1, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFFu}));
      } else if (!ids.empty() && Chance(0.1)) {
        ids.push_back(ids[Uniform(0, ids.size() - 1)]);
      } else {
        BlockId id = static_cast<BlockId>(Uniform(0, n - 1));
        for (int tries = 0; tries < 8 && std::count(ids.begin(), ids.end(), id) > 0; ++tries) {
          id = static_cast<BlockId>(Uniform(0, n - 1));
        }
        ids.push_back(id);
      }
    }
    return ids;
  }

  // `blocks` blocks of random bf16 latents (finite, so attention over them is finite).
  std::string RandomBlocks(size_t blocks) {
    const std::vector<uint16_t> v =
        RandomBf16(blocks * kBlockBytes / 2, static_cast<uint32_t>(rng_()));
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  }

  // Checks `st` against `allowed` (empty: must be OK); an INVALID_ARGUMENT or OUT_OF_RANGE
  // message must name one of `fields`. Returns whether the call succeeded.
  bool Expect(absl::string_view rpc, const grpc::Status& st, const Codes& allowed,
              std::initializer_list<absl::string_view> fields) {
    ++outcomes_[std::string(rpc)][st.error_code()];
    if (allowed.empty()) {
      EXPECT_TRUE(st.ok()) << "code " << st.error_code() << ": " << st.error_message();
      return st.ok();
    }
    EXPECT_TRUE(allowed.count(st.error_code()) > 0)
        << "code " << st.error_code() << " (" << st.error_message() << "), expected one of "
        << CodesToString(allowed);
    if (st.error_code() == grpc::INVALID_ARGUMENT || st.error_code() == grpc::OUT_OF_RANGE) {
      EXPECT_TRUE(std::any_of(
          fields.begin(), fields.end(),
          [&](absl::string_view f) { return absl::StrContains(st.error_message(), f); }))
          << "message names no field: " << st.error_message();
    }
    return st.ok();
  }

  // A request over the agent's max_message_bytes may be refused by gRPC itself.
  static void AllowTooLarge(size_t message_bytes, Codes& allowed) {
    if (message_bytes > kMaxMessageBytes) allowed.insert(grpc::RESOURCE_EXHAUSTED);
  }

  void Allocate() {
    const uint64_t free = main_.free_blocks();
    uint32_t count = static_cast<uint32_t>(Uniform(1, 3));
    if (Chance(0.4) && free > 0) count = static_cast<uint32_t>(Uniform(1, free));
    if (Fault(0.08)) count = 0;
    if (Fault(0.1)) count = static_cast<uint32_t>(Uniform(free + 1, kBlocks + 2));
    if (Fault(0.04)) count = OneOf<uint32_t>({0x80000000u, 0xFFFFFFFFu});
    const uint64_t owner = Fault(0.06) ? 0 : kOwners[Uniform(0, std::size(kOwners) - 1)];
    SCOPED_TRACE(absl::StrCat("Allocate count=", count, " owner_epoch=", owner));

    v1::AllocateBlocksRequest req;
    req.set_count(count);
    req.set_owner_epoch(owner);
    v1::AllocateBlocksResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Allocate(&ctx, req, &resp);
    Codes allowed;
    if (count == 0 || owner == 0) allowed.insert(grpc::INVALID_ARGUMENT);
    if (count > free) allowed.insert(grpc::RESOURCE_EXHAUSTED);
    if (!Expect("Allocate", st, allowed, {"count", "owner_epoch"})) return;
    ASSERT_EQ(resp.block_ids_size(), static_cast<int>(count));
    ASSERT_FALSE(
        HasDuplicate({resp.block_ids().data(), static_cast<size_t>(resp.block_ids_size())}))
        << "Allocate returned an id twice";
    for (BlockId id : resp.block_ids()) {
      ASSERT_LT(id, kBlocks);
      ASSERT_EQ(main_.owner[id], 0u) << "Allocate returned block " << id << ", already owned";
      main_.owner[id] = owner;
      main_.known[id] = false;
    }
  }

  void Free() {
    const uint64_t owner = PickOwner();
    std::vector<BlockId> ids = PickIds(main_, owner, kBlocks);
    if (Fault(0.04)) {  // thousands of ids, some messages over max_message_bytes
      ids.resize(Uniform(2'000, 6'000));
      for (BlockId& id : ids) {
        id = Chance(0.5) ? 0xFFFFFFFFu : static_cast<BlockId>(Uniform(0, kBlocks + 3));
      }
    }
    SCOPED_TRACE(
        absl::StrCat("Free owner_epoch=", owner, " block_ids=[",
                     absl::StrJoin(std::span(ids).first(std::min<size_t>(ids.size(), 20)), ","),
                     ids.size() > 20 ? ",..." : "", "] (", ids.size(), " ids)"));

    v1::FreeBlocksRequest req;
    req.mutable_block_ids()->Add(ids.begin(), ids.end());
    req.set_owner_epoch(owner);
    v1::FreeBlocksResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Free(&ctx, req, &resp);
    Codes allowed;
    if (ids.empty() || owner == 0 || HasDuplicate(ids)) allowed.insert(grpc::INVALID_ARGUMENT);
    for (BlockId id : ids) {
      if (id >= kBlocks) {
        allowed.insert(grpc::OUT_OF_RANGE);
      } else if (main_.owner[id] == 0) {
        allowed.insert(grpc::FAILED_PRECONDITION);
      } else if (main_.owner[id] != owner) {
        allowed.insert(grpc::ABORTED);
      }
    }
    AllowTooLarge(req.ByteSizeLong(), allowed);
    if (!Expect("Free", st, allowed, {"block_ids", "owner_epoch"})) return;
    for (BlockId id : ids) {
      main_.owner[id] = 0;
      main_.known[id] = false;
    }
  }

  // One WriteBlocks stream. Mostly a header naming blocks of one owner followed by their
  // bytes in random chunks; with random faults in the header, the chunks and the total,
  // sometimes a Free of one of the blocks while the stream is open, sometimes cancelled.
  void Write() {
    const uint64_t owner = PickOwner();
    const std::vector<BlockId> ids = PickIds(main_, owner, kMaxBlocksPerCall);
    std::string data = RandomBlocks(ids.size());
    const int total_mode = faults_ ? static_cast<int>(Uniform(0, 9)) : 9;  // 0: short, 1: long
    if (total_mode == 0) {
      data.resize(data.size() - std::min<size_t>(data.size(), Uniform(1, 2 * kBlockBytes)));
    }
    if (total_mode == 1) data += std::string(Uniform(1, 2'000), 'x');

    std::vector<v1::WriteBlocksRequest> msgs(1);
    msgs[0].mutable_header()->mutable_block_ids()->Add(ids.begin(), ids.end());
    msgs[0].mutable_header()->set_owner_epoch(owner);
    for (size_t pos = 0; pos < data.size();) {
      const size_t n = std::min<size_t>(data.size() - pos, Uniform(1, kMaxMessageBytes));
      msgs.emplace_back().set_data(data.substr(pos, n));
      pos += n;
    }
    if (Fault(0.05)) {
      // Over max_message_bytes: up to 1,000 bytes over reaches the agent, more is refused by
      // gRPC itself.
      const size_t at = Uniform(1, msgs.size());
      const size_t over = Uniform(1, 3'000);
      msgs.insert(msgs.begin() + at, v1::WriteBlocksRequest())
          ->set_data(std::string(kMaxMessageBytes + over, 'y'));
    }
    if (Fault(0.05)) {
      msgs.insert(msgs.begin() + Uniform(1, msgs.size()), v1::WriteBlocksRequest())->set_data("");
    }
    if (Fault(0.04)) msgs.insert(msgs.begin() + Uniform(1, msgs.size()), msgs[0]);
    if (Fault(0.04)) msgs.erase(msgs.begin());
    if (Fault(0.02)) msgs.clear();
    const size_t cancel_at = Fault(0.08) ? Uniform(0, msgs.size()) : msgs.size() + 1;
    const bool header_first = !msgs.empty() && msgs[0].has_header();
    // A Free of one of the header's blocks while the stream is open: the write must then
    // fail (at the header, or ABORTED at a later chunk: the block's allocation ended).
    const bool free_midway = header_first && ids.size() <= kMaxBlocksPerCall &&
                             OwnershipErrors(main_, ids, owner).empty() && msgs.size() > 1 &&
                             Fault(0.05);
    const size_t free_at = free_midway ? Uniform(1, msgs.size() - 1) : 0;
    const Codes header_errors = OwnershipErrors(main_, ids, owner);
    SCOPED_TRACE(absl::StrCat("WriteBlocks owner_epoch=", owner, " block_ids=[",
                              absl::StrJoin(ids, ","), "] messages=", msgs.size(),
                              " header_first=", header_first, " data_bytes=", data.size(),
                              " cancel_at=", cancel_at, " free_at=", free_at));

    grpc::ClientContext ctx;
    v1::WriteBlocksResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> w = stub_->WriteBlocks(&ctx, &resp);
    bool cancelled = false;
    for (size_t i = 0; i < msgs.size(); ++i) {
      if (i == cancel_at) {
        ctx.TryCancel();
        cancelled = true;
        break;
      }
      if (free_midway && i == free_at) {
        FreeOne(ids[Uniform(0, ids.size() - 1)], owner);
        if (::testing::Test::HasFailure()) return;
      }
      if (!w->Write(msgs[i])) break;  // the agent has already answered
    }
    if (!cancelled && cancel_at == msgs.size()) {
      ctx.TryCancel();  // every message sent, but the stream never half-closed
      cancelled = true;
    }
    if (!cancelled) w->WritesDone();
    const grpc::Status st = w->Finish();

    // What the agent must answer: the first bad message decides, else the end of the stream.
    Codes allowed;
    const size_t sent = std::min(msgs.size(), cancel_at);
    uint64_t expected = 0;
    uint64_t staged = 0;
    for (size_t i = 0; i < sent && allowed.empty(); ++i) {
      const v1::WriteBlocksRequest& m = msgs[i];
      if (m.data().size() > kMaxMessageBytes) {
        allowed.insert(grpc::INVALID_ARGUMENT);
        AllowTooLarge(m.ByteSizeLong(), allowed);
      } else if (i == 0) {
        if (!m.has_header() || ids.size() > kMaxBlocksPerCall) {
          allowed.insert(grpc::INVALID_ARGUMENT);
        } else {
          allowed = header_errors;
          expected = ids.size() * kBlockBytes;
        }
      } else if (m.has_header()) {
        allowed.insert(grpc::INVALID_ARGUMENT);
      } else if (m.data().empty()) {
        allowed.insert(grpc::INVALID_ARGUMENT);
      } else if (m.data().size() > expected - staged) {
        allowed.insert(grpc::INVALID_ARGUMENT);
      } else {
        staged += m.data().size();
      }
    }
    if (allowed.empty() && !cancelled) {
      if (sent == 0 || staged != expected) allowed.insert(grpc::INVALID_ARGUMENT);
      if (sent > 0) {
        const Codes now = OwnershipErrors(main_, ids, owner);
        allowed.insert(now.begin(), now.end());
      }
    }
    // The agent may have checked the header after the Free, or a chunk after it; or every
    // chunk of the freed block came before the Free (each is written as it arrives).
    if (free_midway) allowed.insert({grpc::FAILED_PRECONDITION, grpc::ABORTED, grpc::OK});
    if (cancelled) allowed.insert(grpc::CANCELLED);
    const bool ok =
        Expect("WriteBlocks", st, allowed, {"header", "block_ids", "owner_epoch", "data", "bytes"});
    if (ok) {
      EXPECT_EQ(resp.bytes_written(), ids.size() * kBlockBytes);
      main_.Write(ids, data);
      for (BlockId id : ids) {
        if (main_.owner[id] == 0) main_.known[id] = false;  // freed midway
      }
      return;
    }
    // Refused: the chunks that came before the error were written (each chunk is written
    // as it arrives), so the named blocks of the caller's own now hold unknown bytes; every
    // other block is still checked against the model.
    for (BlockId id : ids) {
      if (id < kBlocks && main_.owner[id] == owner) main_.known[id] = false;
    }
  }

  // Frees one block mid-WriteBlocks; a failure is a test failure.
  void FreeOne(BlockId id, uint64_t owner) {
    v1::FreeBlocksRequest req;
    req.add_block_ids(id);
    req.set_owner_epoch(owner);
    v1::FreeBlocksResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Free(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << "Free of block " << id << " midway: " << st.error_message();
    main_.owner[id] = 0;
    main_.known[id] = false;
  }

  // One ReadBlocks of random ids, owner and tier; sometimes cancelled after a few chunks.
  void Read() {
    const bool host = host_.has_value() && Chance(0.3);
    int tier = host ? v1::TIER_HOST : OneOf<int>({v1::TIER_UNSPECIFIED, v1::TIER_GPU});
    if (Fault(0.08)) {
      tier = OneOf<int>(
          {v1::TIER_HOST, v1::TIER_DISK, 4, 257, 258, -1, std::numeric_limits<int32_t>::max()});
    }
    const PoolModel* pool = nullptr;  // the pool the tier names, if the agent has it
    if (tier == v1::TIER_UNSPECIFIED || tier == v1::TIER_GPU) pool = &main_;
    if (tier == v1::TIER_HOST && host_.has_value()) pool = &*host_;
    const uint64_t owner = PickOwner();
    const std::vector<BlockId> ids =
        PickIds(pool != nullptr ? *pool : main_, owner, kMaxBlocksPerCall);
    const int cancel_after = Fault(0.1) ? static_cast<int>(Uniform(1, 6)) : -1;
    SCOPED_TRACE(absl::StrCat("ReadBlocks tier=", tier, " owner_epoch=", owner, " block_ids=[",
                              absl::StrJoin(ids, ","), "] cancel_after=", cancel_after));

    v1::ReadBlocksRequest req;
    req.mutable_block_ids()->Add(ids.begin(), ids.end());
    req.set_owner_epoch(owner);
    req.set_tier(static_cast<v1::Tier>(tier));
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> r = stub_->ReadBlocks(&ctx, req);
    std::string got;
    v1::ReadBlocksResponse msg;
    int chunks = 0;
    bool cancelled = false;
    while (r->Read(&msg)) {
      EXPECT_GE(msg.data().size(), 1u);
      EXPECT_LE(msg.data().size(), kReadChunkBytes);
      got += msg.data();
      if (++chunks == cancel_after) {
        ctx.TryCancel();
        cancelled = true;
        while (r->Read(&msg)) got += msg.data();
        break;
      }
    }
    const grpc::Status st = r->Finish();

    Codes allowed;
    if (pool == nullptr || ids.size() > kMaxBlocksPerCall) {
      allowed.insert(grpc::INVALID_ARGUMENT);
    } else {
      allowed = OwnershipErrors(*pool, ids, owner);
    }
    if (cancelled) {
      allowed.insert(grpc::CANCELLED);  // or OK, when the last chunk was already in
      if (st.ok()) allowed.clear();
    }
    const bool ok = Expect("ReadBlocks", st, allowed, {"tier", "block_ids", "owner_epoch"});
    if (!ok) {
      if (!cancelled) {
        EXPECT_TRUE(got.empty()) << "bytes streamed before an error";
      }
      return;
    }
    ASSERT_EQ(got.size(), ids.size() * kBlockBytes);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!pool->known[ids[i]]) continue;
      ASSERT_TRUE(absl::string_view(got).substr(i * kBlockBytes, kBlockBytes) ==
                  pool->block(ids[i]))
          << "block " << ids[i] << " (position " << i << ") does not hold what was written";
      ++blocks_compared_;
    }
  }

  // One RunAttention with random shapes, mostly valid.
  void Attention() {
    const uint64_t owner = PickOwner();
    size_t batch = Uniform(1, 3);
    if (Fault(0.05)) batch = 0;
    if (Fault(0.03)) batch = OneOf<size_t>({1'024, 1'025});
    // Mostly blocks the owner has written, so that the answer can be checked.
    std::vector<BlockId> written;
    for (BlockId id : main_.OwnedBy(owner)) {
      if (main_.known[id]) written.push_back(id);
    }
    std::vector<std::vector<BlockId>> table(batch);
    std::vector<uint32_t> seq_lens(batch);
    for (size_t b = 0; b < batch; ++b) {
      if (batch > 8) {
        table[b] = {static_cast<BlockId>(Uniform(0, kBlocks - 1))};
      } else if (!written.empty() && (!faults_ || Chance(0.7))) {
        table[b].resize(Uniform(1, 3));
        for (BlockId& id : table[b]) id = written[Uniform(0, written.size() - 1)];
      } else {
        table[b] = PickIds(main_, owner, 3);
      }
      if (!table[b].empty() && Chance(0.1)) table[b].push_back(table[b][0]);  // allowed
      const uint32_t cap = static_cast<uint32_t>(table[b].size() * kPageTokens);
      seq_lens[b] = cap == 0 ? 1 : static_cast<uint32_t>(Uniform(1, cap));
      if (Fault(0.04)) seq_lens[b] = 0;
      if (Fault(0.04)) seq_lens[b] = cap + static_cast<uint32_t>(Uniform(1, kPageTokens));
      if (Fault(0.02)) seq_lens[b] = std::numeric_limits<uint32_t>::max();
    }
    if (Fault(0.05)) seq_lens.resize(batch + 1, 1);
    if (Fault(0.05) && batch > 0) seq_lens.pop_back();
    uint32_t heads = static_cast<uint32_t>(Uniform(1, 4));
    if (Fault(0.08)) heads = OneOf<uint32_t>({0, 128, 129, 200});
    uint32_t layer = static_cast<uint32_t>(Uniform(0, kLayers - 1));
    if (Fault(0.06)) layer = OneOf<uint32_t>({kLayers, 1'000, 0xFFFFFFFFu});
    float scale = std::uniform_real_distribution<float>(0.02f, 0.2f)(rng_);
    if (Fault(0.08)) {
      scale = OneOf<float>({0.0f, -0.1f, std::nanf(""), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min()});
    }
    const size_t query_bytes = batch * heads * kHeadDim * 2;
    size_t send_bytes = query_bytes;
    if (Fault(0.06)) send_bytes = OneOf<size_t>({0, query_bytes + 2, query_bytes + 1});
    if (Fault(0.03) && query_bytes >= 2) send_bytes = query_bytes - 2;
    // Well past max_message_bytes is no different from just past it, only slower to build.
    if (send_bytes > 4 * kMaxMessageBytes) send_bytes = OneOf<size_t>({0, kHeadDim * 2});
    const std::vector<uint16_t> q = RandomBf16((send_bytes + 1) / 2, static_cast<uint32_t>(rng_()));
    SCOPED_TRACE(absl::StrCat("RunAttention owner_epoch=", owner, " batch=", batch,
                              " seq_lens=", seq_lens.size(), " heads=", heads, " layer=", layer,
                              " scale=", scale, " query_bytes=", send_bytes, " table=[",
                              absl::StrJoin(std::span(table).first(std::min<size_t>(batch, 4)), ";",
                                            [](std::string* out, const std::vector<BlockId>& row) {
                                              absl::StrAppend(out, absl::StrJoin(row, ","));
                                            }),
                              "]"));

    v1::RunAttentionRequest req;
    for (const std::vector<BlockId>& row : table) {
      req.add_block_table()->mutable_block_ids()->Add(row.begin(), row.end());
    }
    req.mutable_seq_lens()->Add(seq_lens.begin(), seq_lens.end());
    req.set_query(reinterpret_cast<const char*>(q.data()), send_bytes);
    req.set_softmax_scale(scale);
    req.set_num_heads(heads);
    req.set_layer(layer);
    req.set_owner_epoch(owner);
    v1::RunAttentionResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->RunAttention(&ctx, req, &resp);

    Codes allowed;
    constexpr grpc::StatusCode kInvalid = grpc::INVALID_ARGUMENT;
    if (batch < 1 || batch > 1'024 || seq_lens.size() != batch) allowed.insert(kInvalid);
    if (heads < 1 || heads > 128 || layer >= kLayers) allowed.insert(kInvalid);
    if (!std::isfinite(scale) || scale <= 0.0f || send_bytes != query_bytes) {
      allowed.insert(kInvalid);
    }
    std::vector<BlockId> distinct;
    for (size_t b = 0; b < batch; ++b) {
      if (b < seq_lens.size() && (seq_lens[b] < 1 || seq_lens[b] > table[b].size() * kPageTokens)) {
        allowed.insert(kInvalid);
      }
      distinct.insert(distinct.end(), table[b].begin(), table[b].end());
    }
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    const Codes owned = OwnershipErrors(main_, distinct, owner);
    allowed.insert(owned.begin(), owned.end());
    AllowTooLarge(req.ByteSizeLong(), allowed);
    if (!Expect("RunAttention", st, allowed,
                {"block_table", "seq_lens", "query", "softmax_scale", "num_heads", "layer",
                 "owner_epoch", "MlaDecodeParams"})) {
      return;
    }
    EXPECT_EQ(resp.backend(), "host");
    ASSERT_EQ(resp.output().size(), batch * heads * kRank * sizeof(float));
    ASSERT_EQ(resp.lse_size(), static_cast<int>(batch * heads));

    // The reference over the model's bytes, when every block the kernel reads is known.
    for (size_t b = 0; b < batch; ++b) {
      for (size_t i = 0; i * kPageTokens < seq_lens[b]; ++i) {
        if (!main_.known[table[b][i]]) return;
      }
    }
    size_t max_blocks = 0;
    for (const std::vector<BlockId>& row : table) max_blocks = std::max(max_blocks, row.size());
    std::vector<int32_t> flat(batch * max_blocks);
    for (size_t b = 0; b < batch; ++b) {
      for (size_t i = 0; i < max_blocks; ++i) {
        flat[b * max_blocks + i] = static_cast<int32_t>(table[b][std::min(i, table[b].size() - 1)]);
      }
    }
    const std::vector<int32_t> lens(seq_lens.begin(), seq_lens.end());
    std::vector<uint16_t> out(batch * heads * kRank);
    std::vector<float> lse(batch * heads);
    gpu::MlaDecodeParams p;
    p.kv_cache = main_.bytes.data() + layer * kTokenBytes * kPageTokens;
    p.kv_block_stride_bytes = kBlockBytes;
    p.block_table = flat.data();
    p.block_table_stride = static_cast<int64_t>(max_blocks);
    p.seq_lens = lens.data();
    p.q = q.data();
    p.q_head_stride = kHeadDim;
    p.q_batch_stride = int64_t{heads} * kHeadDim;
    p.out = out.data();
    p.out_head_stride = kRank;
    p.out_batch_stride = int64_t{heads} * kRank;
    p.lse = lse.data();
    p.batch = static_cast<int>(batch);
    p.num_heads = static_cast<int>(heads);
    p.num_blocks = kBlocks;
    p.page_size = kPageTokens;
    p.max_blocks_per_seq = static_cast<int>(max_blocks);
    p.softmax_scale = scale;
    ASSERT_TRUE(gpu::MlaDecodeCpu(p).ok());
    ++attention_compared_;
    std::vector<float> want(out.size());
    for (size_t i = 0; i < out.size(); ++i) want[i] = gpu::Bf16ToFloat(out[i]);
    EXPECT_EQ(std::memcmp(resp.output().data(), want.data(), resp.output().size()), 0)
        << "output differs from MlaDecodeCpu over the bytes written";
    EXPECT_EQ(std::memcmp(resp.lse().data(), lse.data(), lse.size() * sizeof(float)), 0)
        << "lse differs from MlaDecodeCpu over the bytes written";
  }

  // ReadBlocks of `ids` (each allocated, in groups of their owner) must return the model's
  // bytes for the written ones.
  void CheckBlocks(const PoolModel& m, v1::Tier tier, std::span<const BlockId> ids) {
    for (uint64_t owner : m.Owners()) {
      std::vector<BlockId> group;
      for (BlockId id : ids) {
        if (m.owner[id] == owner) group.push_back(id);
      }
      for (size_t first = 0; first < group.size(); first += kMaxBlocksPerCall) {
        const std::span<const BlockId> part = std::span(group).subspan(
            first, std::min<size_t>(kMaxBlocksPerCall, group.size() - first));
        v1::ReadBlocksRequest req;
        req.mutable_block_ids()->Add(part.begin(), part.end());
        req.set_owner_epoch(owner);
        req.set_tier(tier);
        grpc::ClientContext ctx;
        std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> r =
            stub_->ReadBlocks(&ctx, req);
        std::string got;
        v1::ReadBlocksResponse msg;
        while (r->Read(&msg)) got += msg.data();
        const grpc::Status st = r->Finish();
        ASSERT_TRUE(st.ok()) << "tier " << tier << ": " << st.error_message();
        ASSERT_EQ(got.size(), part.size() * kBlockBytes);
        for (size_t i = 0; i < part.size(); ++i) {
          if (!m.known[part[i]]) continue;
          ASSERT_TRUE(absl::string_view(got).substr(i * kBlockBytes, kBlockBytes) ==
                      m.block(part[i]))
              << "tier " << tier << " block " << part[i] << " changed";
        }
      }
    }
  }

  void CheckPoolBytes(const PoolModel& m, v1::Tier tier) {
    std::vector<BlockId> all;
    for (BlockId id = 0; id < m.owner.size(); ++id) {
      if (m.owner[id] != 0) all.push_back(id);
    }
    CheckBlocks(m, tier, all);
  }

  Agent* const agent_;
  const std::unique_ptr<v1::BlockAgent::Stub> stub_;
  std::mt19937_64 rng_;
  PoolModel main_;
  std::optional<PoolModel> host_;
  std::map<std::string, std::map<int, int>> outcomes_;
  bool faults_ = false;         // whether this step injects faults
  int blocks_compared_ = 0;     // blocks a random ReadBlocks returned, compared to the model
  int attention_compared_ = 0;  // RunAttention answers compared to MlaDecodeCpu
};

void RunFuzz(bool with_host_pool) {
  const uint64_t seed = EnvOr("KVCM_FUZZ_SEED", 20'240'611);
  const int steps = static_cast<int>(EnvOr("KVCM_FUZZ_STEPS", 2'500));
  std::cout << "KVCM_FUZZ_SEED=" << seed << " KVCM_FUZZ_STEPS=" << steps
            << (with_host_pool ? " (with a host pool)" : " (no host pool)") << std::endl;
  std::unique_ptr<Agent> agent = StartAgent(with_host_pool);
  ASSERT_NE(agent, nullptr);
  BlockAgentFuzzer fuzzer(agent.get(), seed);
  if (with_host_pool) {
    ASSERT_NO_FATAL_FAILURE(fuzzer.FillHostPool());
  }
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(absl::StrCat("KVCM_FUZZ_SEED=", seed, " step ", step));
    fuzzer.Step(step);
    if (::testing::Test::HasFailure()) return;  // later steps would only repeat the damage
  }
  fuzzer.CheckAllBytes();
  fuzzer.FreeEverything();
  std::cout << "status codes per RPC:\n" << fuzzer.Summary();
}

TEST(BlockAgentFuzzTest, RandomCallsWithoutHostPool) { RunFuzz(false); }

TEST(BlockAgentFuzzTest, RandomCallsWithHostPool) { RunFuzz(true); }

// One WriteBlocks stream: a header naming `id` for `owner`, then `chunks`, then half-close.
grpc::Status WriteChunks(v1::BlockAgent::Stub& stub, BlockId id, uint64_t owner,
                         const std::vector<std::string>& chunks) {
  grpc::ClientContext ctx;
  v1::WriteBlocksResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> w = stub.WriteBlocks(&ctx, &resp);
  v1::WriteBlocksRequest msg;
  msg.mutable_header()->add_block_ids(id);
  msg.mutable_header()->set_owner_epoch(owner);
  bool open = w->Write(msg);
  for (size_t i = 0; open && i < chunks.size(); ++i) {
    msg.set_data(chunks[i]);
    open = w->Write(msg);
  }
  w->WritesDone();
  return w->Finish();
}

// The bytes of block `id`; empty when ReadBlocks fails (a test failure).
std::string ReadBlock(v1::BlockAgent::Stub& stub, BlockId id, uint64_t owner) {
  v1::ReadBlocksRequest req;
  req.add_block_ids(id);
  req.set_owner_epoch(owner);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> r = stub.ReadBlocks(&ctx, req);
  std::string got;
  v1::ReadBlocksResponse msg;
  while (r->Read(&msg)) got += msg.data();
  const grpc::Status st = r->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  return st.ok() ? got : std::string();
}

// gRPC itself refuses a message too large for the agent (over max_message_bytes plus
// framing) and answers RESOURCE_EXHAUSTED. Chunks are written as they arrive, under the
// pool's lock, one whole chunk at a time: the block then holds its old bytes or the whole
// chunk that came before the refused message, never a mix and never the refused bytes.
TEST(BlockAgentFuzzTest, WriteRefusedByGrpcAfterItsLastByteChangesNothing) {
  std::unique_ptr<Agent> agent = StartAgent(false);
  ASSERT_NE(agent, nullptr);
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
  const std::vector<BlockId> ids = ::kvcm::testing::AllocateBlocks(*stub, 1, kOwners[0]);
  ASSERT_EQ(ids.size(), 1u);
  const std::string before(kBlockBytes, 'a');
  ASSERT_TRUE(WriteChunks(*stub, ids[0], kOwners[0], {before}).ok());
  for (int attempt = 0; attempt < 3; ++attempt) {
    const grpc::Status st =
        WriteChunks(*stub, ids[0], kOwners[0],
                    {std::string(kBlockBytes, 'b'), std::string(kMaxMessageBytes + 2'000, 'c')});
    EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << st.error_message();
    absl::SleepFor(absl::Milliseconds(20));  // the agent may still be handling the stream
    const std::string now = ReadBlock(*stub, ids[0], kOwners[0]);
    ASSERT_TRUE(now == before || now == std::string(kBlockBytes, 'b'))
        << "attempt " << attempt << ": the block holds a mix or the refused bytes";
    ASSERT_TRUE(WriteChunks(*stub, ids[0], kOwners[0], {before}).ok());
  }
}

}  // namespace
}  // namespace kvcm
