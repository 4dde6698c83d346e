// The local data path with a GPU engine's memory (LocalHello cuda_ipc, cuda_ipc_region.cc):
// an exporter process (this binary run with --cuda_ipc_exporter: CUDA IPC handles cannot be
// opened by the process that exported them) cudaMallocs two allocations with known bytes and
// exports their handles; a LocalSession opens them, STOREs engine blocks into a pool (on the
// GPU and in host memory) and LOADs them back into other engine blocks, bit for bit; and
// refusals (a wrong-size handle, an unknown bus id, a segment past its allocation, a handle
// the driver refuses) open nothing. Label `gpu`; skips when no CUDA device is usable.
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/agent/local/local_client.h"
#include "gpu/agent/local/local_session.h"
#include "gpu/agent/pool/device_backend.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

extern char** environ;

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr char kExporterFlag[] = "--cuda_ipc_exporter";
constexpr uint64_t kOwner = 7;
constexpr uint64_t kPoolBlocks = 8;
// The engine: 8 blocks of SmallGqa's 2 layers (segments) of 512 bytes. Layer 0 sits 256
// bytes into allocation A (as PyTorch's caching allocator places a tensor inside a larger
// block), layer 1 at the start of allocation B.
constexpr uint32_t kEngineBlocks = 8;
constexpr uint64_t kSegment = 512;
constexpr uint64_t kAllocBytes = 16384;
constexpr uint64_t kOffsetA = 256;
constexpr uint64_t kOffsetB = 0;
constexpr size_t kBusIdBytes = 32;
const NamespaceId kNs{"acme", "meta/small-gqa"};

