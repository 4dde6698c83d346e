// The local data path over a real Unix socket in a temp dir (LocalSocketServer, LocalSession,
// LocalClient): hello validation, LOAD / STORE round trips, the ReadBlocks / WriteBlocks
// authorization a session inherits, page-verified reads (LocalCopy LOAD and ReadBlocks),
// garbage datagrams and the session limit.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gpu/agent/local/local_client.h"
#include "gpu/agent/local/local_socket_server.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gtest/gtest.h"
#include "proto/core_types.h"
#include "tests/util/agent_pools.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kOwner = 7;
constexpr uint64_t kPoolBlocks = 8;
// The region: 4 engine blocks of SmallGqa's 2 layers (segments) of 512 bytes; layer l's
// tensor [4 blocks, 512 bytes] at offset l x 2048.
constexpr uint32_t kEngineBlocks = 4;
constexpr uint64_t kSegment = 512;
constexpr uint64_t kRegion = 2 * kEngineBlocks * kSegment;
const NamespaceId kAcmeNs{"acme", "meta/small-gqa"};
const NamespaceId kEvilNs{"evil", "meta/small-gqa"};
constexpr char kAcme[] = "acme-worker-token-5d1c0f";
constexpr char kEvil[] = "evil-worker-token-88a2e1";
constexpr char kUnknown[] = "nobody-knows-this-token-1";

v1::LocalHello GoodHello(const std::string& token = "") {
  v1::LocalHello h;
  h.set_token(token);
  h.set_region_bytes(kRegion);
  h.add_segment_offsets(0);
  h.add_segment_offsets(kEngineBlocks * kSegment);
  h.set_segment_bytes(kSegment);
  h.set_segment_stride(kSegment);
  h.set_num_engine_blocks(kEngineBlocks);
  return h;
}

// Engine block e's bytes as an agent block (its two segments end to end).
std::string EngineBlock(const MemfdRegion& r, uint32_t e) {
  const char* base = reinterpret_cast<const char*>(r.data());
  return std::string(base + e * kSegment, kSegment) +
         std::string(base + kEngineBlocks * kSegment + e * kSegment, kSegment);
}

std::string RegionBytes(const MemfdRegion& r) {
  return std::string(reinterpret_cast<const char*>(r.data()), r.size());
}

void Fill(MemfdRegion& r, uint32_t seed) {
  for (uint64_t i = 0; i < r.size(); ++i) {
    r.data()[i] = static_cast<std::byte>((i * 131 + seed * 17 + 3) & 0xFF);
  }
}

class LocalSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/kvcm_local_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->random_seed(), "_", counter_++);
    mkdir(dir_.c_str(), 0700);
    path_ = dir_ + "/agent.sock";
  }
  void TearDown() override {
    server_.reset();
    std::remove(tokens_path_.c_str());
    rmdir(dir_.c_str());
  }

  // Serves the pool with a tokens file (acme and evil workers) when `tokens`, else open;
  // `socket` but its path as given.
  void StartServer(bool tokens, LocalSocketOptions socket = {}) {
    socket.path = path_;
    if (tokens) {
      tokens_path_ = dir_ + "/tokens";
      std::FILE* f = std::fopen(tokens_path_.c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fputs(absl::StrCat(Sha256Hex(kAcme), " acme-vllm roles=worker tenant=acme\n",
                              Sha256Hex(kEvil), " evil-vllm roles=worker tenant=evil\n")
                     .c_str(),
                 f);
      std::fclose(f);
      absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromFile(tokens_path_);
      ASSERT_TRUE(a.ok()) << a.status();
      authenticator_ = *std::move(a);
    } else {
      authenticator_ = Authenticator::Open();
    }
    absl::StatusOr<std::unique_ptr<LocalSocketServer>> s = LocalSocketServer::Start(
        std::move(socket), LocalSessionEnv{.options = &options_,
                                           .pools = AgentPools{.main = pool_.get()},
                                           .epoch = &epoch_,
                                           .authenticator = authenticator_.get(),
                                           .metrics = &metrics_});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  std::unique_ptr<LocalClient> Connect() {
    absl::StatusOr<std::unique_ptr<LocalClient>> c = LocalClient::Connect(path_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::unique_ptr<MemfdRegion> Region(uint64_t bytes = kRegion, bool seal = true) {
    absl::StatusOr<std::unique_ptr<MemfdRegion>> r = MemfdRegion::Create(bytes, seal);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  absl::Status Hello(LocalClient& c, const MemfdRegion& r, const v1::LocalHello& h) {
    v1::LocalRequest req;
    *req.mutable_hello() = h;
    const int fd = r.fd();
    absl::StatusOr<v1::LocalReply> reply = c.Call(req, {&fd, 1});
    if (!reply.ok()) return reply.status();
    if (reply->code() == 0) {
      EXPECT_EQ(reply->bytes_per_block(), pool_->geometry().bytes_per_block());
      EXPECT_EQ(reply->epoch(), epoch_.current());
    }
    return LocalReplyStatus(*reply);
  }

  absl::StatusOr<v1::LocalReply> Copy(LocalClient& c, v1::LocalDirection dir,
                                      const std::vector<BlockId>& ids,
                                      const std::vector<uint32_t>& engine,
                                      const std::vector<uint64_t>& gens = {},
                                      const std::vector<PageHash>& pages = {},
                                      const NamespaceId* ns = nullptr) {
    v1::LocalRequest req;
    v1::LocalCopy* copy = req.mutable_copy();
    copy->set_direction(dir);
    copy->set_owner_epoch(kOwner);
    copy->mutable_block_ids()->Add(ids.begin(), ids.end());
    copy->mutable_engine_blocks()->Add(engine.begin(), engine.end());
    copy->mutable_block_generations()->Add(gens.begin(), gens.end());
    if (ns != nullptr) NamespaceToProto(*ns, copy->mutable_namespace_());
    if (!pages.empty()) copy->set_page_hashes(EncodePageHashes(pages));
    return c.Call(req);
  }

  absl::Status CopyStatus(LocalClient& c, v1::LocalDirection dir, const std::vector<BlockId>& ids,
                          const std::vector<uint32_t>& engine,
                          const std::vector<uint64_t>& gens = {},
                          const std::vector<PageHash>& pages = {},
                          const NamespaceId* ns = nullptr) {
    absl::StatusOr<v1::LocalReply> r = Copy(c, dir, ids, engine, gens, pages, ns);
    return r.ok() ? LocalReplyStatus(*r) : r.status();
  }

  std::vector<BlockId> Allocate(uint32_t n, const NamespaceId& ns, std::vector<uint64_t>* gens) {
    absl::StatusOr<std::vector<BlockId>> ids = pool_->Allocate(n, kOwner, &ns, gens);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<BlockId>{};
  }

  std::string PoolBlock(BlockId id) {
    std::string out(pool_->geometry().bytes_per_block(), '\0');
    EXPECT_TRUE(pool_->ReadBlock(id, kOwner, 0, std::as_writable_bytes(std::span<char>(out))).ok());
    return out;
  }

  void WritePool(BlockId id, uint64_t gen, char fill) {
    const std::string bytes(pool_->geometry().bytes_per_block(), fill);
    ASSERT_TRUE(
        pool_->WriteBlocks({&id, 1}, kOwner, std::as_bytes(std::span<const char>(bytes)), {&gen, 1})
            .ok());
  }

  static inline int counter_ = 0;
  std::string dir_;
  std::string path_;
  std::string tokens_path_;
  AgentOptions options_;
  std::unique_ptr<BlockPool> pool_ = MakeHostPool(SmallGqa(), kPoolBlocks);
  AgentEpoch epoch_;
  AgentMetrics metrics_{"agent-1", AgentPools{.main = pool_.get()}, &epoch_};
  std::unique_ptr<Authenticator> authenticator_;
  std::unique_ptr<LocalSocketServer> server_;
};

TEST_F(LocalSessionTest, SocketIsPrivateReplacesAStaleOneAndIsRemovedOnStop) {
  // A stale socket of a previous agent is replaced.
  StartServer(false);
  struct stat st {};
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  server_.reset();
  EXPECT_NE(stat(path_.c_str(), &st), 0);  // removed
  // A socket file left behind (a crashed agent) is replaced.
  {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    close(fd);
  }
  StartServer(false);
  EXPECT_NE(Connect(), nullptr);
  server_.reset();
  // Any other file is left alone.
  std::FILE* f = std::fopen(path_.c_str(), "w");
  std::fclose(f);
  absl::StatusOr<std::unique_ptr<LocalSocketServer>> s = LocalSocketServer::Start(
      {.path = path_}, LocalSessionEnv{.options = &options_,
                                       .pools = AgentPools{.main = pool_.get()},
                                       .authenticator = authenticator_.get()});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  std::remove(path_.c_str());
}

TEST_F(LocalSessionTest, HelloIsValidatedAndARefusedOneRegistersNothing) {
  StartServer(false);
  auto c = Connect();
  auto region = Region();
  Fill(*region, 1);
  const std::string before = RegionBytes(*region);
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(1, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'p');

  struct Case {
    const char* name;
    void (*edit)(v1::LocalHello&);
    const char* field;
  };
  const Case cases[] = {
      {"layout does not make a block", [](v1::LocalHello& h) { h.set_segment_bytes(256); },
       "segment_bytes"},
      {"three segments", [](v1::LocalHello& h) { h.add_segment_offsets(0); }, "segment_bytes"},
      {"no segment", [](v1::LocalHello& h) { h.clear_segment_offsets(); }, "segment_offsets"},
      {"segment past region",
       [](v1::LocalHello& h) { h.set_segment_offsets(1, kEngineBlocks * kSegment + 1); },
       "segment_offsets[1]"},
      {"stride past region", [](v1::LocalHello& h) { h.set_segment_stride(kSegment * 2); },
       "segment_offsets[1]"},
      {"huge stride overflows", [](v1::LocalHello& h) { h.set_segment_stride(~uint64_t{0}); },
       "segment_offsets[0]"},
      {"no engine blocks", [](v1::LocalHello& h) { h.set_num_engine_blocks(0); },
       "num_engine_blocks"},
      {"region 0", [](v1::LocalHello& h) { h.set_region_bytes(0); }, "region_bytes"},
      {"region over 1 TiB", [](v1::LocalHello& h) { h.set_region_bytes((1ull << 40) + 1); },
       "region_bytes"},
      {"region larger than the fd", [](v1::LocalHello& h) { h.set_region_bytes(kRegion + 1); },
       "region_bytes"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    v1::LocalHello h = GoodHello();
    k.edit(h);
    const absl::Status s = Hello(*c, *region, h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(k.field));
  }
  // No fd, two fds, an fd that is not a file, an fd smaller than the region, an unsealed one.
  v1::LocalRequest req;
  *req.mutable_hello() = GoodHello();
  absl::StatusOr<v1::LocalReply> r = c->Call(req);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->code(), static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r->message(), HasSubstr("exactly one file descriptor"));
  const int two[] = {region->fd(), region->fd()};
  r = c->Call(req, two);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->message(), HasSubstr("exactly one file descriptor"));
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  r = c->Call(req, {&pipefd[0], 1});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->code(), static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r->message(), HasSubstr("regular file"));
  close(pipefd[0]);
  close(pipefd[1]);
  auto small = Region(kRegion / 2);
  absl::Status s = Hello(*c, *small, GoodHello());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("exceed the fd's"));
  auto unsealed = Region(kRegion, /*seal=*/false);
  s = Hello(*c, *unsealed, GoodHello());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("sealed"));

  // Nothing registered: a copy is refused before a hello, and nothing moved.
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("hello"));
  EXPECT_EQ(RegionBytes(*region), before);

  // A good hello, then a second one is refused and keeps the first region.
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  auto other = Region();
  s = Hello(*c, *other, GoodHello());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {2}).ok());
  EXPECT_EQ(EngineBlock(*region, 2), PoolBlock(ids[0]));
  EXPECT_EQ(RegionBytes(*other).find_first_not_of('\0'), std::string::npos);  // untouched
}

