#include "gpu/agent/control_loop.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "gpu/agent/agent_proto.h"

namespace kvcm {
namespace {

// Deadline of one Register or Heartbeat: the heartbeat interval, at least a second.
std::chrono::system_clock::time_point CallDeadline(const AgentOptions& options) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(std::max<uint32_t>(options.heartbeat_interval_ms, 1'000));
}

}  // namespace

ControlLoop::ControlLoop(const AgentOptions* options, AgentPools pools, AgentEpoch* epoch,
                         v1::AgentControl::Stub* control, std::string block_agent_address,
                         std::function<void()> on_new_epoch)
    : options_(*options),
      pools_(pools),
      epoch_(epoch),
      control_(control),
      block_agent_address_(std::move(block_agent_address)),
      on_new_epoch_(std::move(on_new_epoch)) {}

ControlLoop::~ControlLoop() { Stop(); }

void ControlLoop::Start() {
  thread_ = std::thread([this] { Run(); });
}

void ControlLoop::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

absl::Status ControlLoop::Register() {
  const PoolGeometry& g = pools_.main->geometry();
  v1::RegisterAgentRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_device(pools_.main->backend().name());
  req.set_tier(static_cast<v1::Tier>(options_.tier));
  PoolGeometryToProto(g, req.mutable_geometry());
  req.set_capacity_bytes(g.pool_bytes());
  if (pools_.host != nullptr) {
    req.mutable_host_pool()->set_num_blocks(pools_.host->geometry().num_blocks);
    req.mutable_host_pool()->set_capacity_bytes(pools_.host->geometry().pool_bytes());
  }
  req.set_epoch(epoch_->current());
  req.set_block_agent_address(block_agent_address_);
  v1::RegisterAgentResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(CallDeadline(options_));
  return FromGrpcStatus(control_->Register(&ctx, req, &resp));
}

absl::Status ControlLoop::Heartbeat() {
  const BlockPoolStats s = pools_.main->Stats();
  v1::HeartbeatRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_epoch(epoch_->current());
  req.set_used_bytes(s.used_bytes);
  req.set_free_blocks(s.free_blocks);
  v1::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(CallDeadline(options_));
  return FromGrpcStatus(control_->Heartbeat(&ctx, req, &resp));
}

void ControlLoop::Run() {
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
                             options_.agent_id, " epoch ", epoch_->current()));
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
    epoch_->set_registered(s.ok());
  } while (!stop_.WaitForNotificationWithTimeout(interval));
}

void ControlLoop::RenewEpoch() {
  const uint64_t old = epoch_->current();
  const uint64_t freed = FreeBlocksOfEpoch(pools_, old);
  const uint64_t next = epoch_->Advance();
  on_new_epoch_();
  LogWarning(absl::StrCat("the manager no longer knows epoch ", old, ": freed its ", freed,
                          " blocks; registering as epoch ", next));
}

}  // namespace kvcm
