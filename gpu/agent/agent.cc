#include "gpu/agent/agent.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "gpu/agent/pool_attention.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

// Most block ids one Free may carry, so a request's size is bounded.
constexpr int kMaxIdsPerRequest = 1 << 20;

void GeometryToProto(const PoolGeometry& g, v1::PoolGeometry* out) {
  ModelSpecToProto(g.spec, out->mutable_spec());
  out->set_bytes_per_block(g.bytes_per_block());
  out->set_num_blocks(g.num_blocks);
}

absl::string_view HostOf(absl::string_view address) {
  return address.substr(0, address.rfind(':'));
}

// The host pool's memory: page-locked when the main pool is on a GPU (demotion copies then
// run at full link speed), plain DRAM otherwise or when pinning fails.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateHostPoolBackend(const BlockPool& main,
                                                                     uint64_t bytes) {
#ifdef KVCM_CUDA_ENABLED
  if (main.backend().is_device()) {
    absl::StatusOr<std::unique_ptr<DeviceBackend>> pinned = CreatePinnedHostBackend(bytes);
    if (pinned.ok()) return pinned;
    LogWarning(absl::StrCat("host pool: ", pinned.status().message(), "; using pageable DRAM"));
  }
#endif
  return CreateHostBackend(bytes);
}

}  // namespace

namespace {

// WriteBlocks: reads the header, stages the data chunks in host memory (bounded by the
// header's block count), and applies them with one BlockPool::WriteBlocks when the client
// half-closes, so an error at any point leaves the blocks untouched. Deletes itself in
// OnDone. Thread-safe: gRPC runs its callbacks one at a time.
class WriteBlocksReactor final : public grpc::ServerReadReactor<v1::WriteBlocksRequest> {
 public:
  WriteBlocksReactor(Agent* agent, grpc::CallbackServerContext* ctx, v1::WriteBlocksResponse* resp)
      : agent_(agent), ctx_(ctx), resp_(resp) {
    StartRead(&msg_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (ctx_->IsCancelled()) {
        Finish(ToGrpcStatus(absl::CancelledError("WriteBlocks cancelled")));
        return;
      }
      // The client half-closed, or gRPC refused its next message (e.g. over the size limit)
      // and failed the call without marking it cancelled. Sending the initial metadata
      // tells the two apart, as it fails on a failed call; only a live call is applied.
      StartSendInitialMetadata();
      return;
    }
    if (absl::Status s = Take(); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartRead(&msg_);
  }

  void OnSendInitialMetadataDone(bool ok) override {
    Finish(ok ? ToGrpcStatus(Apply())
              : grpc::Status(grpc::StatusCode::CANCELLED, "WriteBlocks: the call failed"));
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    const AgentOptions& opts = agent_->options();
    BlockPool& pool = agent_->pool();
    if (!have_header_) {
      if (!msg_.has_header()) {
        return absl::InvalidArgumentError("header must be the stream's first message");
      }
      const v1::WriteBlocksHeader& h = msg_.header();
      if (h.block_ids_size() > static_cast<int>(opts.max_blocks_per_call)) {
        return absl::InvalidArgumentError(absl::StrCat("header.block_ids must list at most ",
                                                       opts.max_blocks_per_call, " blocks"));
      }
      ids_.assign(h.block_ids().begin(), h.block_ids().end());
      owner_epoch_ = h.owner_epoch();
      KVCM_RETURN_IF_ERROR(pool.CheckOwned(ids_, owner_epoch_, "header.block_ids"));
      expected_bytes_ = ids_.size() * pool.geometry().bytes_per_block();
      staged_.reserve(expected_bytes_);
      have_header_ = true;
      return absl::OkStatus();
    }
    if (msg_.has_header()) return absl::InvalidArgumentError("header sent twice");
    const std::string& data = msg_.data();
    if (data.empty() || data.size() > opts.max_message_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data chunk must be 1..", opts.max_message_bytes, " bytes, got ", data.size()));
    }
    if (data.size() > expected_bytes_ - staged_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("data exceeds ", ids_.size(), " blocks x ",
                                                     pool.geometry().bytes_per_block(), " = ",
                                                     expected_bytes_, " bytes"));
    }
    const auto* bytes = reinterpret_cast<const std::byte*>(data.data());
    staged_.insert(staged_.end(), bytes, bytes + data.size());
    return absl::OkStatus();
  }

  absl::Status Apply() {
    if (!have_header_) return absl::InvalidArgumentError("header is missing (empty stream)");
    KVCM_RETURN_IF_ERROR(agent_->pool().WriteBlocks(ids_, owner_epoch_, staged_));
    resp_->set_bytes_written(staged_.size());
    return absl::OkStatus();
  }

