#include "server/service/nccl_bootstrap_relay.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/transports.h"

namespace kvcm {

NcclBootstrapRelay::NcclBootstrapRelay(size_t max_offers_per_agent)
    : max_offers_per_agent_(max_offers_per_agent) {}

void NcclBootstrapRelay::OnRegistered(const std::string& agent_id, uint64_t epoch,
                                      const std::string& transport) {
  absl::MutexLock lock(&mu_);
  Agent& a = agents_[agent_id];
  if (a.epoch != epoch) a.offers.clear();
  a.epoch = epoch;
  a.nccl = UsesBootstrapRelay(transport);
}

void NcclBootstrapRelay::Forget(const std::string& agent_id) {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  if (it == agents_.end()) return;
  stream_agents_.erase(it->second.stream_id);
  agents_.erase(it);
}

bool NcclBootstrapRelay::IsNccl(const std::string& agent_id, uint64_t epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  return it != agents_.end() && it->second.epoch == epoch && it->second.nccl;
}

absl::Status NcclBootstrapRelay::Relay(const std::string& to, uint64_t to_epoch,
                                       NcclLinkOffer offer) {
  std::shared_ptr<CommandStream> wake;
  {
    absl::MutexLock lock(&mu_);
    auto it = agents_.find(to);
    if (it == agents_.end() || it->second.epoch != to_epoch || !it->second.nccl) {
      return absl::FailedPreconditionError(absl::StrCat(
          "peer_agent_id ", to, " did not register transport \"nccl\" in epoch ", to_epoch));
    }
    Agent& a = it->second;
    if (a.stream_id == 0 || a.stream_epoch != to_epoch) {
      return absl::UnavailableError(
          absl::StrCat("peer_agent_id ", to, " has no open Commands stream to relay the offer on"));
    }
    if (a.offers.size() >= max_offers_per_agent_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "peer_agent_id ", to, " has ", a.offers.size(), " link offers waiting already"));
    }
    a.offers.push_back(std::move(offer));
    wake = a.stream;
  }
  wake->Wake();
  return absl::OkStatus();
}

NcclBootstrapRelay::StreamId NcclBootstrapRelay::Attach(const std::string& agent_id, uint64_t epoch,
                                                        std::shared_ptr<CommandStream> stream) {
  absl::MutexLock lock(&mu_);
  Agent& a = agents_[agent_id];
  stream_agents_.erase(a.stream_id);
  if (a.stream_epoch != epoch) a.offers.clear();
  const StreamId id = next_stream_id_++;
  a.stream_id = id;
  a.stream_epoch = epoch;
  a.stream = std::move(stream);
  stream_agents_[id] = agent_id;
  return id;
}

void NcclBootstrapRelay::Detach(StreamId stream) {
  std::shared_ptr<CommandStream> last;  // released after mu_
  absl::MutexLock lock(&mu_);
  auto s = stream_agents_.find(stream);
  if (s == stream_agents_.end()) return;
  auto it = agents_.find(s->second);
  stream_agents_.erase(s);
  if (it == agents_.end() || it->second.stream_id != stream) return;
  Agent& a = it->second;
  a.stream_id = 0;
  last = std::move(a.stream);
  a.offers.clear();
}

std::optional<NcclLinkOffer> NcclBootstrapRelay::TakeNext(StreamId stream) {
  absl::MutexLock lock(&mu_);
  auto s = stream_agents_.find(stream);
  if (s == stream_agents_.end()) return std::nullopt;
  auto it = agents_.find(s->second);
  if (it == agents_.end() || it->second.stream_id != stream || it->second.offers.empty()) {
    return std::nullopt;
  }
  NcclLinkOffer next = std::move(it->second.offers.front());
  it->second.offers.pop_front();
  return next;
}

size_t NcclBootstrapRelay::queued(const std::string& agent_id) const {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  return it == agents_.end() ? 0 : it->second.offers.size();
}

}  // namespace kvcm
