#include "client/client.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/tls_hint.h"
#include "client/wire.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

namespace kvcm {

// RouteParams::Policy goes on the wire by its value (Route below).
static_assert(static_cast<int>(RouteParams::Policy::kPrefillSaved) ==
              v1::ROUTE_POLICY_PREFILL_SAVED);
static_assert(static_cast<int>(RouteParams::Policy::kRoundRobin) == v1::ROUTE_POLICY_ROUND_ROBIN);
static_assert(static_cast<int>(RouteParams::Policy::kFirstPageHash) ==
              v1::ROUTE_POLICY_FIRST_PAGE_HASH);
static_assert(static_cast<int>(RouteParams::Policy::kLeastLoaded) == v1::ROUTE_POLICY_LEAST_LOADED);
static_assert(v1::RoutePolicy_MAX == v1::ROUTE_POLICY_LEAST_LOADED);

namespace {

// CallOptions::reply: a copy of a successful call's reply for a caller that asked.
void CopyReply(const CallOptions& call, const google::protobuf::Message& response) {
  if (call.reply != nullptr) call.reply->CopyFrom(response);
}

// CacheManager's method `name`. REQUIRES: it exists (callers name their own RPC).
const google::protobuf::MethodDescriptor& Method(absl::string_view name) {
  static const google::protobuf::ServiceDescriptor* const service =
      v1::MatchRequest::descriptor()->file()->FindServiceByName("CacheManager");
  const google::protobuf::MethodDescriptor* m = service->FindMethodByName(std::string(name));
  if (m == nullptr) {
    LogError(absl::StrCat("kvcm client: CacheManager has no method ", name));
    std::abort();
  }
  return *m;
}

}  // namespace

bool RetriesFully(const google::protobuf::MethodDescriptor& method) {
  return method.options().idempotency_level() !=
         google::protobuf::MethodOptions::IDEMPOTENCY_UNKNOWN;
}

struct Client::Rpc {
  ChannelFactory channels;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::CacheManager::Stub> stub;
};

absl::Status ClientOptions::Validate() const {
  if (address.empty()) {
    return absl::InvalidArgumentError("address: must not be empty");
  }
  if (default_deadline_ms <= 0) {
    return absl::InvalidArgumentError("default_deadline_ms: must be > 0");
  }
  if (max_attempts < 1 || max_attempts > 100) {
    return absl::InvalidArgumentError("max_attempts: must be in 1..100");
  }
  if (non_idempotent_max_attempts < 1 || non_idempotent_max_attempts > 100) {
    return absl::InvalidArgumentError("non_idempotent_max_attempts: must be in 1..100");
  }
  if (initial_backoff_ms <= 0) {
    return absl::InvalidArgumentError("initial_backoff_ms: must be > 0");
  }
  if (max_backoff_ms < initial_backoff_ms) {
    return absl::InvalidArgumentError("max_backoff_ms: must be >= initial_backoff_ms");
  }
  if (!(backoff_multiplier >= 1.0)) {
    return absl::InvalidArgumentError("backoff_multiplier: must be >= 1");
  }
  // TlsOptions' fields carry the same names as these.
  if (absl::Status s = Tls().ValidateForChannel(); !s.ok()) {
    if (!insecure && ca_file.empty()) {
      return absl::InvalidArgumentError(
          "ca_file: is required to verify the manager (or insecure = true for plaintext)");
    }
    return s;
  }
  if (!token.empty()) {
    if (absl::Status s = ValidateBearerToken(token); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("token: ", s.message()));
    }
  }
  return absl::OkStatus();
}

TlsOptions ClientOptions::Tls() const {
  return TlsOptions{
      .insecure = insecure, .cert_file = cert_file, .key_file = key_file, .ca_file = ca_file};
}

// ---------------------------------------------------------------------------------------
// PinnedPrefix

