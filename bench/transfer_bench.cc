// kvcm_transfer_bench: the TCP Transport pulling whole DeepSeek-V3 blocks (1 and 64 per
// transfer) from one host pool into another over loopback, in plaintext and over mutual TLS
// (the data port of agents that do not run insecure; throw-away certificates from
// scripts/make_test_certs.sh), beside raw loopback TCP moving the same bytes from one buffer
// to another in the same run (a sender thread, a receiver, the same socket options), and
// raw TCP again between the very blocks of the two pools the pulls read and write
// (pool-sized memory, not a buffer the cache holds). Medians of wall time, and of the CPU
// time each arm took (all threads; a busy machine's scheduling inflates wall time, not it).
// The ratios are what the transport costs over the wire itself (the connection, the
// framing, the pool checks and lock per piece, and, against the first raw arm, memory the
// cache does not hold) and what TLS costs over plaintext (the handshake, one per pull, and
// AES-GCM both ways). A line says whether kernel TLS would be available here.
//
//   kvcm_transfer_bench [--smoke] [--reps=N]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/opensslconf.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "bench/smoke_flag.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/transport/data_tls.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"

namespace kvcm {
namespace {

constexpr uint64_t kEpoch = 1;
const NamespaceId kNs{"acme", "deepseek-v3"};

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::unique_ptr<BlockPool> HostPool(const ModelSpec& spec, uint64_t blocks) {
  PoolGeometry g{.spec = spec, .num_blocks = blocks};
  std::unique_ptr<DeviceBackend> backend = *CreateHostBackend(g.pool_bytes());
  return *BlockPool::Create(g, std::move(backend));
}

// Raw loopback TCP: srcs[i] to dsts[i] (each `chunk` bytes), in order, from one thread to
// another; seconds. Null entries: one block-sized buffer of each thread's own, reused (hot
// in the cache).
double RawLoopback(std::vector<const std::byte*> srcs, std::vector<std::byte*> dsts,
                   uint64_t chunk) {
  std::vector<std::byte> src_buffer(chunk, std::byte{'x'}), dst_buffer(chunk);
  for (const std::byte*& p : srcs) p = p != nullptr ? p : src_buffer.data();
  for (std::byte*& p : dsts) p = p != nullptr ? p : dst_buffer.data();
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  listen(listener, 1);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::thread sender([&] {
    const int fd = accept(listener, nullptr, nullptr);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    for (const std::byte* src : srcs) {
      for (size_t off = 0; off < chunk;) {
        const ssize_t s = send(fd, src + off, chunk - off, MSG_NOSIGNAL);
        if (s <= 0) break;
        off += static_cast<size_t>(s);
      }
    }
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const auto start = std::chrono::steady_clock::now();
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  for (std::byte* dst : dsts) {
    for (size_t got = 0; got < chunk;) {
      const ssize_t r = recv(fd, dst + got, chunk - got, 0);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
  }
  const double s = Seconds(std::chrono::steady_clock::now() - start);
  sender.join();
  close(fd);
  close(listener);
  return s;
}

// Whether this kernel offers kernel TLS (the "tls" upper-layer protocol on a connected TCP
// socket) and OpenSSL was built for it. The data port does not use it (it encrypts in
// OpenSSL, data_tls.h); the line says whether that choice could matter on this machine.
std::string KernelTlsProbe() {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  listen(listener, 1);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const bool ulp = setsockopt(fd, SOL_TCP, TCP_ULP, "tls", sizeof("tls")) == 0;
  const std::string why = ulp ? "available" : absl::StrCat("unavailable (", strerror(errno), ")");
  close(fd);
  close(listener);
#ifdef OPENSSL_NO_KTLS
  const char* openssl = "without kTLS";
#else
  const char* openssl = "with kTLS";
#endif
  return absl::StrCat("kernel TLS: not used; the kernel's tls ULP ", why, ", ",
                      OpenSSL_version(OPENSSL_VERSION), " built ", openssl);
}

// Agent `name`'s data-port TLS from certificates made in `dir`.
absl::StatusOr<std::shared_ptr<DataTls>> TestTls(const std::string& dir, const std::string& name) {
  return DataTls::Create({.cert_file = absl::StrCat(dir, "/", name, ".pem"),
                          .key_file = absl::StrCat(dir, "/", name, ".key"),
                          .ca_file = absl::StrCat(dir, "/ca.pem")});
}

// CPU seconds this process has used, all threads (the serving and pulling transports, both
// raw TCP ends): the work an arm costs, which a busy machine's scheduling does not inflate
// as it does wall time.
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// Median of `v`, which it sorts.
double Median(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One pull of `spec` through `t`; seconds, or a negative number when it failed.
double TimedPull(Transport& t, const PullSpec& spec) {
  absl::Notification done;
  absl::StatusOr<TransferStats> result;
  const auto start = std::chrono::steady_clock::now();
  t.Pull(spec, [&](absl::StatusOr<TransferStats> s) {
    result = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  const double seconds = Seconds(std::chrono::steady_clock::now() - start);
  if (!result.ok()) {
    std::fprintf(stderr, "pull failed: %s\n", result.status().ToString().c_str());
    return -1;
  }
  return seconds;
}

int Run(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm_transfer_bench",
                       "kvcm_transfer_bench [--smoke] [--reps=N]: whole blocks pulled between host "
                       "pools over TCP, plaintext and mutual TLS");
  std::vector<char*> args;
  const bool smoke = bench::TakeSmokeFlag(argc, argv, &args);
  int reps = 5;
  for (size_t i = 1; i < args.size(); ++i) {
    if (std::strncmp(args[i], "--reps=", 7) == 0 && absl::SimpleAtoi(args[i] + 7, &reps) &&
        reps > 0) {
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--reps=N]\n", argv[0]);
      return 2;
    }
  }
  ModelSpec spec = *FindModel("deepseek-v3");
  if (smoke) {
    spec.num_layers = 2;
    reps = 1;
  }
  const uint64_t max_blocks = 64;
  std::unique_ptr<BlockPool> a = HostPool(spec, max_blocks);
  std::unique_ptr<BlockPool> b = HostPool(spec, max_blocks);
  const uint64_t block_bytes = a->geometry().bytes_per_block();

  // A holds max_blocks committed pages; B max_blocks allocated blocks to pull into.
  std::vector<BlockId> from = *a->Allocate(max_blocks, kEpoch, &kNs);
  std::vector<CommitEntry> entries;
  for (uint64_t i = 0; i < max_blocks; ++i) {
    entries.push_back({.block = from[i], .page = PageHash{i + 1, i}, .parent = PageHash{i, i - 1}});
  }
  entries[0].parent = PageHash{};
  if (!a->Commit(kNs, kEpoch, entries, "block_ids").ok()) return 1;
  std::vector<BlockId> into = *b->Allocate(max_blocks, kEpoch, &kNs);
  std::unique_ptr<Transport> ta = *MakeTcpTransport({}, AgentPools{.main = a.get()}, Tier::kGpu);
  std::unique_ptr<Transport> tb = *MakeTcpTransport({}, AgentPools{.main = b.get()}, Tier::kGpu);

  char dir[] = "/tmp/kvcm_transfer_bench_XXXXXX";
  if (mkdtemp(dir) == nullptr) return 1;
  const std::string make_certs =
      absl::StrCat("'", KVCM_MAKE_TEST_CERTS, "' ", dir, " agent-a agent-b >/dev/null");
  if (std::system(make_certs.c_str()) != 0) {
    std::fprintf(stderr, "%s failed\n", make_certs.c_str());
    return 1;
  }
  absl::StatusOr<std::shared_ptr<DataTls>> tls_a = TestTls(dir, "agent-a");
  absl::StatusOr<std::shared_ptr<DataTls>> tls_b = TestTls(dir, "agent-b");
  std::system(absl::StrCat("rm -rf ", dir).c_str());  // loaded: the files may go
  if (!tls_a.ok() || !tls_b.ok()) {
    std::fprintf(stderr, "TLS: %s %s\n", tls_a.status().ToString().c_str(),
                 tls_b.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<Transport> ta_tls =
      *MakeTcpTransport({.tls = *tls_a}, AgentPools{.main = a.get()}, Tier::kGpu);
  std::unique_ptr<Transport> tb_tls =
      *MakeTcpTransport({.tls = *tls_b}, AgentPools{.main = b.get()}, Tier::kGpu);

  absl::PrintF("block %d bytes (DeepSeek-V3 bf16, %d layers), %d reps, median\n", block_bytes,
               spec.num_layers, reps);
  absl::PrintF("%s\n", KernelTlsProbe());
  absl::PrintF("%-7s %11s %11s %11s %11s %11s %11s %9s %9s %11s %11s %11s %12s %14s\n", "blocks",
               "plain", "tls", "raw tcp", "plain GB/s", "tls GB/s", "raw GB/s", "plain/raw",
               "tls/plain", "plain cpu", "tls cpu", "raw cpu", "raw in pools", "plain/raw pool");
  for (uint64_t n : {uint64_t{1}, max_blocks}) {
    std::vector<double> plains, tlss, raws, raw_pools, plain_cpus, tls_cpus, raw_cpus;
    for (int r = 0; r < reps; ++r) {
      PullSpec spec_n{.ns = kNs,
                      .peer_blocks = {from.begin(), from.begin() + n},
                      .dst = b.get(),
                      .dst_blocks = {into.begin(), into.begin() + n},
                      .dst_owner_epoch = kEpoch};
      for (uint64_t i = 0; i < n; ++i) spec_n.pages.push_back(entries[i].page);
      spec_n.peer_address = ta->address();
      double cpu = CpuSeconds();
      plains.push_back(TimedPull(*tb, spec_n));
      plain_cpus.push_back(CpuSeconds() - cpu);
      spec_n.peer_address = ta_tls->address();
      cpu = CpuSeconds();
      tlss.push_back(TimedPull(*tb_tls, spec_n));
      tls_cpus.push_back(CpuSeconds() - cpu);
      if (plains.back() < 0 || tlss.back() < 0) return 1;
      cpu = CpuSeconds();
      raws.push_back(
          RawLoopback(std::vector<const std::byte*>(n), std::vector<std::byte*>(n), block_bytes));
      raw_cpus.push_back(CpuSeconds() - cpu);
      // The same raw TCP between the arenas' blocks the pull reads and writes (B's blocks
      // are the bench's, allocated and never committed): what the pools' memory costs.
      std::vector<const std::byte*> srcs;
      std::vector<std::byte*> dsts;
      for (uint64_t i = 0; i < n; ++i) {
        srcs.push_back(a->backend().base() + a->BlockOffset(from[i]));
        dsts.push_back(b->backend().base() + b->BlockOffset(into[i]));
      }
      raw_pools.push_back(RawLoopback(srcs, dsts, block_bytes));
    }
    const double plain = Median(plains), tls = Median(tlss), raw = Median(raws),
                 raw_pool = Median(raw_pools);
    const double gb = static_cast<double>(n * block_bytes) / 1e9;
    absl::PrintF(
        "%-7d %8.2f ms %8.2f ms %8.2f ms %11.2f %11.2f %11.2f %8.0f%% %8.0f%% %8.1f ms %8.1f ms "
        "%8.1f ms %9.2f ms %13.0f%%\n",
        n, plain * 1e3, tls * 1e3, raw * 1e3, gb / plain, gb / tls, gb / raw, 100 * raw / plain,
        100 * plain / tls, Median(plain_cpus) * 1e3, Median(tls_cpus) * 1e3, Median(raw_cpus) * 1e3,
        raw_pool * 1e3, 100 * raw_pool / plain);
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Run(argc, argv); }
