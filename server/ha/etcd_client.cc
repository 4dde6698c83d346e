#include "server/ha/etcd_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"

namespace kvcm {
namespace {

// etcd's keep-alive and watch are streams; a member that stops answering must not hold a
// call past its deadline, so every context carries one.
void SetDeadline(grpc::ClientContext& ctx, absl::Time deadline) {
  ctx.set_deadline(absl::ToChronoTime(deadline));
}

EtcdClient::Key KeyFrom(const etcdserverpb::RangeResponse& r) {
  EtcdClient::Key key;
  key.revision = r.header().revision();
  if (r.kvs_size() > 0) {
    key.exists = true;
    key.value = r.kvs(0).value();
    key.lease = r.kvs(0).lease();
  }
  return key;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(std::vector<std::string> endpoints,
                                                               const TlsOptions& tls) {
  if (endpoints.empty()) return absl::InvalidArgumentError("etcd_endpoints: none given");
  absl::StatusOr<ChannelFactory> channels = ChannelFactory::Create(tls);
  if (!channels.ok()) return channels.status();
  grpc::ChannelArguments args;
  // A member that went away is retried within a second, not after gRPC's default backoff
  // (up to two minutes): the lease is only a few seconds long. (The minimum backoff is
  // also the connect timeout; it keeps its default.)
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::vector<Member> members;
  for (std::string& endpoint : endpoints) {
    std::shared_ptr<grpc::Channel> channel = channels->Open(endpoint, args);
    members.push_back(Member{.endpoint = std::move(endpoint),
                             .kv = etcdserverpb::KV::NewStub(channel),
                             .lease = etcdserverpb::Lease::NewStub(channel),
                             .watch = etcdserverpb::Watch::NewStub(channel)});
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(members)));
}

EtcdClient::Member& EtcdClient::Current() {
  absl::MutexLock lock(&mu_);
  return members_[current_];
}

std::string EtcdClient::endpoint() const {
  absl::MutexLock lock(&mu_);
  return members_[current_].endpoint;
}

absl::Status EtcdClient::Fail(absl::string_view op, const grpc::Status& status) {
  std::string endpoint;
  {
    absl::MutexLock lock(&mu_);
    endpoint = members_[current_].endpoint;
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
        status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      current_ = (current_ + 1) % members_.size();
    }
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("etcd ", op, " at ", endpoint, ": ", status.error_message()));
}

absl::StatusOr<EtcdClient::Lease> EtcdClient::Grant(absl::Duration ttl, absl::Time deadline) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(ttl)));
  etcdserverpb::LeaseGrantResponse response;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = Current().lease->LeaseGrant(&ctx, request, &response);
  if (!s.ok()) return Fail("LeaseGrant", s);
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", response.error()));
  }
  return Lease{.id = response.id(), .ttl = absl::Seconds(response.ttl())};
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAlive(int64_t lease, absl::Time deadline) {
  // One request on a fresh stream: the stream's deadline then bounds this keep-alive alone.
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::LeaseKeepAliveRequest,
                                           etcdserverpb::LeaseKeepAliveResponse>>
      stream = Current().lease->LeaseKeepAlive(&ctx);
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseKeepAliveResponse response;
  const bool answered = stream->Write(request) && stream->Read(&response);
  stream->WritesDone();
  if (!answered) {
    ctx.TryCancel();
    grpc::Status s = stream->Finish();
    return Fail(
        "LeaseKeepAlive",
        s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended unanswered") : s);
  }
  ctx.TryCancel();  // nothing more to read; Finish would otherwise wait for the server
  stream->Finish();
  if (response.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  }
  return absl::Seconds(response.ttl());
}

absl::Status EtcdClient::Revoke(int64_t lease, absl::Time deadline) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = Current().lease->LeaseRevoke(&ctx, request, &response);
  return s.ok() ? absl::OkStatus() : Fail("LeaseRevoke", s);
}

absl::StatusOr<EtcdClient::CreateResult> EtcdClient::CreateIfAbsent(const std::string& key,
                                                                    const std::string& value,
                                                                    int64_t lease,
                                                                    absl::Time deadline) {
  // if create_revision(key) == 0 (absent): put key = value with the lease; either way, read it.
  etcdserverpb::TxnRequest request;
  etcdserverpb::Compare* absent = request.add_compare();
  absent->set_key(key);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = request.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  request.add_success()->mutable_request_range()->set_key(key);
  request.add_failure()->mutable_request_range()->set_key(key);

  etcdserverpb::TxnResponse response;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = Current().kv->Txn(&ctx, request, &response);
  if (!s.ok()) return Fail("Txn", s);
  CreateResult out;
  out.created = response.succeeded();
  const int range_at = out.created ? 1 : 0;
  if (response.responses_size() <= range_at || !response.responses(range_at).has_response_range()) {
    return absl::InternalError("etcd Txn: the answer lacks the key's read");
  }
  out.key = KeyFrom(response.responses(range_at).response_range());
  out.key.revision = response.header().revision();
  return out;
}

absl::StatusOr<EtcdClient::Key> EtcdClient::Get(const std::string& key, absl::Time deadline) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  etcdserverpb::RangeResponse response;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = Current().kv->Range(&ctx, request, &response);
  if (!s.ok()) return Fail("Range", s);
  return KeyFrom(response);
}

absl::Status EtcdClient::WaitForDelete(const std::string& key, int64_t after_revision,
                                       absl::Time deadline) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("etcd client cancelled");
    watching_ = &ctx;
  }
  std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>>
      stream = Current().watch->Watch(&ctx);
  etcdserverpb::WatchRequest request;
  etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(key);
  create->set_start_revision(after_revision + 1);
  create->add_filters(etcdserverpb::WatchCreateRequest::NOPUT);

  absl::Status result = absl::OkStatus();
  bool deleted = false;
  if (stream->Write(request)) {
    etcdserverpb::WatchResponse response;
    while (!deleted && stream->Read(&response)) {
      if (response.canceled()) {
        // E.g. after_revision was compacted away: the caller reads the key again.
        result = absl::AbortedError(
            absl::StrCat("etcd Watch cancelled: ", response.cancel_reason(),
                         response.compact_revision() > 0 ? " (revision compacted)" : ""));
        break;
      }
      for (const mvccpb::Event& e : response.events()) {
        if (e.type() == mvccpb::Event::DELETE) deleted = true;
      }
    }
  }
  ctx.TryCancel();
  grpc::Status s = stream->Finish();
  bool cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    watching_ = nullptr;
    cancelled = cancelled_;
  }
  if (deleted) return absl::OkStatus();
  if (cancelled) return absl::CancelledError("etcd client cancelled");
  if (!result.ok()) return result;
  if (absl::Now() >= deadline) return absl::DeadlineExceededError("etcd Watch: deadline");
  return Fail("Watch", s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended") : s);
}

void EtcdClient::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (watching_ != nullptr) watching_->TryCancel();
}

}  // namespace kvcm