PinnedPrefix::PinnedPrefix(PinnedPrefix&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)),
      ns_(std::move(other.ns_)),
      match_(std::move(other.match_)) {
  other.match_.pin_id = 0;
}

PinnedPrefix& PinnedPrefix::operator=(PinnedPrefix&& other) noexcept {
  if (this != &other) {
    ReleaseQuietly();
    client_ = std::exchange(other.client_, nullptr);
    ns_ = std::move(other.ns_);
    match_ = std::move(other.match_);
    other.match_.pin_id = 0;
  }
  return *this;
}

PinnedPrefix::~PinnedPrefix() { ReleaseQuietly(); }

void PinnedPrefix::ReleaseQuietly() {
  if (client_ == nullptr || match_.pin_id == 0) {
    return;
  }
  CallOptions call;
  call.deadline_ms = std::min(client_->options().default_deadline_ms, kReleaseDeadlineMs);
  // Best effort by contract: a pin the manager did not hear about lapses with its lease.
  Release(call).IgnoreError();
}

absl::Status PinnedPrefix::Release(const CallOptions& call) {
  if (client_ == nullptr || match_.pin_id == 0) {
    return absl::OkStatus();
  }
  const uint64_t pin_id = std::exchange(match_.pin_id, 0);
  return client_->Release(ns_, pin_id, call);
}

absl::Status PinnedPrefix::Renew(uint32_t ttl_ms, const CallOptions& call) {
  if (client_ == nullptr || match_.pin_id == 0) {
    return absl::FailedPreconditionError("PinnedPrefix holds no pin");
  }
  absl::StatusOr<absl::Time> expiry = client_->RenewLease(ns_, match_.pin_id, ttl_ms, call);
  if (!expiry.ok()) {
    return expiry.status();
  }
  match_.lease_expiry = *expiry;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// EventWatch

EventWatch::EventWatch() : context_(std::make_unique<grpc::ClientContext>()) {}

EventWatch::~EventWatch() { Cancel(); }

void EventWatch::Cancel() {
  context_->TryCancel();
  Join();
}

absl::Status EventWatch::Wait() {
  Join();
  return final_status_;
}

void EventWatch::Join() {
  std::call_once(join_once_, [this] {
    if (thread_.joinable()) {
      thread_.join();
    }
  });
}

// ---------------------------------------------------------------------------------------
// Client

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) {
    return s;
  }
  grpc::ChannelArguments args;
  // Reconnect on the same schedule as the retries, so that a retry after a refused
  // connection is not failed at once by a channel still in gRPC's default 1 s backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<int64_t>(options.initial_backoff_ms, INT32_MAX)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<int64_t>(options.max_backoff_ms, INT32_MAX)));
  absl::StatusOr<ChannelFactory> channels = ChannelFactory::Create(options.Tls(), options.token);
  if (!channels.ok()) return channels.status();
  auto rpc = std::make_unique<Rpc>(Rpc{.channels = *std::move(channels)});
  rpc->channel = rpc->channels.Open(options.address, args);
  if (rpc->channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("address: cannot open ", options.address));
  }
  rpc->stub = v1::CacheManager::NewStub(rpc->channel);
  return std::unique_ptr<Client>(new Client(std::move(options), std::move(rpc)));
}

Client::Client(ClientOptions options, std::unique_ptr<Rpc> rpc)
    : options_(std::move(options)), rpc_(std::move(rpc)) {}

Client::~Client() = default;

const ChannelFactory& Client::channels() const { return rpc_->channels; }

absl::Time Client::DeadlineOf(const CallOptions& call) const {
  const int64_t ms = call.deadline_ms > 0 ? call.deadline_ms : options_.default_deadline_ms;
  return absl::Now() + absl::Milliseconds(ms);
}