// Allocation a's bytes as the exporter writes them.
std::string Pattern(int a) {
  std::mt19937 rng(100 + a);
  std::string out(kAllocBytes, '\0');
  for (char& c : out) c = static_cast<char>(rng() & 0xFF);
  return out;
}

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The exporter (a fresh process, CUDA untouched before): writes the device's PCI bus id
// (kBusIdBytes, NUL-padded) and the handles of allocations A and B to stdout; then for each
// 'd' on stdin writes both allocations' bytes; exits on 'q' or end of input.
int RunExporter() {
  const auto fail = [](const char* what, cudaError_t err) {
    std::fprintf(stderr, "exporter: %s: %s\n", what, cudaGetErrorName(err));
    return 1;
  };
  cudaError_t err = cudaSetDevice(0);
  if (err != cudaSuccess) return fail("cudaSetDevice", err);
  std::array<void*, 2> ptr{};
  std::array<cudaIpcMemHandle_t, 2> handle{};
  for (int a = 0; a < 2; ++a) {
    if ((err = cudaMalloc(&ptr[a], kAllocBytes)) != cudaSuccess) return fail("cudaMalloc", err);
    const std::string bytes = Pattern(a);
    err = cudaMemcpy(ptr[a], bytes.data(), kAllocBytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return fail("cudaMemcpy", err);
    if ((err = cudaIpcGetMemHandle(&handle[a], ptr[a])) != cudaSuccess) {
      return fail("cudaIpcGetMemHandle", err);
    }
  }
  char bus[kBusIdBytes] = {};
  if ((err = cudaDeviceGetPCIBusId(bus, sizeof(bus), 0)) != cudaSuccess) {
    return fail("cudaDeviceGetPCIBusId", err);
  }
  if (!WriteAll(1, bus, sizeof(bus)) || !WriteAll(1, handle.data(), sizeof(handle))) return 1;
  std::string host(kAllocBytes, '\0');
  char cmd = 0;
  while (ReadAll(0, &cmd, 1) && cmd == 'd') {
    for (int a = 0; a < 2; ++a) {
      err = cudaMemcpy(host.data(), ptr[a], kAllocBytes, cudaMemcpyDeviceToHost);
      if (err != cudaSuccess) return fail("cudaMemcpy", err);
      if (!WriteAll(1, host.data(), host.size())) return 1;
    }
  }
  for (void* p : ptr) cudaFree(p);
  return 0;
}

// The exporter process, from the test's side.
class Exporter {
 public:
  // Starts it and reads what it exports; a failure is a test failure (and ok() false).
  Exporter() {
    int to[2], from[2];
    if (pipe(to) != 0 || pipe(from) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      return;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from[1], 1);
    posix_spawn_file_actions_addclose(&actions, to[1]);
    posix_spawn_file_actions_addclose(&actions, from[0]);
    char exe[] = "/proc/self/exe";
    std::string flag = kExporterFlag;
    char* argv[] = {exe, flag.data(), nullptr};
    const int rc = posix_spawn(&pid_, exe, &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to[0]);
    close(from[1]);
    to_ = to[1];
    from_ = from[0];
    if (rc != 0) {
      ADD_FAILURE() << "posix_spawn: " << std::strerror(rc);
      pid_ = -1;
      return;
    }
    char bus[kBusIdBytes];
    std::array<char, 128> handles;
    if (!ReadAll(from_, bus, sizeof(bus)) || !ReadAll(from_, handles.data(), handles.size())) {
      ADD_FAILURE() << "the exporter did not export (see its stderr)";
      return;
    }
    bus_id_.assign(bus, strnlen(bus, sizeof(bus)));
    handle_[0].assign(handles.data(), 64);
    handle_[1].assign(handles.data() + 64, 64);
    ok_ = true;
  }
  ~Exporter() {
    if (to_ >= 0) {
      WriteAll(to_, "q", 1);
      close(to_);
    }
    if (from_ >= 0) close(from_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exporter status " << status;
    }
  }

  bool ok() const { return ok_; }
  const std::string& bus_id() const { return bus_id_; }
  const std::string& handle(int a) const { return handle_[a]; }

  // Both allocations' bytes as the exporter's device holds them now.
  std::array<std::string, 2> Dump() {
    std::array<std::string, 2> out{std::string(kAllocBytes, '\0'), std::string(kAllocBytes, '\0')};
    EXPECT_TRUE(WriteAll(to_, "d", 1));
    for (std::string& s : out) EXPECT_TRUE(ReadAll(from_, s.data(), s.size()));
    return out;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  bool ok_ = false;
  std::string bus_id_;
  std::array<std::string, 2> handle_;
};

// Engine block e of allocations `alloc` (A, B) as an agent block: its two segments.
std::string EngineBlock(const std::array<std::string, 2>& alloc, uint32_t e) {
  return alloc[0].substr(kOffsetA + e * kSegment, kSegment) +
         alloc[1].substr(kOffsetB + e * kSegment, kSegment);
}

class CudaIpcRegionTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    absl::StatusOr<int> n = CudaDeviceCount();
    if (!n.ok() || *n < 1) {
      GTEST_SKIP() << "no CUDA device, CUDA IPC regions are not exercised: "
                   << (n.ok() ? "0 devices" : n.status().ToString());
    }
    const PoolGeometry g{SmallGqa(), kPoolBlocks};
    absl::StatusOr<std::unique_ptr<DeviceBackend>> backend =
        GetParam() ? CreateCudaBackend(0, g.pool_bytes()) : CreateHostBackend(g.pool_bytes());
    ASSERT_TRUE(backend.ok()) << backend.status();
    absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(g, *std::move(backend));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
  }

  std::unique_ptr<LocalSession> Session() {
    return std::make_unique<LocalSession>(LocalSessionEnv{.options = &options_,
                                                          .pools = AgentPools{.main = pool_.get()},
                                                          .epoch = &epoch_,
                                                          .authenticator = authenticator_.get()},
                                          "test engine", getuid());
  }

  // Segment 0 in allocation A at kOffsetA, segment 1 in B at kOffsetB.
  static v1::LocalHello CudaHello(const Exporter& e) {
    v1::LocalHello h;
    h.set_region_bytes(kAllocBytes);
    h.add_segment_offsets(kOffsetA);
    h.add_segment_offsets(kOffsetB);
    h.set_segment_bytes(kSegment);
    h.set_segment_stride(kSegment);
    h.set_num_engine_blocks(kEngineBlocks);
    h.mutable_cuda_ipc()->set_pci_bus_id(e.bus_id());
    h.mutable_cuda_ipc()->add_segment_handles(e.handle(0));
    h.mutable_cuda_ipc()->add_segment_handles(e.handle(1));
    return h;
  }

  static absl::Status Call(LocalSession& s, const v1::LocalRequest& req,
                           v1::LocalReply* out = nullptr) {
    const v1::LocalReply reply = s.Handle(req.SerializeAsString(), {});
    if (out != nullptr) *out = reply;
    return LocalReplyStatus(reply);
  }
  static absl::Status Hello(LocalSession& s, const v1::LocalHello& h) {
    v1::LocalRequest req;
    *req.mutable_hello() = h;
    return Call(s, req);
  }
  static absl::Status Copy(LocalSession& s, v1::LocalDirection dir, const std::vector<BlockId>& ids,
                           const std::vector<uint32_t>& engine) {
    v1::LocalRequest req;
    v1::LocalCopy* c = req.mutable_copy();
    c->set_direction(dir);
    c->set_owner_epoch(kOwner);
    c->mutable_block_ids()->Add(ids.begin(), ids.end());
    c->mutable_engine_blocks()->Add(engine.begin(), engine.end());
    return Call(s, req);
  }

  std::string PoolBlock(BlockId id) {
    std::string out(pool_->geometry().bytes_per_block(), '\0');
    EXPECT_TRUE(pool_->ReadBlock(id, kOwner, 0, std::as_writable_bytes(std::span<char>(out))).ok());
    return out;
  }

  std::vector<BlockId> Allocate(uint32_t n) {
    absl::StatusOr<std::vector<BlockId>> ids = pool_->Allocate(n, kOwner, &kNs, nullptr);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<BlockId>{};
  }

  AgentOptions options_;
  AgentEpoch epoch_;
  std::unique_ptr<Authenticator> authenticator_ = Authenticator::Open();
  std::unique_ptr<BlockPool> pool_;
};

