#include "gpu/agent/control/command_loop.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/log.h"

namespace kvcm {

CommandLoop::CommandLoop(const AgentOptions* options, AgentPools pools, const AgentEpoch* epoch,
                         v1::AgentControl::Stub* control, NamespaceSpecs* specs,
                         std::function<void(const v1::NcclConnect&)> on_link_offer)
    : options_(*options),
      pools_(pools),
      epoch_(epoch),
      control_(control),
      on_link_offer_(std::move(on_link_offer)),
      executor_(pools.main, options->tier, pools.host, specs) {}

CommandLoop::~CommandLoop() { Stop(); }

void CommandLoop::Start() {
  thread_ = std::thread([this] { Run(); });
}

void CommandLoop::Stop() {
  {
    // Under mu_, so that RunStream either sees the stop or registers a context we cancel.
    absl::MutexLock lock(&mu_);
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (stream_ctx_ != nullptr) stream_ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void CommandLoop::CancelStream() {
  absl::MutexLock lock(&mu_);
  if (stream_ctx_ != nullptr) stream_ctx_->TryCancel();
}

absl::Status CommandLoop::RunStream() {
  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&mu_);
    if (stop_.HasBeenNotified()) return absl::CancelledError("shutting down");
    stream_ctx_ = &ctx;
  }
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>> stream =
      control_->Commands(&ctx);
  const uint64_t epoch = epoch_->current();
  if (const uint64_t old = executor_.epoch(); old != epoch) {
    // Blocks allocated for the old epoch after the ControlLoop freed the rest (a demotion or
    // a worker's Allocate that raced with it).
    if (old != 0) FreeBlocksOfEpoch(pools_, old);
    executor_.Reset(epoch);
  }
  v1::AgentCommandAck hello;
  hello.set_agent_id(options_.agent_id);
  hello.set_epoch(epoch);
  if (stream->Write(hello)) {
    v1::AgentCommand command;
    while (stream->Read(&command)) {
      if (command.has_nccl_connect()) {  // unnumbered: no ack
        if (on_link_offer_) on_link_offer_(command.nccl_connect());
        continue;
      }
      if (!stream->Write(executor_.Execute(command))) break;
    }
    stream->WritesDone();
  }
  const grpc::Status status = stream->Finish();
  absl::MutexLock lock(&mu_);
  stream_ctx_ = nullptr;
  return FromGrpcStatus(status);
}

void CommandLoop::Run() {
  const absl::Duration interval = absl::Milliseconds(options_.heartbeat_interval_ms);
  bool logged_failure = false;
  do {
    if (!epoch_->registered()) continue;
    const absl::Status s = RunStream();
    if (stop_.HasBeenNotified()) return;
    if (!s.ok() && !logged_failure) {
      LogWarning(absl::StrCat("Commands stream to ", options_.manager_address, ": ", s.ToString(),
                              " (reopening every ", options_.heartbeat_interval_ms, " ms)"));
      logged_failure = true;
    } else if (s.ok()) {
      logged_failure = false;
    }
  } while (!stop_.WaitForNotificationWithTimeout(interval));
}

}  // namespace kvcm