  Agent* const agent_;
  grpc::CallbackServerContext* const ctx_;
  v1::WriteBlocksResponse* const resp_;
  v1::WriteBlocksRequest msg_;
  bool have_header_ = false;
  std::vector<BlockId> ids_;
  uint64_t owner_epoch_ = 0;
  uint64_t expected_bytes_ = 0;
  std::vector<std::byte> staged_;
};

// ReadBlocks: checks every block first, then streams the blocks' bytes in chunks of
// read_chunk_bytes, one write in flight at a time. Deletes itself in OnDone. Thread-safe:
// gRPC runs its callbacks one at a time.
class ReadBlocksReactor final : public grpc::ServerWriteReactor<v1::ReadBlocksResponse> {
 public:
  // `pool`: the pool req->tier names, or null when the agent has no such pool.
  ReadBlocksReactor(Agent* agent, BlockPool* pool, const v1::ReadBlocksRequest* req)
      : pool_(pool != nullptr ? *pool : agent->pool()),
        chunk_bytes_(agent->options().read_chunk_bytes),
        ids_(req->block_ids().begin(), req->block_ids().end()),
        owner_epoch_(req->owner_epoch()) {
    const uint32_t max_blocks = agent->options().max_blocks_per_call;
    absl::Status s =
        pool == nullptr
            ? absl::InvalidArgumentError(absl::StrCat("tier ", static_cast<int>(req->tier()),
                                                      " is not a pool of this agent"))
        : ids_.size() > max_blocks ? absl::InvalidArgumentError(absl::StrCat(
                                         "block_ids must list at most ", max_blocks, " blocks"))
                                   : pool_.CheckOwned(ids_, owner_epoch_, "block_ids");
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    total_bytes_ = ids_.size() * pool_.geometry().bytes_per_block();
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ReadBlocks: the stream broke"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  // Fills the next chunk from as many blocks as it spans and starts writing it.
  void WriteNext() {
    if (sent_bytes_ == total_bytes_) {
      Finish(grpc::Status::OK);
      return;
    }
    const uint64_t bpb = pool_.geometry().bytes_per_block();
    const uint64_t n = std::min(chunk_bytes_, total_bytes_ - sent_bytes_);
    std::string* buf = chunk_.mutable_data();
    buf->resize(n);
    for (uint64_t filled = 0; filled < n;) {
      const uint64_t pos = sent_bytes_ + filled;
      const uint64_t off = pos % bpb;
      const uint64_t take = std::min(bpb - off, n - filled);
      absl::Status s =
          pool_.ReadBlock(ids_[pos / bpb], owner_epoch_, off,
                          std::as_writable_bytes(std::span<char>(buf->data() + filled, take)));
      if (!s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
      filled += take;
    }
    sent_bytes_ += n;
    StartWrite(&chunk_);
  }

  BlockPool& pool_;
  const uint64_t chunk_bytes_;
  const std::vector<BlockId> ids_;
  const uint64_t owner_epoch_;
  uint64_t total_bytes_ = 0;
  uint64_t sent_bytes_ = 0;
  v1::ReadBlocksResponse chunk_;
};

}  // namespace

// BlockAgent over the pool. Thread-safe: the pool is; the agent outlives the service.
class Agent::BlockAgentService final : public v1::BlockAgent::CallbackService {
 public:
  explicit BlockAgentService(Agent* agent) : agent_(agent) {}

  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* ctx,
                                     const v1::AllocateBlocksRequest* req,
                                     v1::AllocateBlocksResponse* resp) override {
    return Unary(ctx, [&]() -> absl::Status {
      KVCM_ASSIGN_OR_RETURN(std::vector<BlockId> ids,
                            agent_->pool().Allocate(req->count(), req->owner_epoch()));
      resp->mutable_block_ids()->Add(ids.begin(), ids.end());
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* ctx, const v1::FreeBlocksRequest* req,
                                 v1::FreeBlocksResponse* /*resp*/) override {
    return Unary(ctx, [&]() -> absl::Status {
      if (req->block_ids_size() > kMaxIdsPerRequest) {
        return absl::InvalidArgumentError(
            absl::StrCat("block_ids must list at most ", kMaxIdsPerRequest, " ids"));
      }
      return agent_->pool().Free(
          std::span<const BlockId>(req->block_ids().data(), req->block_ids_size()),
          req->owner_epoch());
    });
  }

  grpc::ServerReadReactor<v1::WriteBlocksRequest>* WriteBlocks(
      grpc::CallbackServerContext* ctx, v1::WriteBlocksResponse* resp) override {
    return new WriteBlocksReactor(agent_, ctx, resp);
  }

  grpc::ServerWriteReactor<v1::ReadBlocksResponse>* ReadBlocks(
      grpc::CallbackServerContext* /*ctx*/, const v1::ReadBlocksRequest* req) override {
    BlockPool* pool = nullptr;
    if (req->tier() == v1::TIER_UNSPECIFIED ||
        req->tier() == static_cast<v1::Tier>(agent_->options_.tier)) {
      pool = &agent_->pool();
    } else if (req->tier() == v1::TIER_HOST) {
      pool = agent_->host_pool();
    }
    return new ReadBlocksReactor(agent_, pool, req);
  }

  grpc::ServerUnaryReactor* RunAttention(grpc::CallbackServerContext* ctx,
                                         const v1::RunAttentionRequest* req,
                                         v1::RunAttentionResponse* resp) override {
    return Unary(ctx, [&]() -> absl::Status {
      PoolAttentionRequest in;
      in.block_table.reserve(req->block_table_size());
      for (const v1::BlockList& row : req->block_table()) {
        in.block_table.emplace_back(row.block_ids().begin(), row.block_ids().end());
      }
      in.seq_lens.assign(req->seq_lens().begin(), req->seq_lens().end());
      in.query_bf16 = std::as_bytes(std::span<const char>(req->query()));
      in.softmax_scale = req->softmax_scale();
      in.num_heads = req->num_heads();
      in.layer = req->layer();
      in.owner_epoch = req->owner_epoch();
      KVCM_ASSIGN_OR_RETURN(PoolAttentionResult out, RunMlaDecodeOnPool(agent_->pool(), in));
      resp->set_output(out.output.data(), out.output.size() * sizeof(float));
      resp->mutable_lse()->Add(out.lse.begin(), out.lse.end());
      resp->set_backend(agent_->pool().backend().name());
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx,
                                  const v1::BlockAgentStatsRequest* /*req*/,
                                  v1::BlockAgentStatsResponse* resp) override {
    return Unary(ctx, [&]() -> absl::Status {
      const BlockPoolStats s = agent_->pool().Stats();
      resp->set_agent_id(agent_->options_.agent_id);
      resp->set_epoch(agent_->epoch());
      resp->set_backend(agent_->pool().backend().name());
      GeometryToProto(agent_->pool().geometry(), resp->mutable_geometry());
      resp->set_capacity_bytes(s.capacity_bytes);
      resp->set_used_bytes(s.used_bytes);
      resp->set_free_blocks(s.free_blocks);
      resp->set_registered(agent_->registered());
      if (const BlockPool* host = agent_->host_pool(); host != nullptr) {
        const BlockPoolStats h = host->Stats();
        v1::HostPoolStats* out = resp->mutable_host_pool();
        out->set_num_blocks(h.num_blocks);
        out->set_used_bytes(h.used_bytes);
        out->set_free_blocks(h.free_blocks);
      }
      return absl::OkStatus();
    });
  }

 private:
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, Body&& body) {
    const absl::Status status = std::forward<Body>(body)();
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  Agent* const agent_;
};

// Pool usage at scrape time. Thread-safe: reads the (thread-safe) pool.
class Agent::PoolCollector final : public prometheus::Collectable {
 public:
  explicit PoolCollector(Agent* agent) : agent_(agent) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const BlockPoolStats s = agent_->pool().Stats();
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"agent", agent_->options_.agent_id}, {"backend", agent_->pool().backend().name()}};
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&](std::string name, std::string help, double value) {
      prometheus::MetricFamily f;
      f.name = std::move(name);
      f.help = std::move(help);
      f.type = prometheus::MetricType::Gauge;
      prometheus::ClientMetric m;
      m.label = labels;
      m.gauge.value = value;
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    gauge("kvcm_agent_pool_capacity_bytes", "Bytes of the agent's block pool.",
          static_cast<double>(s.capacity_bytes));
    gauge("kvcm_agent_pool_used_bytes", "Bytes of allocated blocks.",
          static_cast<double>(s.used_bytes));
    gauge("kvcm_agent_pool_free_blocks", "Blocks not allocated.",
          static_cast<double>(s.free_blocks));
    gauge("kvcm_agent_registered", "1 when the last Register/Heartbeat succeeded.",
          agent_->registered() ? 1.0 : 0.0);
    if (const BlockPool* host = agent_->host_pool(); host != nullptr) {
      const BlockPoolStats h = host->Stats();
      gauge("kvcm_agent_host_pool_capacity_bytes", "Bytes of the agent's host-DRAM pool.",
            static_cast<double>(h.capacity_bytes));
      gauge("kvcm_agent_host_pool_used_bytes", "Bytes of allocated host-pool blocks.",
            static_cast<double>(h.used_bytes));
    }
    return out;
  }

 private:
  Agent* const agent_;
};

Agent::Agent(AgentOptions options) : options_(std::move(options)) {}

Agent::~Agent() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options) {
  KVCM_RETURN_IF_ERROR(options.Validate());
  KVCM_ASSIGN_OR_RETURN(PoolGeometry geometry, options.Geometry());
  std::unique_ptr<Agent> a(new Agent(std::move(options)));
  const AgentOptions& opts = a->options_;
  a->epoch_.store(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())));

  KVCM_ASSIGN_OR_RETURN(BackendChoice choice, CreateBackend({.arena_bytes = geometry.pool_bytes(),
                                                             .device_index = opts.device_index,
                                                             .allow_device = opts.use_device}));
  a->backend_reason_ = std::move(choice.reason);
  KVCM_ASSIGN_OR_RETURN(a->pool_, BlockPool::Create(geometry, std::move(choice.backend)));
  if (opts.host_capacity_bytes > 0) {
    KVCM_ASSIGN_OR_RETURN(PoolGeometry host_geometry, opts.HostGeometry());
    KVCM_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> host_backend,
                          CreateHostPoolBackend(*a->pool_, host_geometry.pool_bytes()));
    KVCM_ASSIGN_OR_RETURN(a->host_pool_, BlockPool::Create(host_geometry, std::move(host_backend)));
  }
  a->executor_ = std::make_unique<CommandExecutor>(a->pool_.get(), opts.tier, a->host_pool_.get());

  a->service_ = std::make_unique<BlockAgentService>(a.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(opts.listen_address, MakeServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Room for a full data chunk plus the message's framing.
  builder.SetMaxReceiveMessageSize(static_cast<int>(opts.max_message_bytes + 1024));
  builder.RegisterService(a->service_.get());
  a->server_ = builder.BuildAndStart();
  if (a->server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve BlockAgent on listen_address ", opts.listen_address));
  }
  a->address_ = absl::StrCat(HostOf(opts.listen_address), ":", port);

  if (!opts.metrics_address.empty()) {
    // prometheus-cpp reports a bind failure by throwing; turned into a Status here only.
    try {
      a->exposer_ = std::make_unique<prometheus::Exposer>(opts.metrics_address, 1);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on metrics_address ",
                                                 opts.metrics_address, ": ", e.what()));
    }
    a->collector_ = std::make_shared<PoolCollector>(a.get());
    a->exposer_->RegisterCollectable(a->collector_);
    std::vector<int> ports = a->exposer_->GetListeningPorts();
    a->metrics_address_ =
        absl::StrCat(HostOf(opts.metrics_address), ":", ports.empty() ? 0 : ports.front());
  }

  a->control_ = v1::AgentControl::NewStub(MakeChannel(opts.manager_address));
  a->control_thread_ = std::thread([raw = a.get()] { raw->ControlLoop(); });
  a->command_thread_ = std::thread([raw = a.get()] { raw->CommandLoop(); });
  return a;
}