TEST_P(CudaIpcRegionTest, StoreThenLoadRoundTripsBitForBit) {
  Exporter exporter;
  ASSERT_TRUE(exporter.ok());
  const std::array<std::string, 2> original = {Pattern(0), Pattern(1)};
  ASSERT_EQ(exporter.Dump(), original);
  auto session = Session();
  ASSERT_TRUE(Hello(*session, CudaHello(exporter)).ok());
  ASSERT_TRUE(session->registered());

  const std::vector<BlockId> ids = Allocate(3);
  ASSERT_TRUE(Copy(*session, v1::LOCAL_DIRECTION_STORE, ids, {5, 0, 7}).ok());
  EXPECT_EQ(PoolBlock(ids[0]), EngineBlock(original, 5));
  EXPECT_EQ(PoolBlock(ids[1]), EngineBlock(original, 0));
  EXPECT_EQ(PoolBlock(ids[2]), EngineBlock(original, 7));

  ASSERT_TRUE(Copy(*session, v1::LOCAL_DIRECTION_LOAD, ids, {1, 3, 6}).ok());
  // Engine blocks 1, 3 and 6 now hold 5, 0 and 7; every other byte is as exported.
  std::array<std::string, 2> want = original;
  const std::pair<uint32_t, uint32_t> moved[] = {{5, 1}, {0, 3}, {7, 6}};
  for (const auto& [from, to] : moved) {
    want[0].replace(kOffsetA + to * kSegment, kSegment,
                    original[0].substr(kOffsetA + from * kSegment, kSegment));
    want[1].replace(kOffsetB + to * kSegment, kSegment,
                    original[1].substr(kOffsetB + from * kSegment, kSegment));
  }
  EXPECT_EQ(exporter.Dump(), want);
}

// K and V of one layer in one tensor: both segments name allocation A, opened once.
TEST_P(CudaIpcRegionTest, SegmentsMayShareAnAllocation) {
  Exporter exporter;
  ASSERT_TRUE(exporter.ok());
  v1::LocalHello h = CudaHello(exporter);
  h.set_segment_offsets(1, kOffsetA + kEngineBlocks * kSegment);
  h.mutable_cuda_ipc()->set_segment_handles(1, exporter.handle(0));
  auto session = Session();
  ASSERT_TRUE(Hello(*session, h).ok());
  const std::vector<BlockId> ids = Allocate(1);
  ASSERT_TRUE(Copy(*session, v1::LOCAL_DIRECTION_STORE, ids, {2}).ok());
  const std::string a = Pattern(0);
  EXPECT_EQ(PoolBlock(ids[0]), a.substr(kOffsetA + 2 * kSegment, kSegment) +
                                   a.substr(kOffsetA + (kEngineBlocks + 2) * kSegment, kSegment));
}

TEST_P(CudaIpcRegionTest, RefusedHellosOpenNothing) {
  Exporter exporter;
  ASSERT_TRUE(exporter.ok());
  auto session = Session();
  struct Case {
    const char* name;
    void (*edit)(v1::LocalHello&);
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"wrong size handle",
       [](v1::LocalHello& h) { h.mutable_cuda_ipc()->mutable_segment_handles(0)->push_back('\0'); },
       absl::StatusCode::kInvalidArgument, "cuda_ipc.segment_handles[0]"},
      {"unknown bus id",
       [](v1::LocalHello& h) { h.mutable_cuda_ipc()->set_pci_bus_id("ffff:ff:1f.7"); },
       absl::StatusCode::kFailedPrecondition, "cuda_ipc.pci_bus_id"},
      {"a handle the driver refuses",
       [](v1::LocalHello& h) {
         h.mutable_cuda_ipc()->set_segment_handles(1, std::string(64, '\0'));
       },
       absl::StatusCode::kFailedPrecondition, "cuda_ipc.segment_handles[1]: cudaIpcOpenMemHandle"},
      {"segment past its allocation",
       [](v1::LocalHello& h) {
         h.set_region_bytes(2 * kAllocBytes);
         h.set_segment_offsets(1, kAllocBytes - kEngineBlocks * kSegment + 1);
       },
       absl::StatusCode::kInvalidArgument, "segment_offsets[1]"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    v1::LocalHello h = CudaHello(exporter);
    k.edit(h);
    const absl::Status s = Hello(*session, h);
    EXPECT_EQ(s.code(), k.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(k.message));
    EXPECT_FALSE(session->registered());
  }
  // The same session then registers the real thing.
  ASSERT_TRUE(Hello(*session, CudaHello(exporter)).ok());
  const std::vector<BlockId> ids = Allocate(1);
  ASSERT_TRUE(Copy(*session, v1::LOCAL_DIRECTION_STORE, ids, {4}).ok());
  EXPECT_EQ(PoolBlock(ids[0]), EngineBlock({Pattern(0), Pattern(1)}, 4));
}

INSTANTIATE_TEST_SUITE_P(Pools, CudaIpcRegionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("CudaPool") : std::string("HostPool");
                         });

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kvcm::kExporterFlag) return kvcm::RunExporter();
  // A write to an exporter that died fails with EPIPE (the test reports it), not a signal.
  signal(SIGPIPE, SIG_IGN);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
