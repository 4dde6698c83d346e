// kvcm::Client against a real in-process ManagerServer on a loopback port.
#include "client/client.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 16;

// DeepSeek-V3's MLA cache: 70,272 bytes per token (ARCHITECTURE.md section 4).
ModelSpec DeepSeekV3() {
  ModelSpec spec;
  spec.attention = AttentionKind::kMla;
  spec.num_layers = 61;
  spec.num_heads = 128;
  spec.kv_lora_rank = 512;
  spec.rope_dim = 64;
  spec.dtype = KvDtype::kBf16;
  spec.page_size_tokens = kPageSize;
  return spec;
}

// `pages` whole pages plus `extra` tokens, all derived from `seed`.
std::vector<int32_t> Prompt(int pages, int seed, int extra = 0) {
  std::vector<int32_t> tokens(pages * kPageSize + extra);
  std::iota(tokens.begin(), tokens.end(), seed * 100'000);
  return tokens;
}

std::vector<BlockId> Blocks(BlockId first, int n) {
  std::vector<BlockId> ids(n);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

// A loopback socket bound to port 0; listens when asked (and never accepts), so that
// connections hang in the HTTP/2 handshake.
class LoopbackSocket {
 public:
  explicit LoopbackSocket(bool listen_for_connections) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
        (listen_for_connections && listen(fd_, 16) != 0)) {
      ADD_FAILURE() << "cannot bind a loopback socket";
      return;
    }
    port_ = ntohs(addr.sin_port);
  }
  ~LoopbackSocket() { Close(); }
  void Close() {
    if (fd_ >= 0) {
      close(fd_);
    }
    fd_ = -1;
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A port nothing listens on (bound, then closed; the kernel will not hand it out again at
// once).
int UnusedPort() { return LoopbackSocket(/*listen_for_connections=*/false).port(); }

ServerOptions TestServerOptions(int port, std::string secret_hex) {
  ServerOptions options;
  options.tls.insecure = true;
  options.listen_address = absl::StrCat("127.0.0.1:", port);
  options.metrics_address = "";
  options.hash_secret_hex = std::move(secret_hex);
  options.shutdown_grace_ms = 100;
  return options;
}

std::unique_ptr<ManagerServer> StartServer(int port = 0,
                                           std::string secret_hex = std::string(32, 'a')) {
  absl::StatusOr<std::unique_ptr<ManagerServer>> server =
      ManagerServer::Start(TestServerOptions(port, std::move(secret_hex)));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

std::unique_ptr<Client> ConnectTo(int port, ClientOptions options = {}) {
  options.address = absl::StrCat("127.0.0.1:", port);
  options.insecure = true;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer();
    ASSERT_NE(server_, nullptr);
    client_ = ConnectTo(server_->port());
    ASSERT_NE(client_, nullptr);
  }

  uint64_t ActivePins() {
    absl::StatusOr<ManagerStats> stats = client_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->active_pins : ~uint64_t{0};
  }

  const NamespaceId ns_{"acme", "deepseek-v3"};
  const PoolRef gpu0_{"agent-0", Tier::kGpu};
  std::unique_ptr<ManagerServer> server_;
  std::unique_ptr<Client> client_;
};

TEST(ClientOptionsTest, ValidateNamesTheBadField) {
  const ClientOptions plaintext{.insecure = true};
  EXPECT_TRUE(plaintext.Validate().ok());
  ClientOptions o = plaintext;
  o.address = "";
  EXPECT_THAT(o.Validate().message(), HasSubstr("address"));
  o = plaintext;
  o.max_attempts = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_attempts"));
  o = plaintext;
  o.default_deadline_ms = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("default_deadline_ms"));
  o = plaintext;
  o.max_backoff_ms = o.initial_backoff_ms - 1;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_backoff_ms"));
  o = plaintext;
  o.backoff_multiplier = 0.5;
  EXPECT_THAT(o.Validate().message(), HasSubstr("backoff_multiplier"));
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = plaintext;
  o.token = "two words";
  EXPECT_THAT(o.Validate().message(), HasSubstr("token"));
}

TEST(ClientOptionsTest, TransportSecurityIsChosenExplicitly) {
  auto validate = [](ClientOptions o) { return o.Validate(); };
  EXPECT_THAT(validate({}).message(), HasSubstr("ca_file: is required"));
  EXPECT_THAT(validate({}).message(), HasSubstr("insecure = true"));
  EXPECT_TRUE(validate({.ca_file = "ca.pem"}).ok());
  EXPECT_THAT(validate({.ca_file = "ca.pem", .cert_file = "c.pem"}).message(),
              HasSubstr("key_file"));
  EXPECT_THAT(validate({.ca_file = "ca.pem", .insecure = true}).message(),
              HasSubstr("insecure excludes ca_file"));
  // The files are read at Connect, which names the one that is missing.
  absl::Status missing = Client::Connect({.ca_file = "/nonexistent/ca.pem"}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("ca_file \"/nonexistent/ca.pem\""));
}

TEST_F(ClientTest, RegisterInsertMatchReleaseRoundTrip) {
  absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, DeepSeekV3());
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(reg->created);
  EXPECT_EQ(reg->bytes_per_token, 70'272u);
  EXPECT_EQ(reg->bytes_per_page, 70'272u * kPageSize);
  EXPECT_TRUE(client_->HashesLocally(ns_));
  absl::StatusOr<RegisterModelReply> again = client_->RegisterModel(ns_, DeepSeekV3());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->created);

  // Four whole pages and a partial one, which is never cached.
  const std::vector<int32_t> tokens = Prompt(4, 1, /*extra=*/5);
  absl::StatusOr<InsertReply> ins = client_->Insert(ns_, tokens, gpu0_, Blocks(10, 4));
  ASSERT_TRUE(ins.ok()) << ins.status();
  EXPECT_EQ(ins->new_pages, 4u);
  EXPECT_EQ(ins->already_present_pages, 0u);

  MatchParams params;
  params.requester_agent_id = "agent-0";
  params.pin = true;
  absl::StatusOr<MatchReply> m = client_->Match(ns_, tokens, params);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->prompt_pages, 4u);
  EXPECT_EQ(m->matched_pages, 4u);
  EXPECT_EQ(m->matched_tokens, 4 * kPageSize);
  EXPECT_EQ(m->local_pages, 4u);
  ASSERT_EQ(m->segments.size(), 1u);
  EXPECT_EQ(m->segments[0].first_page, 0u);
  EXPECT_EQ(m->segments[0].num_pages, 4u);
  ASSERT_EQ(m->segments[0].replicas.size(), 1u);
  EXPECT_EQ(m->segments[0].replicas[0].pool, gpu0_);
  EXPECT_THAT(m->segments[0].replicas[0].block_ids, ElementsAre(10, 11, 12, 13));
  EXPECT_NE(m->pin_id, 0u);
  EXPECT_GT(m->lease_expiry, absl::Now());
  EXPECT_LT(m->lease_expiry, absl::Now() + absl::Minutes(11));
  EXPECT_EQ(ActivePins(), 1u);

  absl::StatusOr<absl::Time> renewed = client_->RenewLease(ns_, m->pin_id, 120'000);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_GT(*renewed, absl::Now() + absl::Seconds(100));

  ASSERT_TRUE(client_->Release(ns_, m->pin_id).ok());
  EXPECT_EQ(ActivePins(), 0u);
  EXPECT_EQ(client_->Release(ns_, m->pin_id).code(), absl::StatusCode::kNotFound);

  // Insert is idempotent and reports the index's blocks of what was already there.
  absl::StatusOr<InsertReply> dup = client_->Insert(ns_, tokens, gpu0_, Blocks(50, 4));
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_EQ(dup->already_present_pages, 4u);
  EXPECT_EQ(dup->new_pages, 0u);
  EXPECT_THAT(dup->existing_block_ids, ElementsAre(10, 11, 12, 13));

  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->namespaces.size(), 1u);
  EXPECT_EQ(stats->namespaces[0].ns, ns_);
  EXPECT_EQ(stats->namespaces[0].pages, 4u);
  EXPECT_EQ(stats->namespaces[0].bytes_per_token, 70'272u);
  ASSERT_EQ(stats->pools.size(), 1u);
  EXPECT_EQ(stats->pools[0].pool, gpu0_);
  EXPECT_EQ(stats->pools[0].used_bytes, 4 * reg->bytes_per_page);
  EXPECT_EQ(stats->counters.pins_taken, 1u);
  EXPECT_EQ(stats->counters.pins_released, 1u);
  EXPECT_EQ(stats->counters.matched_tokens, 4 * kPageSize);
}

TEST_F(ClientTest, LocalHashingMatchesWhatTheManagerHashes) {
  ASSERT_TRUE(client_->RegisterModel(ns_, DeepSeekV3()).ok());
  std::unique_ptr<Client> tokens_client = ConnectTo(server_->port());
  ASSERT_FALSE(tokens_client->HashesLocally(ns_));

  const std::vector<int32_t> prompt = Prompt(5, 2, /*extra=*/3);
  absl::StatusOr<std::vector<PageHash>> local = client_->HashPrompt(ns_, prompt);
  ASSERT_TRUE(local.ok()) << local.status();
  absl::StatusOr<std::vector<PageHash>> manager = server_->index().HashTokens(ns_, prompt);
  ASSERT_TRUE(manager.ok()) << manager.status();
  EXPECT_EQ(*local, *manager);
  EXPECT_EQ(local->size(), 5u);

  // Pages inserted as tokens are found by hashes, and the other way round.
  const std::span<const int32_t> first3(prompt.data(), size_t{3} * kPageSize);
  ASSERT_TRUE(tokens_client->Insert(ns_, first3, gpu0_, Blocks(0, 3)).ok());
  const PoolRef host1{"agent-1", Tier::kHost};
  ASSERT_TRUE(client_->Insert(ns_, prompt, host1, Blocks(100, 5)).ok());

  MatchParams params;
  params.requester_agent_id = "agent-0";
  absl::StatusOr<MatchReply> by_tokens = tokens_client->Match(ns_, prompt, params);
  absl::StatusOr<MatchReply> by_local_hash = client_->Match(ns_, prompt, params);
  absl::StatusOr<MatchReply> by_given_hash = client_->MatchHashes(ns_, *local, params);
  for (const auto* m : {&by_tokens, &by_local_hash, &by_given_hash}) {
    ASSERT_TRUE(m->ok()) << m->status();
    EXPECT_EQ((*m)->matched_pages, 5u);
    EXPECT_EQ((*m)->local_pages, 3u);
    ASSERT_EQ((*m)->segments.size(), 2u);
    EXPECT_EQ((*m)->segments[0].num_pages, 3u);
    ASSERT_EQ((*m)->segments[0].replicas.size(), 2u);
    EXPECT_EQ((*m)->segments[0].replicas[0].pool, gpu0_);  // the requester's agent first
    EXPECT_EQ((*m)->segments[1].first_page, 3u);
    EXPECT_THAT((*m)->segments[1].replicas[0].block_ids, ElementsAre(103, 104));
  }

  // A tampered hash is a miss from that page on, never a wrong match.
  std::vector<PageHash> tampered = *local;
  tampered[2].lo ^= 1;
  absl::StatusOr<MatchReply> partial = client_->MatchHashes(ns_, tampered);
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_EQ(partial->matched_pages, 2u);
}

TEST_F(ClientTest, HashesNeedARegisteredNamespace) {
  const std::vector<int32_t> prompt = Prompt(2, 3);
  EXPECT_EQ(client_->HashPrompt(ns_, prompt).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->MatchHashes(ns_, std::vector<PageHash>(2)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      client_->InsertHashes(ns_, std::vector<PageHash>(2), gpu0_, Blocks(0, 2)).status().code(),
      absl::StatusCode::kFailedPrecondition);
  // Sending tokens reaches the manager, which does not know the namespace.
  EXPECT_EQ(client_->Match(ns_, prompt).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, RegisterModelCarriesTheMaxPageAge) {
  absl::StatusOr<RegisterModelReply> reg =
      client_->RegisterModel(ns_, DeepSeekV3(), {.max_page_age_s = 600});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->max_page_age_s, 600u);
  reg = client_->RegisterModel(ns_, DeepSeekV3(), {.max_page_age_s = 3600});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->max_page_age_s, 600u) << "a limit only tightens";
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->namespaces.size(), 1u);
  EXPECT_EQ(stats->namespaces[0].max_page_age_s, 600u);
  EXPECT_EQ(stats->namespaces[0].expired_pages, 0u);
  EXPECT_EQ(stats->counters.expired_pages, 0u);
  const absl::Status absurd =
      client_->RegisterModel(ns_, DeepSeekV3(), {.max_page_age_s = kMaxPageAgeS + 1}).status();
  EXPECT_EQ(absurd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(absurd.message(), HasSubstr("max_page_age_s"));
}

TEST_F(ClientTest, ManagerErrorsKeepTheirCodeAndMessage) {
  ModelSpec bad = DeepSeekV3();
  bad.num_layers = 0;
  absl::Status s = client_->RegisterModel(ns_, bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_layers"));

  ASSERT_TRUE(client_->RegisterModel(ns_, DeepSeekV3()).ok());
  ModelSpec other = DeepSeekV3();
  other.num_layers = 27;
  EXPECT_EQ(client_->RegisterModel(ns_, other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // One block id short.
  EXPECT_EQ(client_->Insert(ns_, Prompt(3, 4), gpu0_, Blocks(0, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  MatchParams probe;
  probe.probe = true;
  EXPECT_EQ(client_->MatchAndPin(ns_, Prompt(1, 4), probe).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, PinnedPrefixReleasesOnceWhenDestroyed) {
  ASSERT_TRUE(client_->RegisterModel(ns_, DeepSeekV3()).ok());
  const std::vector<int32_t> prompt = Prompt(3, 5);
  ASSERT_TRUE(client_->Insert(ns_, prompt, gpu0_, Blocks(0, 3)).ok());

  {
    absl::StatusOr<PinnedPrefix> pin = client_->MatchAndPin(ns_, prompt);
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_NE(pin->pin_id(), 0u);
    EXPECT_EQ(pin->match().matched_pages, 3u);
    EXPECT_EQ(ActivePins(), 1u);
  }
  EXPECT_EQ(ActivePins(), 0u);

  absl::StatusOr<PinnedPrefix> first = client_->MatchAndPin(ns_, prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t pin_id = first->pin_id();
  {
    std::optional<PinnedPrefix> moved_from(*std::move(first));
    PinnedPrefix owner(std::move(*moved_from));
    EXPECT_EQ(moved_from->pin_id(), 0u);
    EXPECT_EQ(owner.pin_id(), pin_id);
    const uint64_t calls = client_->counters().calls;
    moved_from.reset();  // releases nothing
    EXPECT_EQ(client_->counters().calls, calls);
    EXPECT_EQ(ActivePins(), 1u);

    ASSERT_TRUE(owner.Renew(90'000).ok());
    EXPECT_GT(owner.match().lease_expiry, absl::Now() + absl::Seconds(80));
    EXPECT_TRUE(owner.Release().ok());
    EXPECT_EQ(owner.pin_id(), 0u);
    EXPECT_EQ(owner.Renew(1000).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(ActivePins(), 0u);
  }  // owner already released: its destructor sends nothing more.
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->counters.pins_taken, 2u);
  EXPECT_EQ(stats->counters.pins_released, 2u);

  // Move-assignment releases the pin the target held.
  absl::StatusOr<PinnedPrefix> a = client_->MatchAndPin(ns_, prompt);
  absl::StatusOr<PinnedPrefix> b = client_->MatchAndPin(ns_, prompt);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ActivePins(), 2u);
  *a = *std::move(b);
  EXPECT_EQ(ActivePins(), 1u);
  a->Release().IgnoreError();
  EXPECT_EQ(ActivePins(), 0u);

  // Nothing matched: no pin, nothing to release.
  absl::StatusOr<PinnedPrefix> none = client_->MatchAndPin(ns_, Prompt(2, 6));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->pin_id(), 0u);
  EXPECT_TRUE(none->Release().ok());
}

TEST_F(ClientTest, EvictFromPoolAndNamespace) {
  absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, DeepSeekV3());
  ASSERT_TRUE(reg.ok());
  ASSERT_TRUE(client_->Insert(ns_, Prompt(4, 7), gpu0_, Blocks(0, 4)).ok());
  ASSERT_TRUE(client_->Insert(ns_, Prompt(2, 8), gpu0_, Blocks(4, 2)).ok());

  absl::StatusOr<EvictReply> one = client_->EvictFromPool(gpu0_, reg->bytes_per_page);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_GE(one->evicted_bytes, reg->bytes_per_page);
  EXPECT_EQ(one->evicted_bytes, one->evicted_pages * reg->bytes_per_page);

  EXPECT_EQ(client_->EvictFromNamespace(ns_, 100 * reg->bytes_per_page).status().code(),
            absl::StatusCode::kOutOfRange);
  absl::StatusOr<EvictReply> rest = client_->EvictFromNamespace(ns_, 1);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_GE(rest->evicted_pages, 1u);
  EXPECT_EQ(client_->EvictFromNamespace(NamespaceId{"nobody", "x"}, 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, ReserveHoldsHeadroomAndErrorsChangeNothing) {
  absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, DeepSeekV3());
  ASSERT_TRUE(reg.ok());
  ASSERT_TRUE(client_->Insert(ns_, Prompt(2, 7), gpu0_, Blocks(0, 2)).ok());
  absl::StatusOr<uint64_t> evicted = client_->Reserve(gpu0_, 3 * reg->bytes_per_page);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(*evicted, 0u);  // the default pool capacity is large
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->pools.size(), 1u);
  EXPECT_EQ(stats->pools[0].reserved_bytes, 3 * reg->bytes_per_page);

  EXPECT_EQ(client_->Unreserve(gpu0_, 4 * reg->bytes_per_page).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->Reserve(gpu0_, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Reserve(PoolRef{"nobody", Tier::kGpu}, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Stats()->pools[0].reserved_bytes, 3 * reg->bytes_per_page);
  ASSERT_TRUE(client_->Unreserve(gpu0_, 3 * reg->bytes_per_page).ok());
  EXPECT_EQ(client_->Stats()->pools[0].reserved_bytes, 0u);
}

TEST_F(ClientTest, WatchEventsDeliversStoredPagesUntilCancelled) {
  ASSERT_TRUE(client_->RegisterModel(ns_, DeepSeekV3()).ok());
  absl::Mutex mu;
  std::vector<WatchedEvent> events;
  std::unique_ptr<EventWatch> watch = client_->WatchEvents(ns_, [&](const WatchedEvent& e) {
    absl::MutexLock lock(&mu);
    events.push_back(e);
  });

  // The subscription is live once an event arrives; insert fresh prompts until one does.
  std::vector<std::vector<int32_t>> inserted;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  bool got = false;
  for (int i = 0; !got && absl::Now() < give_up; ++i) {
    inserted.push_back(Prompt(2, 100 + i));
    ASSERT_TRUE(client_->Insert(ns_, inserted.back(), gpu0_, Blocks(2 * i, 2)).ok());
    absl::MutexLock lock(&mu);
    got =
        mu.AwaitWithTimeout(absl::Condition(
                                +[](std::vector<WatchedEvent>* e) { return !e->empty(); }, &events),
                            absl::Milliseconds(200));
  }
  ASSERT_TRUE(got) << "no event within 10 s";
  watch->Cancel();
  EXPECT_EQ(watch->Wait().code(), absl::StatusCode::kCancelled);

  absl::MutexLock lock(&mu);
  const WatchedEvent& e = events.front();
  EXPECT_EQ(e.kind, WatchedEvent::Kind::kStored);
  EXPECT_EQ(e.ns, ns_);
  EXPECT_EQ(e.pool, gpu0_);
  bool known = false;
  for (const std::vector<int32_t>& prompt : inserted) {
    known = known || e.pages == *client_->HashPrompt(ns_, prompt);
  }
  EXPECT_TRUE(known) << "the event's pages are not those of any inserted prompt";
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].sequence, events[i - 1].sequence + 1);
  }
}

TEST_F(ClientTest, ConcurrentCallsOnOneClient) {
  ASSERT_TRUE(client_->RegisterModel(ns_, DeepSeekV3()).ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const PoolRef pool{absl::StrCat("agent-", t), Tier::kGpu};
      for (int i = 0; i < 25; ++i) {
        const std::vector<int32_t> prompt = Prompt(2, 1000 + 100 * t + i);
        absl::StatusOr<InsertReply> ins = client_->Insert(ns_, prompt, pool, Blocks(2 * i, 2));
        absl::StatusOr<PinnedPrefix> pin = client_->MatchAndPin(ns_, prompt);
        if (!ins.ok() || !pin.ok() || pin->match().matched_pages != 2) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ActivePins(), 0u);
}

// The manager restarts with another secret and forgets everything: the client's cached key
// is stale. It re-registers with the spec it remembers and carries on.
TEST(ClientRestartTest, StaleHashKeyIsRefreshedByReRegistering) {
  const NamespaceId ns{"acme", "deepseek-v3"};
  const PoolRef pool{"agent-0", Tier::kGpu};
  std::unique_ptr<ManagerServer> server = StartServer(0, std::string(32, '1'));
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  std::unique_ptr<Client> client = ConnectTo(port);
  std::unique_ptr<Client> other = ConnectTo(port);
  ASSERT_TRUE(client->RegisterModel(ns, DeepSeekV3()).ok());
  const std::vector<int32_t> prompt = Prompt(3, 9);
  ASSERT_TRUE(client->Insert(ns, prompt, pool, Blocks(0, 3)).ok());

  // Restart 1: the namespace is gone (NOT_FOUND for the hashes) until re-registered.
  server->Shutdown();
  server = StartServer(port, std::string(32, '2'));
  ASSERT_NE(server, nullptr);
  absl::StatusOr<MatchReply> miss = client->Match(ns, prompt);
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_EQ(miss->matched_pages, 0u);
  ASSERT_TRUE(client->Insert(ns, prompt, pool, Blocks(0, 3)).ok());
  EXPECT_EQ(*client->HashPrompt(ns, prompt), *server->index().HashTokens(ns, prompt));

  // Restart 2: someone else registers first, so the namespace exists under a key this
  // client does not have (FAILED_PRECONDITION for its hashes).
  server->Shutdown();
  server = StartServer(port, std::string(32, '3'));
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(other->RegisterModel(ns, DeepSeekV3()).ok());
  ASSERT_TRUE(other->Insert(ns, prompt, pool, Blocks(0, 3)).ok());
  const uint64_t calls_before = client->counters().calls;
  absl::StatusOr<MatchReply> hit = client->Match(ns, prompt);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched_pages, 3u);
  // Hashes sent and refused, re-registered, hashes sent again: the client hashed locally.
  EXPECT_EQ(client->counters().calls - calls_before, 3u);
  EXPECT_EQ(*client->HashPrompt(ns, prompt), *server->index().HashTokens(ns, prompt));
}

// A socket that accepts connections but never speaks: the call waits for its deadline.
TEST(ClientDeadlineTest, TinyDeadlineExpiresAndIsNotRetried) {
  LoopbackSocket blackhole(/*listen_for_connections=*/true);
  ClientOptions options;
  options.max_attempts = 5;
  std::unique_ptr<Client> client = ConnectTo(blackhole.port(), options);
  const absl::Time start = absl::Now();
  absl::Status s = client->Stats(CallOptions{.deadline_ms = 100}).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, absl::Milliseconds(90));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_EQ(client->counters().attempts, 1u);
}

TEST(ClientDeadlineTest, NothingListeningFailsFastWithBoundedRetries) {
  ClientOptions options;
  options.max_attempts = 3;
  options.initial_backoff_ms = 10;
  options.max_backoff_ms = 40;
  std::unique_ptr<Client> client = ConnectTo(UnusedPort(), options);
  const absl::Time start = absl::Now();
  absl::Status s = client->Stats(CallOptions{.deadline_ms = 2000}).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_LT(took, absl::Seconds(1));
  EXPECT_EQ(client->counters().calls, 1u);
  EXPECT_LE(client->counters().attempts, 3u);
  EXPECT_LE(client->counters().retries, 2u);

  // A deadline shorter than the backoff: no retry is attempted past it.
  options.max_attempts = 100;
  options.initial_backoff_ms = 500;
  options.max_backoff_ms = 500;
  std::unique_ptr<Client> patient = ConnectTo(UnusedPort(), options);
  const absl::Time start2 = absl::Now();
  absl::Status s2 = patient->Stats(CallOptions{.deadline_ms = 50}).status();
  EXPECT_THAT(s2.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start2, absl::Milliseconds(400));
  EXPECT_EQ(patient->counters().attempts, 1u);
}

// The defaults ride out a manager takeover: the deployed etcd lease (5 s) plus an election.
TEST(ClientRetryTest, DefaultScheduleSpansATakeover) {
  const ClientOptions options;
  EXPECT_GE(options.default_deadline_ms, 8000);
  // Equal jitter sleeps at least half of each backoff; the attempts still span 8 s.
  double backoff_ms = static_cast<double>(options.initial_backoff_ms);
  double slept_ms = 0;
  for (int i = 1; i < options.max_attempts; ++i) {
    slept_ms += backoff_ms / 2;
    backoff_ms = std::min(backoff_ms * options.backoff_multiplier,
                          static_cast<double>(options.max_backoff_ms));
  }
  EXPECT_GE(slept_ms, 8000);
  EXPECT_LT(options.non_idempotent_max_attempts, options.max_attempts);
}

TEST(ClientRetryTest, DefaultPolicyWaitsOutAManagerGoneForThreeSeconds) {
  const int port = UnusedPort();
  std::unique_ptr<Client> client = ConnectTo(port, ClientOptions{});
  std::unique_ptr<ManagerServer> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Seconds(3));
    server = StartServer(port);
  });
  const absl::Time start = absl::Now();
  absl::StatusOr<ManagerStats> stats = client->Stats();  // default deadline and retries
  starter.join();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(2500));
  EXPECT_GE(client->counters().retries, 1u);
}

TEST(ClientRetryTest, NonIdempotentCallsMakeTheirOwnAttempts) {
  ClientOptions options;
  options.non_idempotent_max_attempts = 2;
  options.initial_backoff_ms = 10;
  std::unique_ptr<Client> client = ConnectTo(UnusedPort(), options);
  absl::Status s = client->Reserve(PoolRef{"gpu-0", Tier::kGpu}, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("(after 2 attempts)"));
  EXPECT_EQ(client->counters().attempts, 2u);
  options.non_idempotent_max_attempts = 0;
  EXPECT_THAT(options.Validate().message(), HasSubstr("non_idempotent_max_attempts"));
}

// The retry sets come from the proto's idempotency_level; this pins them: a repeat of any
// of these would evict or reserve again, so it gets non_idempotent_max_attempts.
TEST(ClientRetryTest, TheProtoSaysWhichCallsRetryFully) {
  const google::protobuf::ServiceDescriptor* service =
      v1::MatchRequest::descriptor()->file()->FindServiceByName("CacheManager");
  ASSERT_NE(service, nullptr);
  std::vector<std::string> not_fully;
  for (int i = 0; i < service->method_count(); ++i) {
    if (!RetriesFully(*service->method(i))) not_fully.push_back(service->method(i)->name());
  }
  EXPECT_THAT(not_fully,
              ::testing::UnorderedElementsAre("Evict", "ForgetAgent", "Reserve", "Unreserve"));
}

TEST(ClientRetryTest, CallSucceedsOnceTheManagerStarts) {
  const int port = UnusedPort();
  ClientOptions options;
  options.max_attempts = 50;
  options.initial_backoff_ms = 20;
  options.max_backoff_ms = 200;
  std::unique_ptr<Client> client = ConnectTo(port, options);

  std::unique_ptr<ManagerServer> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    server = StartServer(port);
  });
  absl::StatusOr<ManagerStats> stats = client->Stats(CallOptions{.deadline_ms = 5000});
  starter.join();
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->active_pins, 0u);
  EXPECT_GE(client->counters().retries, 1u);
  EXPECT_LE(client->counters().attempts, 50u);
}

}  // namespace
}  // namespace kvcm