// A hello of GPU memory (cuda_ipc) is checked as a memfd's hello, plus its own fields; a
// well-formed one is refused here with why (no CUDA in this build, no device, or, on a GPU
// host, no device at the made-up bus id); nothing is registered and the connection can
// still register a memfd. The handles are opened for real in cuda_ipc_region_test.cc.
TEST_F(LocalSessionTest, CudaIpcHelloIsValidatedAndRefusedWithoutADeviceRegistersNothing) {
  StartServer(false);
  auto c = Connect();
  const auto call = [&](const v1::LocalHello& h, std::span<const int> fds = {}) {
    v1::LocalRequest req;
    *req.mutable_hello() = h;
    absl::StatusOr<v1::LocalReply> r = c->Call(req, fds);
    return r.ok() ? LocalReplyStatus(*r) : r.status();
  };
  const auto cuda_hello = [] {
    v1::LocalHello h = GoodHello();
    v1::CudaIpcRegion* ipc = h.mutable_cuda_ipc();
    ipc->set_pci_bus_id("0000:00:00.0");
    ipc->add_segment_handles(std::string(64, '\x11'));
    ipc->add_segment_handles(std::string(64, '\x22'));
    return h;
  };
  struct Case {
    const char* name;
    void (*edit)(v1::LocalHello&);
    const char* field;
  };
  const Case cases[] = {
      {"short handle",
       [](v1::LocalHello& h) {
         h.mutable_cuda_ipc()->set_segment_handles(1, std::string(63, 'x'));
       },
       "cuda_ipc.segment_handles[1]: must be a cudaIpcMemHandle_t of 64 bytes, got 63"},
      {"torch's versioned handle",
       [](v1::LocalHello& h) {
         h.mutable_cuda_ipc()->set_segment_handles(0, std::string(66, 'x'));
       },
       "strip its 2 leading bytes"},
      {"one handle for two segments",
       [](v1::LocalHello& h) { h.mutable_cuda_ipc()->mutable_segment_handles()->RemoveLast(); },
       "cuda_ipc.segment_handles: 1 handles for 2 segment_offsets"},
      {"no bus id", [](v1::LocalHello& h) { h.mutable_cuda_ipc()->clear_pci_bus_id(); },
       "cuda_ipc.pci_bus_id"},
      {"layout checked first", [](v1::LocalHello& h) { h.set_segment_bytes(256); },
       "segment_bytes"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    v1::LocalHello h = cuda_hello();
    k.edit(h);
    const absl::Status s = call(h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(k.field));
  }
  // Both a memfd and cuda_ipc.
  auto region = Region();
  const int fd = region->fd();
  absl::Status s = call(cuda_hello(), {&fd, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not both"));

  // Well formed: refused with the reason this agent cannot open it.
  s = call(cuda_hello());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
#ifndef KVCM_CUDA_ENABLED
  EXPECT_THAT(s.message(), HasSubstr("this agent was built without CUDA"));
#else
  if (absl::StatusOr<int> n = CudaDeviceCount(); !n.ok() || *n < 1) {
    EXPECT_THAT(s.message(), HasSubstr("no CUDA device"));
  } else {
    EXPECT_THAT(s.message(), HasSubstr("cuda_ipc"));
  }
#endif
  // Nothing registered: a copy still wants a hello, and a memfd hello is accepted.
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(1, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'q');
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("hello"));
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {1}).ok());
  EXPECT_EQ(EngineBlock(*region, 1), std::string(1024, 'q'));
}