absl::Status Client::Invoke(const google::protobuf::MethodDescriptor& method, absl::Time deadline,
                            absl::FunctionRef<grpc::Status(grpc::ClientContext*)> attempt) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  const int max_attempts =
      RetriesFully(method) ? options_.max_attempts
                           : std::min(options_.max_attempts, options_.non_idempotent_max_attempts);
  double backoff_ms = static_cast<double>(options_.initial_backoff_ms);
  grpc::Status status;
  int attempts = 0;
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    ++attempts;
    attempts_.fetch_add(1, std::memory_order_relaxed);
    status = attempt(&context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || attempts >= max_attempts) {
      break;
    }
    // "Equal jitter": sleep between half and all of the backoff, so that clients that failed
    // together do not retry together, yet none retries much earlier than planned.
    absl::BitGen gen;
    const absl::Duration sleep = absl::Milliseconds(absl::Uniform(gen, backoff_ms / 2, backoff_ms));
    if (absl::Now() + sleep >= deadline) {
      break;
    }
    absl::SleepFor(sleep);
    backoff_ms = std::min(backoff_ms * options_.backoff_multiplier,
                          static_cast<double>(options_.max_backoff_ms));
    retries_.fetch_add(1, std::memory_order_relaxed);
  }
  absl::Status result = FromGrpcStatus(status);
  if (!result.ok() && attempts > 1) {
    result = absl::Status(result.code(),
                          absl::StrCat(result.message(), " (after ", attempts, " attempts)"));
  }
  return WithTlsMismatchHint(std::move(result), options_.insecure, "the manager");
}

absl::StatusOr<RegisterModelReply> Client::RegisterModel(const NamespaceId& ns,
                                                         const ModelSpec& spec,
                                                         const RegisterModelParams& params,
                                                         const CallOptions& call) {
  return RegisterModelUntil(ns, spec, params, DeadlineOf(call), call.reply);
}

absl::StatusOr<RegisterModelReply> Client::RegisterModelUntil(
    const NamespaceId& ns, const ModelSpec& spec, const RegisterModelParams& params,
    absl::Time deadline, google::protobuf::Message* reply_copy) {
  v1::RegisterModelRequest request;
  NamespaceToProto(ns, request.mutable_namespace_());
  ModelSpecToProto(spec, request.mutable_spec());
  request.set_max_page_age_s(params.max_page_age_s);
  v1::RegisterModelResponse response;
  absl::Status status =
      Invoke(Method("RegisterModel"), deadline, [&](grpc::ClientContext* context) {
        return rpc_->stub->RegisterModel(context, request, &response);
      });
  if (!status.ok()) {
    return status;
  }
  if (reply_copy != nullptr) reply_copy->CopyFrom(response);

  RegisterModelReply reply;
  reply.spec = wire::FromProto(response.spec());
  reply.bytes_per_token = response.bytes_per_token();
  reply.bytes_per_page = response.bytes_per_page();
  reply.key_fingerprint = response.scheme().key_fingerprint();
  reply.created = response.created();
  reply.max_page_age_s = response.max_page_age_s();

  // Hash locally only with a key this build provably hashes like the manager: the same
  // scheme version and a fingerprint that matches the key. Otherwise prompts go as tokens.
  const v1::HashScheme& scheme = response.scheme();
  absl::MutexLock lock(&mu_);
  if (response.hash_key().size() == 16 && scheme.version() == kPageHashVersion &&
      scheme.page_size_tokens() > 0) {
    const HashKey key = HashKey::FromBytes(response.hash_key());
    if (KeyFingerprint(key) == scheme.key_fingerprint()) {
      keys_[ns] =
          NamespaceKey{key, scheme.key_fingerprint(), scheme.page_size_tokens(), spec, params};
      return reply;
    }
  }
  keys_.erase(ns);
  return reply;
}

bool Client::HashesLocally(const NamespaceId& ns) const { return CachedKey(ns).has_value(); }

std::optional<Client::NamespaceKey> Client::CachedKey(const NamespaceId& ns) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(ns);
  if (it == keys_.end()) {
    return std::nullopt;
  }
  return it->second;
}

