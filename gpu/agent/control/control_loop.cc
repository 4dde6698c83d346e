#include "gpu/agent/control/control_loop.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "gpu/agent/control/agent_proto.h"
#include "gpu/agent/pool/inventory_report.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

// Deadline of one Register or Heartbeat: the heartbeat interval, at least a second.
std::chrono::system_clock::time_point CallDeadline(const AgentOptions& options) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(std::max<uint32_t>(options.heartbeat_interval_ms, 1'000));
}

// Deadline of one inventory stream: 30 s, plus 100 ms per chunk (16384 blocks, ~600 KB).
std::chrono::system_clock::time_point InventoryDeadline(size_t chunks) {
  return std::chrono::system_clock::now() + std::chrono::seconds(30) +
         std::chrono::milliseconds(100) * chunks;
}

}  // namespace

ControlLoop::ControlLoop(const AgentOptions* options, AgentPools pools, AgentEpoch* epoch,
                         v1::AgentControl::Stub* control, std::string block_agent_address,
                         std::string data_address, const NamespaceSpecs* specs,
                         const AgentMetrics* metrics, std::function<void()> on_new_epoch,
                         std::function<void()> on_round)
    : options_(*options),
      pools_(pools),
      epoch_(epoch),
      control_(control),
      block_agent_address_(std::move(block_agent_address)),
      data_address_(std::move(data_address)),
      metrics_(metrics),
      specs_(specs),
      on_new_epoch_(std::move(on_new_epoch)),
      on_round_(std::move(on_round)) {}

ControlLoop::~ControlLoop() { Stop(); }

void ControlLoop::Start() {
  thread_ = std::thread([this] { Run(); });
}

void ControlLoop::Stop() {
  {
    // Under mu_, so that a call either sees the stop or registers a context we cancel.
    absl::MutexLock lock(&mu_);
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (call_ctx_ != nullptr) call_ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

bool ControlLoop::BeginCall(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (stop_.HasBeenNotified()) return false;
  call_ctx_ = ctx;
  return true;
}

void ControlLoop::EndCall() {
  absl::MutexLock lock(&mu_);
  call_ctx_ = nullptr;
}

absl::Status ControlLoop::Register() {
  const PoolGeometry& g = pools_.main->geometry();
  v1::RegisterAgentRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_device(pools_.main->backend().name());
  req.set_tier(TierToProto(options_.tier));
  PoolGeometryToProto(g, req.mutable_geometry());
  req.set_capacity_bytes(g.pool_bytes());
  if (pools_.host != nullptr) {
    req.mutable_host_pool()->set_num_blocks(pools_.host->geometry().num_blocks);
    req.mutable_host_pool()->set_capacity_bytes(pools_.host->geometry().pool_bytes());
  }
  req.set_epoch(epoch_->current());
  req.set_block_agent_address(block_agent_address_);
  req.set_data_address(data_address_);
  req.set_transport(options_.transport);
  v1::RegisterAgentResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(CallDeadline(options_));
  if (!BeginCall(&ctx)) return absl::CancelledError("shutting down");
  const grpc::Status status = control_->Register(&ctx, req, &resp);
  EndCall();
  return FromGrpcStatus(status);
}

absl::Status ControlLoop::ReportInventory() {
  const uint64_t epoch = epoch_->current();
  // Taken now, after the Register: what the manager indexes from it is what we hold.
  const InventoryReport report(options_.agent_id, epoch, *pools_.main, options_.tier, pools_.host,
                               *specs_);
  if (report.skipped_blocks() > 0) {
    std::vector<std::string> names;
    for (const NamespaceId& ns : report.skipped_namespaces()) names.push_back(ns.ToString());
    LogError(absl::StrCat("inventory of epoch ", epoch, ": ", report.skipped_blocks(),
                          " committed blocks of namespaces with no known spec (",
                          absl::StrJoin(names, ", "), ") cannot be reported; left out"));
  }
  if (report.chunks() == 0) {
    // Nothing to index and nothing the manager could ask us to free.
    LogInfo(absl::StrCat("inventory of epoch ", epoch, ": no committed blocks to report"));
    return absl::OkStatus();
  }
  v1::InventoryReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(InventoryDeadline(report.chunks()));
  if (!BeginCall(&ctx)) return absl::CancelledError("shutting down");
  std::unique_ptr<grpc::ClientWriter<v1::InventoryChunk>> stream =
      control_->ReportInventory(&ctx, &reply);
  for (size_t i = 0; i < report.chunks(); ++i) {
    if (!stream->Write(report.Chunk(i))) break;  // the call ended; Finish says why
  }
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  EndCall();
  if (!status.ok()) return FromGrpcStatus(status);

  const InventoryFreeResult freed =
      FreeInventoryRefusals(reply, epoch, *pools_.main, options_.tier, pools_.host);
  LogInfo(absl::StrCat("inventory of epoch ", epoch, ": reported ", report.blocks(),
                       " committed blocks in ", report.chunks(), " chunks; the manager indexed ",
                       reply.indexed_pages(), " pages, refused ", reply.orphan_pages(), " orphan, ",
                       reply.duplicate_pages(), " duplicate, ", reply.expired_pages(),
                       " expired (past the max page age) and ", reply.refused_pages(),
                       " other pages; freed ", freed.freed_blocks, " blocks"));
  if (freed.refused_blocks > 0) {
    LogWarning(absl::StrCat("inventory of epoch ", epoch, ": could not free ", freed.refused_blocks,
                            " blocks the manager listed: ", freed.first_error.ToString()));
  }
  return absl::OkStatus();
}

absl::Status ControlLoop::Join() {
  if (absl::Status s = Register(); !s.ok()) return s;
  absl::Status s = ReportInventory();
  if (s.code() == absl::StatusCode::kInvalidArgument) {
    return absl::AbortedError(absl::StrCat("the manager refused the inventory of epoch ",
                                           epoch_->current(), ": ", s.message()));
  }
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("inventory: ", s.message()));
  }
  return s;
}