TEST_F(LocalSessionTest, StoreThenLoadRoundTripsBytesExactly) {
  StartServer(false);
  auto c = Connect();
  auto region = Region();
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  Fill(*region, 7);
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(3, kAcmeNs, &gens);
  absl::StatusOr<v1::LocalReply> r = Copy(*c, v1::LOCAL_DIRECTION_STORE, ids, {2, 0, 1}, gens);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->code(), 0u) << r->message();
  EXPECT_EQ(r->blocks_copied(), 3u);
  EXPECT_EQ(r->bytes_copied(), 3 * pool_->geometry().bytes_per_block());
  EXPECT_EQ(PoolBlock(ids[0]), EngineBlock(*region, 2));
  EXPECT_EQ(PoolBlock(ids[1]), EngineBlock(*region, 0));
  EXPECT_EQ(PoolBlock(ids[2]), EngineBlock(*region, 1));

  const std::string stored[] = {PoolBlock(ids[0]), PoolBlock(ids[1]), PoolBlock(ids[2])};
  std::memset(region->data(), 0, region->size());
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {3, 1, 0}).ok());
  EXPECT_EQ(EngineBlock(*region, 3), stored[0]);
  EXPECT_EQ(EngineBlock(*region, 1), stored[1]);
  EXPECT_EQ(EngineBlock(*region, 0), stored[2]);
  EXPECT_EQ(EngineBlock(*region, 2), std::string(2 * kSegment, '\0'));  // not a target

  const std::string text = metrics_.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_agent_local_sessions_total"));
  EXPECT_THAT(text, HasSubstr("code=\"OK\",direction=\"load\""));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_local_bytes_total{direction=\"store\"} 3072"));
}

TEST_F(LocalSessionTest, CopiesAreCheckedAsReadAndWriteBlocksAndRefusalsCopyNothing) {
  StartServer(true);
  // Unknown or missing tokens: no session.
  {
    auto c = Connect();
    auto region = Region();
    EXPECT_EQ(Hello(*c, *region, GoodHello(kUnknown)).code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(Hello(*c, *region, GoodHello()).code(), absl::StatusCode::kUnauthenticated);
  }
  auto acme = Connect();
  auto region = Region();
  ASSERT_TRUE(Hello(*acme, *region, GoodHello(kAcme)).ok());
  Fill(*region, 3);
  const std::string before = RegionBytes(*region);
  std::vector<uint64_t> acme_gens, evil_gens;
  const std::vector<BlockId> mine = Allocate(2, kAcmeNs, &acme_gens);
  const std::vector<BlockId> theirs = Allocate(1, kEvilNs, &evil_gens);
  WritePool(mine[0], acme_gens[0], 'a');
  WritePool(mine[1], acme_gens[1], 'b');
  WritePool(theirs[0], evil_gens[0], 'e');

  // Another tenant's block, alone or among its own: PERMISSION_DENIED, nothing copied.
  absl::Status s = CopyStatus(*acme, v1::LOCAL_DIRECTION_LOAD, {mine[0], theirs[0]}, {0, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("acme-vllm"));
  s = CopyStatus(*acme, v1::LOCAL_DIRECTION_STORE, theirs, {0}, evil_gens);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(RegionBytes(*region), before);
  EXPECT_EQ(PoolBlock(theirs[0]), std::string(1024, 'e'));

  // A worker's STORE names its allocations (as WriteBlocks).
  s = CopyStatus(*acme, v1::LOCAL_DIRECTION_STORE, mine, {0, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("block_generations"));
  EXPECT_EQ(PoolBlock(mine[0]), std::string(1024, 'a'));

  // A block freed (and reallocated to acme again) since: the stale generation is ABORTED.
  ASSERT_TRUE(pool_->Free({&mine[1], 1}, kOwner, {&acme_gens[1], 1}).ok());
  std::vector<uint64_t> all_gens;
  const std::vector<BlockId> rest =
      Allocate(static_cast<uint32_t>(pool_->Stats().free_blocks), kAcmeNs, &all_gens);
  ASSERT_NE(std::find(rest.begin(), rest.end(), mine[1]), rest.end());
  s = CopyStatus(*acme, v1::LOCAL_DIRECTION_LOAD, mine, {0, 1}, acme_gens);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  s = CopyStatus(*acme, v1::LOCAL_DIRECTION_STORE, mine, {0, 1}, acme_gens);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(RegionBytes(*region), before);
  EXPECT_EQ(PoolBlock(mine[0]), std::string(1024, 'a'));

  // A committed block is immutable: STORE is FAILED_PRECONDITION; LOAD still reads it.
  const CommitEntry entry{.block = mine[0], .page = PageHash{1, 2}, .parent = PageHash{}};
  ASSERT_TRUE(pool_->Commit(kAcmeNs, kOwner, {&entry, 1}, "entries").ok());
  s = CopyStatus(*acme, v1::LOCAL_DIRECTION_STORE, {mine[0]}, {0}, {acme_gens[0]});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(PoolBlock(mine[0]), std::string(1024, 'a'));
  ASSERT_TRUE(CopyStatus(*acme, v1::LOCAL_DIRECTION_LOAD, {mine[0]}, {1}).ok());
  EXPECT_EQ(EngineBlock(*region, 1), std::string(1024, 'a'));

  // Malformed copies: INVALID_ARGUMENT naming the field.
  struct Bad {
    std::vector<BlockId> ids;
    std::vector<uint32_t> engine;
    v1::LocalDirection dir;
    const char* field;
  };
  const Bad bad[] = {
      {{}, {}, v1::LOCAL_DIRECTION_LOAD, "block_ids"},
      {{mine[0]}, {}, v1::LOCAL_DIRECTION_LOAD, "engine_blocks"},
      {{mine[0]}, {kEngineBlocks}, v1::LOCAL_DIRECTION_LOAD, "engine_blocks[0]"},
      {{mine[0], rest[0]}, {1, 1}, v1::LOCAL_DIRECTION_LOAD, "engine_blocks[1]"},
      {{mine[0], mine[0]}, {0, 1}, v1::LOCAL_DIRECTION_LOAD, "block_ids"},
      {{mine[0]}, {0}, v1::LOCAL_DIRECTION_UNSPECIFIED, "direction"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.field);
    s = CopyStatus(*acme, b.dir, b.ids, b.engine);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(b.field));
  }
}

TEST_F(LocalSessionTest, PageVerifiedLoadRefusesABlockRecommittedToAnotherPage) {
  StartServer(false);
  auto c = Connect();
  auto region = Region();
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(2, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'x');
  WritePool(ids[1], gens[1], 'y');
  const PageHash p0{0x1111, 0x2222}, p1{0x3333, 0x4444}, other{0x5555, 0x6666};
  const CommitEntry entries[] = {{.block = ids[0], .page = p0}, {.block = ids[1], .page = p1}};
  ASSERT_TRUE(pool_->Commit(kAcmeNs, kOwner, entries, "entries").ok());
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0, 1}, {}, {p0, p1}, &kAcmeNs).ok());
  EXPECT_EQ(EngineBlock(*region, 0), std::string(1024, 'x'));

  // The pin was lost: block 1 evicted, reallocated, rewritten and committed to another page.
  ASSERT_TRUE(pool_->FreeCommitted({&ids[1], 1}, kOwner, "ids").ok());
  std::vector<uint64_t> gens2;
  const std::vector<BlockId> rest =
      Allocate(static_cast<uint32_t>(pool_->Stats().free_blocks), kAcmeNs, &gens2);
  const size_t at = std::find(rest.begin(), rest.end(), ids[1]) - rest.begin();
  ASSERT_LT(at, rest.size());
  WritePool(ids[1], gens2[at], 'z');
  const CommitEntry again{.block = ids[1], .page = other};
  ASSERT_TRUE(pool_->Commit(kAcmeNs, kOwner, {&again, 1}, "entries").ok());

  std::memset(region->data(), 0, region->size());
  const std::string before = RegionBytes(*region);
  absl::Status s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0, 1}, {}, {p0, p1}, &kAcmeNs);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("block ", ids[1], " no longer holds page ", p1.ToHex())));
  EXPECT_EQ(RegionBytes(*region), before);  // not even block 0, which still holds p0
  // The same page in another namespace is another page.
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, {ids[0]}, {0}, {}, {p0}, &kEvilNs);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(RegionBytes(*region), before);
  // Malformed page checks, and one on a STORE.
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0, 1}, {}, {p0}, &kAcmeNs);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("page_hashes"));
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0, 1}, {}, {p0, p1}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("namespace"));
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_STORE, {rest[0]}, {0}, {gens2[0]}, {p0}, &kAcmeNs);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RegionBytes(*region), before);
  // Without the check the new page's bytes are read (what the check exists to prevent).
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, {ids[1]}, {1}).ok());
  EXPECT_EQ(EngineBlock(*region, 1), std::string(1024, 'z'));
}