absl::StatusOr<Client::NamespaceKey> Client::RequireKey(const NamespaceId& ns) const {
  std::optional<NamespaceKey> key = CachedKey(ns);
  if (!key.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no hash scheme for namespace ", ns.ToString(),
                     ": call RegisterModel before sending page hashes"));
  }
  return *key;
}

void Client::FillPrompt(const std::optional<NamespaceKey>& key, std::span<const int32_t> tokens,
                        v1::Prompt* prompt) {
  if (key.has_value()) {
    wire::SetHashes(HashPages(key->key, tokens, key->page_size_tokens), key->page_size_tokens,
                    key->fingerprint, prompt);
  } else {
    wire::SetTokens(tokens, prompt);
  }
}

absl::StatusOr<std::vector<PageHash>> Client::HashPrompt(const NamespaceId& ns,
                                                         std::span<const int32_t> tokens) const {
  std::optional<NamespaceKey> key = CachedKey(ns);
  if (!key.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no hash key for namespace ", ns.ToString(), ": call RegisterModel first"));
  }
  return HashPages(key->key, tokens, key->page_size_tokens);
}

absl::Status Client::SendPrompt(
    const NamespaceId& ns, absl::Time deadline,
    absl::FunctionRef<absl::Status(const std::optional<NamespaceKey>&)> send) {
  const std::optional<NamespaceKey> key = CachedKey(ns);
  absl::Status status = send(key);
  // A stale key is FAILED_PRECONDITION about prompt.scheme (the manager's secret or version
  // changed) or NOT_FOUND (it restarted and forgot the namespace). Other FAILED_PRECONDITIONs
  // (an agent refusing an Insert's blocks) are the answer, not a reason to send again.
  const bool stale_key = status.code() == absl::StatusCode::kNotFound ||
                         (status.code() == absl::StatusCode::kFailedPrecondition &&
                          absl::StartsWith(status.message(), "prompt.scheme"));
  if (!key.has_value() || !stale_key) return status;
  absl::StatusOr<RegisterModelReply> refreshed =
      RegisterModelUntil(ns, key->spec, key->params, deadline);
  if (!refreshed.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), "; re-registering namespace ", ns.ToString(),
                                     " failed: ", refreshed.status().message()));
  }
  return send(CachedKey(ns));
}

namespace {

void FillMatchRequest(const NamespaceId& ns, const MatchParams& params, v1::MatchRequest* request) {
  NamespaceToProto(ns, request->mutable_namespace_());
  request->set_requester_agent_id(params.requester_agent_id);
  request->set_pin(params.pin);
  request->set_lease_ttl_ms(params.lease_ttl_ms);
  request->set_probe(params.probe);
}

}  // namespace