absl::Status ControlLoop::Heartbeat() {
  const BlockPoolStats s = pools_.main->Stats();
  v1::HeartbeatRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_epoch(epoch_->current());
  req.set_used_bytes(s.used_bytes);
  req.set_free_blocks(s.free_blocks);
  req.set_pull_gbps(metrics_->pull_gbps());
  v1::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(CallDeadline(options_));
  if (!BeginCall(&ctx)) return absl::CancelledError("shutting down");
  const grpc::Status status = control_->Heartbeat(&ctx, req, &resp);
  EndCall();
  return FromGrpcStatus(status);
}

void ControlLoop::Leave() {
  v1::HeartbeatRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_epoch(epoch_->current());
  req.set_leaving(true);
  v1::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (const grpc::Status status = control_->Heartbeat(&ctx, req, &resp); status.ok()) {
    LogInfo(absl::StrCat("left ", options_.manager_address, ": the manager forgot ",
                         options_.agent_id, " epoch ", epoch_->current()));
  } else {
    LogWarning(
        absl::StrCat("could not tell ", options_.manager_address,
                     " that this agent leaves (it will report it gone): ", status.error_message()));
  }
}

void ControlLoop::Run() {
  const absl::Duration interval = absl::Milliseconds(options_.heartbeat_interval_ms);
  // Whether the manager accepted this epoch and its inventory. It stays true while the
  // manager is merely unreachable: the next heartbeat then tells a manager that kept our
  // pages (OK) from one that lost them (NOT_FOUND after a restart).
  bool registered = false;
  bool logged_failure = false;
  // A manager that lost our registration (a restart, a new leader) is answered at once: the
  // sooner it has our inventory, the sooner it matches our pages again.
  bool register_now = false;
  do {
    register_now = false;
    if (on_round_) on_round_();
    const absl::Status s = registered ? Heartbeat() : Join();
    if (stop_.HasBeenNotified()) return;
    if (s.ok()) {
      if (!registered) {
        LogInfo(absl::StrCat("registered with ", options_.manager_address, " as ",
                             options_.agent_id, " epoch ", epoch_->current()));
      }
      registered = true;
      logged_failure = false;
    } else if (s.code() == absl::StatusCode::kNotFound && registered) {
      // The manager lost our registration but not our blocks' meaning: they are still ours
      // in this epoch, and the inventory tells it what they hold.
      LogWarning(absl::StrCat("manager ", options_.manager_address, " does not know epoch ",
                              epoch_->current(),
                              " (restarted?): registering again with the same epoch and reporting ",
                              CommittedBlocks(), " committed blocks (", s.message(), ")"));
      registered = false;
      logged_failure = false;
      register_now = true;
    } else if (s.code() == absl::StatusCode::kAborted) {
      // Another process holds the agent id with a larger epoch, or ours is stale: the
      // manager no longer refers to this epoch's blocks. Start over with a new one.
      LogWarning(absl::StrCat("manager ", options_.manager_address, ": ", s.ToString()));
      RenewEpoch();
      registered = false;
      logged_failure = false;
    } else {
      // Unreachable, or the inventory failed: try again next round, same epoch. A failed
      // Register or inventory leaves `registered` false, so the next round registers again.
      if (!logged_failure) {
        LogWarning(absl::StrCat("manager ", options_.manager_address, ": ", s.ToString(),
                                " (retrying every ", options_.heartbeat_interval_ms, " ms)"));
        logged_failure = true;
      }
    }
    epoch_->set_registered(s.ok());
  } while (register_now ? !stop_.HasBeenNotified()
                        : !stop_.WaitForNotificationWithTimeout(interval));
}

uint64_t ControlLoop::CommittedBlocks() const {
  uint64_t n = pools_.main->Stats().committed_blocks;
  if (pools_.host != nullptr) n += pools_.host->Stats().committed_blocks;
  return n;
}

void ControlLoop::RenewEpoch() {
  const uint64_t old = epoch_->current();
  const uint64_t freed = FreeBlocksOfEpoch(pools_, old);
  const uint64_t next = epoch_->Advance();
  on_new_epoch_();
  LogWarning(absl::StrCat("the manager no longer refers to epoch ", old, ": freed its ", freed,
                          " blocks; registering as epoch ", next));
}

}  // namespace kvcm