TEST_F(LocalSessionTest, PageVerifiedReadBlocksRefusesABlockRecommittedToAnotherPage) {
  authenticator_ = Authenticator::Open();
  BlockAgentService service(&options_, AgentPools{.main = pool_.get()}, &epoch_, &metrics_,
                            /*fetcher=*/nullptr, authenticator_.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::BlockAgent::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));

  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(2, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'x');
  WritePool(ids[1], gens[1], 'y');
  const PageHash p0{0x1111, 0x2222}, p1{0x3333, 0x4444};
  const CommitEntry entries[] = {{.block = ids[0], .page = p0}, {.block = ids[1], .page = p1}};
  ASSERT_TRUE(pool_->Commit(kAcmeNs, kOwner, entries, "entries").ok());

  auto read = [&](const std::vector<PageHash>& pages, const NamespaceId* ns,
                  std::string* got) -> grpc::Status {
    v1::ReadBlocksRequest req;
    req.mutable_block_ids()->Add(ids.begin(), ids.end());
    req.set_owner_epoch(kOwner);
    if (ns != nullptr) NamespaceToProto(*ns, req.mutable_namespace_());
    req.set_page_hashes(EncodePageHashes(pages));
    grpc::ClientContext ctx;
    auto reader = stub->ReadBlocks(&ctx, req);
    v1::ReadBlocksResponse chunk;
    got->clear();
    while (reader->Read(&chunk)) *got += chunk.data();
    return reader->Finish();
  };
  std::string got;
  ASSERT_TRUE(read({p0, p1}, &kAcmeNs, &got).ok());
  EXPECT_EQ(got, std::string(1024, 'x') + std::string(1024, 'y'));
  EXPECT_EQ(read({p0}, &kAcmeNs, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(read({p0, p1}, nullptr, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Block 0 recommitted to another page: no byte of it is sent.
  ASSERT_TRUE(pool_->FreeCommitted({&ids[0], 1}, kOwner, "ids").ok());
  std::vector<uint64_t> gens2;
  const std::vector<BlockId> rest =
      Allocate(static_cast<uint32_t>(pool_->Stats().free_blocks), kAcmeNs, &gens2);
  const size_t at = std::find(rest.begin(), rest.end(), ids[0]) - rest.begin();
  ASSERT_LT(at, rest.size());
  WritePool(ids[0], gens2[at], 'z');
  const CommitEntry again{.block = ids[0], .page = PageHash{9, 9}};
  ASSERT_TRUE(pool_->Commit(kAcmeNs, kOwner, {&again, 1}, "entries").ok());
  const grpc::Status s = read({p0, p1}, &kAcmeNs, &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("no longer holds page ", p0.ToHex())));
  EXPECT_EQ(got.find('z'), std::string::npos);
  EXPECT_TRUE(got.empty());
  server->Shutdown();
}

TEST_F(LocalSessionTest, GarbageGetsAnErrorAndTheSessionSurvives) {
  StartServer(false);
  auto c = Connect();
  auto region = Region();
  std::mt19937 rng(42);
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(2, kAcmeNs, &gens);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
    }
    // Random bytes (a few parse as a LocalRequest; none may crash or wedge the agent).
    for (int i = 0; i < 300; ++i) {
      std::string junk(1 + rng() % 2000, '\0');
      for (char& ch : junk) ch = static_cast<char>(rng());
      const int fd = region->fd();
      absl::StatusOr<v1::LocalReply> r =
          i % 10 == 0 ? c->CallRaw(junk, {&fd, 1}) : c->CallRaw(junk);
      ASSERT_TRUE(r.ok()) << r.status();
    }
    // Well-formed copies with random fields.
    for (int i = 0; i < 300; ++i) {
      v1::LocalRequest req;
      v1::LocalCopy* copy = req.mutable_copy();
      copy->set_direction(static_cast<v1::LocalDirection>(rng() % 4));
      copy->set_tier(static_cast<v1::Tier>(rng() % 5));
      copy->set_owner_epoch(rng() % 2 == 0 ? kOwner : rng());
      const int n = static_cast<int>(rng() % 4);
      for (int k = 0; k < n; ++k) {
        copy->add_block_ids(rng() % 3 == 0 ? rng() : rng() % (kPoolBlocks + 2));
        copy->add_engine_blocks(rng() % 3 == 0 ? rng() : rng() % (kEngineBlocks + 1));
        if (rng() % 2 == 0) copy->add_block_generations(rng() % 2 == 0 ? gens[0] : rng());
      }
      if (rng() % 3 == 0) copy->set_page_hashes(std::string(rng() % 40, 'h'));
      if (rng() % 3 == 0) NamespaceToProto(kAcmeNs, copy->mutable_namespace_());
      absl::StatusOr<v1::LocalReply> r = c->Call(req);
      ASSERT_TRUE(r.ok()) << r.status();
    }
    // Neither a hello nor a copy.
    absl::StatusOr<v1::LocalReply> r = c->Call(v1::LocalRequest());
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->code(), static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  }
  // Still serving, with the region of the one hello.
  WritePool(ids[0], gens[0], 'q');
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, {ids[0]}, {3}).ok());
  EXPECT_EQ(EngineBlock(*region, 3), std::string(1024, 'q'));
}