absl::StatusOr<MatchReply> Client::Match(const NamespaceId& ns, std::span<const int32_t> tokens,
                                         const MatchParams& params, const CallOptions& call) {
  const absl::Time deadline = DeadlineOf(call);
  v1::MatchResponse response;
  absl::Status status = SendPrompt(ns, deadline, [&](const std::optional<NamespaceKey>& key) {
    v1::MatchRequest request;
    FillMatchRequest(ns, params, &request);
    FillPrompt(key, tokens, request.mutable_prompt());
    return Invoke(Method("Match"), deadline, [&](grpc::ClientContext* context) {
      return rpc_->stub->Match(context, request, &response);
    });
  });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<MatchReply> Client::MatchHashes(const NamespaceId& ns,
                                               std::span<const PageHash> pages,
                                               const MatchParams& params, const CallOptions& call) {
  absl::StatusOr<NamespaceKey> key = RequireKey(ns);
  if (!key.ok()) {
    return key.status();
  }
  v1::MatchRequest request;
  FillMatchRequest(ns, params, &request);
  wire::SetHashes(pages, key->page_size_tokens, key->fingerprint, request.mutable_prompt());
  v1::MatchResponse response;
  absl::Status status = Invoke(
      Method("Match"), DeadlineOf(call),
      [&](grpc::ClientContext* context) { return rpc_->stub->Match(context, request, &response); });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<RouteParams::Policy> ParseRouteParamsPolicy(absl::string_view name) {
  using Policy = RouteParams::Policy;
  static constexpr std::pair<absl::string_view, Policy> kNames[] = {
      {"prefill-saved", Policy::kPrefillSaved},
      {"round-robin", Policy::kRoundRobin},
      {"hash-of-first-page", Policy::kFirstPageHash},
      {"least-loaded", Policy::kLeastLoaded}};
  for (const auto& [n, policy] : kNames) {
    if (n == name) return policy;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "route policy \"", name,
      "\" is unknown; known: prefill-saved, round-robin, hash-of-first-page, least-loaded"));
}

absl::StatusOr<RouteReply> Client::Route(const NamespaceId& ns, std::span<const int32_t> tokens,
                                         const RouteParams& params, const CallOptions& call) {
  const absl::Time deadline = DeadlineOf(call);
  v1::RouteResponse response;
  absl::Status status = SendPrompt(ns, deadline, [&](const std::optional<NamespaceKey>& key) {
    v1::RouteRequest request;
    NamespaceToProto(ns, request.mutable_namespace_());
    FillPrompt(key, tokens, request.mutable_prompt());
    for (const RouteParams::Candidate& c : params.candidates) {
      v1::RouteCandidate* out = request.add_candidates();
      out->set_agent_id(c.agent_id);
      out->set_load(c.load);
      out->set_queued_prefill_tokens(c.queued_prefill_tokens);
    }
    request.set_policy(static_cast<v1::RoutePolicy>(params.policy));
    request.set_prefill_tokens_per_s(params.prefill_tokens_per_s);
    request.set_probe(params.probe);
    request.set_pin(params.pin);
    request.set_lease_ttl_ms(params.lease_ttl_ms);
    return Invoke(Method("Route"), deadline, [&](grpc::ClientContext* context) {
      return rpc_->stub->Route(context, request, &response);
    });
  });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<PinnedPrefix> Client::MatchAndPin(const NamespaceId& ns,
                                                 std::span<const int32_t> tokens,
                                                 MatchParams params, const CallOptions& call) {
  if (params.probe) {
    return absl::InvalidArgumentError("probe: a probe cannot take a pin");
  }
  params.pin = true;
  absl::StatusOr<MatchReply> match = Match(ns, tokens, params, call);
  if (!match.ok()) {
    return match.status();
  }
  return PinnedPrefix(this, ns, *std::move(match));
}

namespace {

void FillInsertRequest(const NamespaceId& ns, const PoolRef& pool,
                       std::span<const BlockId> block_ids, const InsertParams& params,
                       v1::InsertRequest* request) {
  NamespaceToProto(ns, request->mutable_namespace_());
  PoolToProto(pool, request->mutable_pool());
  request->mutable_block_ids()->Assign(block_ids.begin(), block_ids.end());
  request->set_agent_epoch(params.agent_epoch);
  request->set_use_reservation(params.use_reservation);
}

}  // namespace

absl::StatusOr<InsertReply> Client::Insert(const NamespaceId& ns, std::span<const int32_t> tokens,
                                           const PoolRef& pool, std::span<const BlockId> block_ids,
                                           const CallOptions& call) {
  return Insert(ns, tokens, pool, block_ids, InsertParams{}, call);
}

absl::StatusOr<InsertReply> Client::Insert(const NamespaceId& ns, std::span<const int32_t> tokens,
                                           const PoolRef& pool, std::span<const BlockId> block_ids,
                                           const InsertParams& params, const CallOptions& call) {
  const absl::Time deadline = DeadlineOf(call);
  v1::InsertResponse response;
  absl::Status status = SendPrompt(ns, deadline, [&](const std::optional<NamespaceKey>& key) {
    v1::InsertRequest request;
    FillInsertRequest(ns, pool, block_ids, params, &request);
    FillPrompt(key, tokens, request.mutable_prompt());
    return Invoke(Method("Insert"), deadline, [&](grpc::ClientContext* context) {
      return rpc_->stub->Insert(context, request, &response);
    });
  });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<InsertReply> Client::InsertHashes(const NamespaceId& ns,
                                                 std::span<const PageHash> pages,
                                                 const PoolRef& pool,
                                                 std::span<const BlockId> block_ids,
                                                 const CallOptions& call) {
  return InsertHashes(ns, pages, pool, block_ids, InsertParams{}, call);
}

absl::StatusOr<InsertReply> Client::InsertHashes(
    const NamespaceId& ns, std::span<const PageHash> pages, const PoolRef& pool,
    std::span<const BlockId> block_ids, const InsertParams& params, const CallOptions& call) {
  absl::StatusOr<NamespaceKey> key = RequireKey(ns);
  if (!key.ok()) {
    return key.status();
  }
  v1::InsertRequest request;
  FillInsertRequest(ns, pool, block_ids, params, &request);
  wire::SetHashes(pages, key->page_size_tokens, key->fingerprint, request.mutable_prompt());
  v1::InsertResponse response;
  absl::Status status =
      Invoke(Method("Insert"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->Insert(context, request, &response);
      });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::Status Client::Release(const NamespaceId& ns, uint64_t pin_id, const CallOptions& call) {
  v1::ReleaseRequest request;
  NamespaceToProto(ns, request.mutable_namespace_());
  request.set_pin_id(pin_id);
  v1::ReleaseResponse response;
  absl::Status status =
      Invoke(Method("Release"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->Release(context, request, &response);
      });
  if (status.ok()) CopyReply(call, response);
  return status;
}

absl::StatusOr<absl::Time> Client::RenewLease(const NamespaceId& ns, uint64_t pin_id,
                                              uint32_t ttl_ms, const CallOptions& call) {
  v1::RenewLeaseRequest request;
  NamespaceToProto(ns, request.mutable_namespace_());
  request.set_pin_id(pin_id);
  request.set_lease_ttl_ms(ttl_ms);
  v1::RenewLeaseResponse response;
  absl::Status status =
      Invoke(Method("RenewLease"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->RenewLease(context, request, &response);
      });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return absl::FromUnixMillis(response.lease_expiry_unix_ms());
}

absl::StatusOr<uint64_t> Client::Reserve(const PoolRef& pool, uint64_t bytes,
                                         const CallOptions& call) {
  return Reserve(pool, bytes, ReserveParams{}, call);
}

absl::StatusOr<uint64_t> Client::Reserve(const PoolRef& pool, uint64_t bytes,
                                         const ReserveParams& params, const CallOptions& call) {
  v1::ReserveRequest request;
  PoolToProto(pool, request.mutable_pool());
  request.set_bytes(bytes);
  request.set_tenant(params.tenant);
  v1::ReserveResponse response;
  absl::Status status =
      Invoke(Method("Reserve"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->Reserve(context, request, &response);
      });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return response.evicted_bytes();
}

absl::Status Client::Unreserve(const PoolRef& pool, uint64_t bytes, const CallOptions& call) {
  return Unreserve(pool, bytes, ReserveParams{}, call);
}

absl::Status Client::Unreserve(const PoolRef& pool, uint64_t bytes, const ReserveParams& params,
                               const CallOptions& call) {
  v1::ReserveRequest request;
  PoolToProto(pool, request.mutable_pool());
  request.set_bytes(bytes);
  request.set_tenant(params.tenant);
  v1::UnreserveResponse response;
  absl::Status status =
      Invoke(Method("Unreserve"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->Unreserve(context, request, &response);
      });
  if (status.ok()) CopyReply(call, response);
  return status;
}

absl::StatusOr<EvictReply> Client::EvictFromPool(const PoolRef& pool, uint64_t bytes,
                                                 const CallOptions& call) {
  v1::EvictRequest request;
  PoolToProto(pool, request.mutable_pool());
  request.set_bytes(bytes);
  v1::EvictResponse response;
  absl::Status status = Invoke(
      Method("Evict"), DeadlineOf(call),
      [&](grpc::ClientContext* context) { return rpc_->stub->Evict(context, request, &response); });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<EvictReply> Client::EvictFromNamespace(const NamespaceId& ns, uint64_t bytes,
                                                      const CallOptions& call) {
  v1::EvictRequest request;
  NamespaceToProto(ns, request.mutable_namespace_());
  request.set_bytes(bytes);
  v1::EvictResponse response;
  absl::Status status = Invoke(
      Method("Evict"), DeadlineOf(call),
      [&](grpc::ClientContext* context) { return rpc_->stub->Evict(context, request, &response); });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

absl::StatusOr<DeleteNamespaceReply> Client::DeleteNamespace(const NamespaceId& ns,
                                                             const CallOptions& call) {
  v1::DeleteNamespaceRequest request;
  NamespaceToProto(ns, request.mutable_namespace_());
  v1::DeleteNamespaceResponse response;
  absl::Status status =
      Invoke(Method("DeleteNamespace"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->DeleteNamespace(context, request, &response);
      });
  if (!status.ok()) return status;
  CopyReply(call, response);
  return DeleteNamespaceReply{.removed_pages = response.removed_pages(),
                              .dropped_pins = response.dropped_pins()};
}

absl::StatusOr<ForgetAgentReply> Client::ForgetAgent(const std::string& agent_id,
                                                     const ForgetAgentParams& params,
                                                     const CallOptions& call) {
  v1::ForgetAgentRequest request;
  request.set_agent_id(agent_id);
  request.set_force(params.force);
  v1::ForgetAgentResponse response;
  absl::Status status =
      Invoke(Method("ForgetAgent"), DeadlineOf(call), [&](grpc::ClientContext* context) {
        return rpc_->stub->ForgetAgent(context, request, &response);
      });
  if (!status.ok()) return status;
  CopyReply(call, response);
  return ForgetAgentReply{.epoch = response.epoch(),
                          .was_alive = response.was_alive(),
                          .dropped_pages = response.dropped_pages()};
}

absl::StatusOr<ManagerStats> Client::Stats(const CallOptions& call) {
  v1::StatsRequest request;
  v1::StatsResponse response;
  absl::Status status = Invoke(
      Method("Stats"), DeadlineOf(call),
      [&](grpc::ClientContext* context) { return rpc_->stub->Stats(context, request, &response); });
  if (!status.ok()) {
    return status;
  }
  CopyReply(call, response);
  return wire::FromProto(response);
}

std::unique_ptr<EventWatch> Client::WatchEvents(const std::optional<NamespaceId>& ns,
                                                EventWatch::Callback callback) {
  std::unique_ptr<EventWatch> watch(new EventWatch());
  v1::WatchEventsRequest request;
  if (ns.has_value()) {
    NamespaceToProto(*ns, request.mutable_namespace_());
  }
  EventWatch* w = watch.get();
  v1::CacheManager::Stub* stub = rpc_->stub.get();
  watch->thread_ = std::thread([w, stub, insecure = options_.insecure, request = std::move(request),
                                callback = std::move(callback)] {
    std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader =
        stub->WatchEvents(w->context_.get(), request);
    v1::CacheEvent event;
    while (reader->Read(&event)) {
      callback(wire::FromProto(event));
    }
    w->final_status_ =
        WithTlsMismatchHint(FromGrpcStatus(reader->Finish()), insecure, "the manager");
  });
  return watch;
}

ClientCounters Client::counters() const {
  return ClientCounters{calls_.load(std::memory_order_relaxed),
                        attempts_.load(std::memory_order_relaxed),
                        retries_.load(std::memory_order_relaxed)};
}

}  // namespace kvcm