absl::Status Agent::Register() {
  const PoolGeometry& g = pool_->geometry();
  v1::RegisterAgentRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_device(pool_->backend().name());
  req.set_tier(static_cast<v1::Tier>(options_.tier));
  GeometryToProto(g, req.mutable_geometry());
  req.set_capacity_bytes(g.pool_bytes());
  if (host_pool_ != nullptr) {
    req.mutable_host_pool()->set_num_blocks(host_pool_->geometry().num_blocks);
    req.mutable_host_pool()->set_capacity_bytes(host_pool_->geometry().pool_bytes());
  }
  req.set_epoch(epoch());
  req.set_block_agent_address(address_);
  v1::RegisterAgentResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(std::max<uint32_t>(
                                                          options_.heartbeat_interval_ms, 1'000)));
  return FromGrpcStatus(control_->Register(&ctx, req, &resp));
}

absl::Status Agent::Heartbeat() {
  const BlockPoolStats s = pool_->Stats();
  v1::HeartbeatRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_epoch(epoch());
  req.set_used_bytes(s.used_bytes);
  req.set_free_blocks(s.free_blocks);
  v1::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(std::max<uint32_t>(
                                                          options_.heartbeat_interval_ms, 1'000)));
  return FromGrpcStatus(control_->Heartbeat(&ctx, req, &resp));
}

void Agent::ControlLoop() {
  const absl::Duration interval = absl::Milliseconds(options_.heartbeat_interval_ms);
  // Whether the manager accepted this epoch. It stays true while the manager is merely
  // unreachable: the next heartbeat then tells a manager that kept our pages (OK) from one
  // that lost them (NOT_FOUND after a restart), and only the latter costs a new epoch.
  bool registered = false;
  bool logged_failure = false;
  do {
    const absl::Status s = registered ? Heartbeat() : Register();
    if (s.ok()) {
      if (!registered) {
        LogInfo(absl::StrCat("registered with ", options_.manager_address, " as ",
                             options_.agent_id, " epoch ", epoch()));
      }
      registered = true;
      logged_failure = false;
    } else {
      // NOT_FOUND / ABORTED: the manager restarted, declared us gone or holds another
      // epoch, so it no longer refers to this epoch's blocks: start over with a new one.
      // Any other error: unreachable; try again next round.
      if (s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kAborted) {
        RenewEpoch();
        registered = false;
      }
      if (!logged_failure) {
        LogWarning(absl::StrCat("manager ", options_.manager_address, ": ", s.ToString(),
                                " (retrying every ", options_.heartbeat_interval_ms, " ms)"));
        logged_failure = true;
      }
    }
    registered_.store(s.ok(), std::memory_order_release);
  } while (!stop_control_.WaitForNotificationWithTimeout(interval));
}

uint64_t Agent::FreeBlocksOfEpoch(uint64_t epoch) {
  uint64_t freed = pool_->FreeAllOwnedBy(epoch);
  if (host_pool_ != nullptr) freed += host_pool_->FreeAllOwnedBy(epoch);
  return freed;
}

void Agent::RenewEpoch() {
  const uint64_t old = epoch();
  const uint64_t next = std::max(old + 1, static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())));
  const uint64_t freed = FreeBlocksOfEpoch(old);
  epoch_.store(next, std::memory_order_release);
  {
    // The open Commands stream belongs to the old epoch.
    absl::MutexLock lock(&command_mu_);
    if (command_ctx_ != nullptr) command_ctx_->TryCancel();
  }
  LogWarning(absl::StrCat("the manager no longer knows epoch ", old, ": freed its ", freed,
                          " blocks; registering as epoch ", next));
}

absl::Status Agent::RunCommandStream() {
  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&command_mu_);
    if (stop_control_.HasBeenNotified()) return absl::CancelledError("shutting down");
    command_ctx_ = &ctx;
  }
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>> stream =
      control_->Commands(&ctx);
  const uint64_t epoch = this->epoch();
  if (const uint64_t old = executor_->epoch(); old != epoch) {
    // Blocks allocated for the old epoch after RenewEpoch freed the rest (a demotion or a
    // worker's Allocate that raced with it).
    if (old != 0) FreeBlocksOfEpoch(old);
    executor_->Reset(epoch);
  }
  v1::AgentCommandAck hello;
  hello.set_agent_id(options_.agent_id);
  hello.set_epoch(epoch);
  if (stream->Write(hello)) {
    v1::AgentCommand command;
    while (stream->Read(&command)) {
      if (!stream->Write(executor_->Execute(command))) break;
    }
    stream->WritesDone();
  }
  const grpc::Status status = stream->Finish();
  absl::MutexLock lock(&command_mu_);
  command_ctx_ = nullptr;
  return FromGrpcStatus(status);
}

void Agent::CommandLoop() {
  const absl::Duration interval = absl::Milliseconds(options_.heartbeat_interval_ms);
  bool logged_failure = false;
  do {
    if (!registered()) continue;
    const absl::Status s = RunCommandStream();
    if (stop_control_.HasBeenNotified()) return;
    if (!s.ok() && !logged_failure) {
      LogWarning(absl::StrCat("Commands stream to ", options_.manager_address, ": ", s.ToString(),
                              " (reopening every ", options_.heartbeat_interval_ms, " ms)"));
      logged_failure = true;
    } else if (s.ok()) {
      logged_failure = false;
    }
  } while (!stop_control_.WaitForNotificationWithTimeout(interval));
}

void Agent::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  stop_control_.Notify();
  {
    absl::MutexLock command_lock(&command_mu_);
    if (command_ctx_ != nullptr) command_ctx_->TryCancel();
  }
  if (control_thread_.joinable()) control_thread_.join();
  if (command_thread_.joinable()) command_thread_.join();
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  exposer_.reset();
  shutdown_done_.Notify();
}

void Agent::Wait() { shutdown_done_.WaitForNotification(); }

}  // namespace kvcm