// A region with holes would make the agent's copies allocate them (shared memory charged to
// the agent): a hello whose region has one is refused, changing nothing (no seal added, no
// page allocated); an accepted region is sealed so that no hole can be punched afterwards.
TEST_F(LocalSessionTest, ARegionWithHolesIsRefusedAndNoneCanBePunchedAfterTheHello) {
  StartServer(false);
  auto c = Connect();
  const auto allocated = [](const MemfdRegion& r) {
    struct stat st {};
    EXPECT_EQ(fstat(r.fd(), &st), 0);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  };
  // 1 GiB the engine never touched (the sparse memfd).
  constexpr uint64_t kSparse = uint64_t{1} << 30;
  auto sparse = MemfdRegion::Create(kSparse, /*seal=*/true, /*allocate=*/false);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  v1::LocalHello big = GoodHello();
  big.set_region_bytes(kSparse);
  absl::Status s = Hello(*c, **sparse, big);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("allocate"));
  EXPECT_EQ(allocated(**sparse), 0u);
  EXPECT_EQ(fcntl((*sparse)->fd(), F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);
  // Allocated but for one page in the middle (st_blocks alone would not see it: the file is
  // larger than the region).
  auto holed = Region(kRegion + 4096);
  ASSERT_EQ(fallocate(holed->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  s = Hello(*c, *holed, GoodHello());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("1 of the region's 1 pages are not allocated"));
  EXPECT_EQ(fcntl(holed->fd(), F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);
  // Nothing registered.
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(1, kAcmeNs, &gens);
  s = CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;

  // An allocated region registers and is sealed: the engine can no longer punch holes
  // (fallocate, madvise MADV_REMOVE) nor map it writable anew; its own mapping still works.
  auto region = Region();
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  EXPECT_NE(fcntl(region->fd(), F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);
  EXPECT_NE(fallocate(region->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(madvise(region->data(), 4096, MADV_REMOVE), 0);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, region->fd(), 0), MAP_FAILED);
  EXPECT_EQ(allocated(*region), kRegion);
  region->data()[0] = std::byte{1};
  WritePool(ids[0], gens[0], 'z');
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {1}).ok());
  EXPECT_EQ(EngineBlock(*region, 1), std::string(1024, 'z'));
  EXPECT_EQ(allocated(*region), kRegion);
}

// A connection that registers no region within hello_timeout_ms is closed, however much
// else it sends; one that does stays.
TEST_F(LocalSessionTest, AConnectionWithoutAHelloInTimeIsClosed) {
  StartServer(false, {.max_sessions = 2, .hello_timeout_ms = 300});
  auto silent = Connect();
  auto chatty = Connect();
  const absl::Time start = absl::Now();
  // Garbage keeps getting replies until the deadline, then the connection is gone.
  absl::Status last;
  while (absl::Now() - start < absl::Seconds(3)) {
    absl::StatusOr<v1::LocalReply> r = chatty->CallRaw("junk");
    if (!r.ok()) {
      last = r.status();
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kUnavailable) << last;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  char byte;
  EXPECT_EQ(recv(silent->fd(), &byte, 1, 0), 0);  // hung up by the agent
  EXPECT_THAT(metrics_.RenderText(), HasSubstr("result=\"hello_timeout\"} 2"));
  // Their slots are free again; a session that registered in time outlives the deadline.
  for (int i = 0; i < 200 && server_->active_sessions() > 0; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  auto c = Connect();
  auto region = Region();
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  absl::SleepFor(absl::Milliseconds(500));
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(1, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'h');
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, ids, {0}).ok());
  EXPECT_EQ(EngineBlock(*region, 0), std::string(1024, 'h'));
}

// Peers are admitted by SO_PEERCRED: by default the agent's own uid; with a list, a listed
// uid or gid. One uid holds at most max_sessions_per_uid connections.
TEST_F(LocalSessionTest, PeersAreAdmittedByCredentialsAndCappedPerUid) {
  const uint32_t me = geteuid();
  const uint32_t other = me + 4242;
  // Not listed: closed as accepted, counted.
  StartServer(false, {.allowed_uids = {other}});
  {
    auto c = Connect();
    auto region = Region();
    EXPECT_EQ(Hello(*c, *region, GoodHello()).code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(server_->refused(), 1u);
    EXPECT_THAT(metrics_.RenderText(), HasSubstr("result=\"not_allowed\"} 1"));
    EXPECT_EQ(fcntl(region->fd(), F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);  // never seen
  }
  server_.reset();
  // Admitted by its gid.
  StartServer(false, {.allowed_uids = {other}, .allowed_gids = {static_cast<uint32_t>(getegid())}});
  {
    auto c = Connect();
    EXPECT_TRUE(Hello(*c, *Region(), GoodHello()).ok());
  }
  server_.reset();
  // By its uid, at most 2 at once.
  StartServer(false, {.max_sessions = 64, .max_sessions_per_uid = 2, .allowed_uids = {other, me}});
  auto a = Connect();
  auto b = Connect();
  ASSERT_TRUE(Hello(*a, *Region(), GoodHello()).ok());
  auto third = Connect();  // b has no hello yet: it counts all the same
  EXPECT_EQ(Hello(*third, *Region(), GoodHello()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server_->refused(), 1u);
  EXPECT_THAT(metrics_.RenderText(), HasSubstr("result=\"uid_limit\"} 1"));
  ASSERT_TRUE(Hello(*b, *Region(), GoodHello()).ok());
  a.reset();
  for (int i = 0; i < 200 && server_->active_sessions() > 1; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  auto fourth = Connect();
  EXPECT_TRUE(Hello(*fourth, *Region(), GoodHello()).ok());
}

TEST_F(LocalSessionTest, ASocketGroupMakesTheSocketGroupReadable) {
  StartServer(false, {.socket_group = std::to_string(getegid())});
  struct stat st {};
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, getegid());
  server_.reset();
  absl::StatusOr<std::unique_ptr<LocalSocketServer>> s =
      LocalSocketServer::Start({.path = path_, .socket_group = "no-such-group-kvcm"},
                               LocalSessionEnv{.options = &options_,
                                               .pools = AgentPools{.main = pool_.get()},
                                               .authenticator = authenticator_.get()});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
}

// A session whose token was revoked (the tokens file reloaded without it) is refused its
// next copy, UNAUTHENTICATED, and closed; nothing moves.
TEST_F(LocalSessionTest, ARevokedTokensSessionIsRefusedAndClosed) {
  StartServer(true);
  auto acme = Connect();
  auto evil = Connect();
  auto region = Region();
  auto evil_region = Region();
  Fill(*region, 3);
  ASSERT_TRUE(Hello(*acme, *region, GoodHello(kAcme)).ok());
  ASSERT_TRUE(Hello(*evil, *evil_region, GoodHello(kEvil)).ok());
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(1, kAcmeNs, &gens);
  WritePool(ids[0], gens[0], 'a');
  ASSERT_TRUE(CopyStatus(*acme, v1::LOCAL_DIRECTION_LOAD, ids, {0}).ok());
  // acme's token revoked: the file rewritten without it (another size), then reloaded.
  {
    std::FILE* f = std::fopen(tokens_path_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(absl::StrCat(Sha256Hex(kEvil), " evil-vllm roles=worker tenant=evil\n").c_str(), f);
    std::fclose(f);
  }
  ASSERT_TRUE(authenticator_->ReloadIfChanged().ok());
  const std::string before = RegionBytes(*region);
  WritePool(ids[0], gens[0], 'b');
  absl::StatusOr<v1::LocalReply> r = Copy(*acme, v1::LOCAL_DIRECTION_LOAD, ids, {1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->code(), static_cast<uint32_t>(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(r->message(), HasSubstr("session is closed"));
  EXPECT_EQ(r->blocks_copied(), 0u);
  EXPECT_EQ(RegionBytes(*region), before);
  // A STORE is refused the same way (the connection is closed now).
  r = Copy(*acme, v1::LOCAL_DIRECTION_STORE, ids, {1}, gens);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_EQ(PoolBlock(ids[0]), std::string(1024, 'b'));
  EXPECT_THAT(metrics_.RenderText(), HasSubstr("result=\"revoked\"} 1"));
  // A token still in the file keeps its session.
  EXPECT_EQ(CopyStatus(*evil, v1::LOCAL_DIRECTION_LOAD, ids, {0}).code(),
            absl::StatusCode::kPermissionDenied);  // acme's block, as before
}

// A principal bound to uids (local_principal_uids) is refused from any other.
TEST_F(LocalSessionTest, ATokenBoundToOtherUidsIsRefused) {
  StartServer(true, {.principal_uids = {{"acme-vllm", {geteuid() + 1}},
                                        {"evil-vllm", {geteuid() + 1, geteuid()}}}});
  auto c = Connect();
  auto region = Region();
  const absl::Status s = Hello(*c, *region, GoodHello(kAcme));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("local_principal_uids"));
  EXPECT_EQ(fcntl(region->fd(), F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);  // nothing mapped
  EXPECT_TRUE(Hello(*c, *region, GoodHello(kEvil)).ok());
}

// Copies in chunks of one segment (the smallest) move exactly the bytes of one call.
TEST_F(LocalSessionTest, ChunkedCopiesMoveTheSameBytes) {
  options_.local_copy_chunk_bytes = 1;  // one segment per hold of the lock
  StartServer(false);
  auto c = Connect();
  auto region = Region();
  Fill(*region, 9);
  ASSERT_TRUE(Hello(*c, *region, GoodHello()).ok());
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = Allocate(3, kAcmeNs, &gens);
  absl::StatusOr<v1::LocalReply> r = Copy(*c, v1::LOCAL_DIRECTION_STORE, ids, {2, 0, 3}, gens);
  ASSERT_TRUE(r.ok() && r->code() == 0) << (r.ok() ? r->message() : r.status().ToString());
  EXPECT_EQ(r->blocks_copied(), 3u);
  EXPECT_EQ(PoolBlock(ids[0]), EngineBlock(*region, 2));
  EXPECT_EQ(PoolBlock(ids[1]), EngineBlock(*region, 0));
  EXPECT_EQ(PoolBlock(ids[2]), EngineBlock(*region, 3));
  const std::string b2 = EngineBlock(*region, 2), b3 = EngineBlock(*region, 3);
  ASSERT_TRUE(CopyStatus(*c, v1::LOCAL_DIRECTION_LOAD, {ids[0], ids[2]}, {3, 1}).ok());
  EXPECT_EQ(EngineBlock(*region, 3), b2);
  EXPECT_EQ(EngineBlock(*region, 1), b3);
}

TEST_F(LocalSessionTest, ConnectionsOverTheLimitAreClosed) {
  StartServer(false, {.max_sessions = 2});
  auto a = Connect();
  auto b = Connect();
  auto region = Region();
  ASSERT_TRUE(Hello(*a, *region, GoodHello()).ok());  // both accepted and served
  ASSERT_TRUE(Hello(*b, *Region(), GoodHello()).ok());
  auto third = Connect();
  absl::StatusOr<v1::LocalReply> r = third->Call(v1::LocalRequest());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_EQ(server_->refused(), 1u);
  EXPECT_THAT(metrics_.RenderText(), HasSubstr("result=\"refused\"} 1"));
  // One session ends: a new connection is served again.
  a.reset();
  for (int i = 0; i < 200 && server_->active_sessions() > 1; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  auto fourth = Connect();
  EXPECT_TRUE(Hello(*fourth, *Region(), GoodHello()).ok());
  // A memfd registers once: the first hello sealed it, so another session cannot map it.
  auto fifth_region = Region();
  const absl::Status s = Hello(*fourth, *region, GoodHello());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;  // fourth has a region
  b.reset();
  for (int i = 0; i < 200 && server_->active_sessions() > 1; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  auto fifth = Connect();
  const absl::Status again = Hello(*fifth, *region, GoodHello());
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument) << again;
  EXPECT_THAT(again.message(), HasSubstr("register a new memfd"));
  EXPECT_TRUE(Hello(*fifth, *fifth_region, GoodHello()).ok());
}

}  // namespace
}  // namespace kvcm
