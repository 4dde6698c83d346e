#include "gpu/agent/transport/nccl/nccl_transport.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/agent/transport/link_cache.h"
#include "gpu/agent/transport/nccl/nccl_link.h"

namespace kvcm {
namespace {

class NcclTransport final : public Transport, public LinkOfferHandler {
 public:
  // Creates the data port over `impl_`'s links.
  static absl::StatusOr<std::unique_ptr<Transport>> Create(NcclTransportOptions options,
                                                           AgentPools pools, Tier main_tier,
                                                           NcclBootstrapFn bootstrap) {
    std::unique_ptr<NcclTransport> t(new NcclTransport(std::move(options), std::move(bootstrap)));
    absl::StatusOr<std::unique_ptr<Transport>> port =
        MakeTcpTransport(t->impl_->options.data, pools, main_tier,
                         LinkPort{.agent_id = t->impl_->options.agent_id,
                                  .links = &t->impl_->links,
                                  .connect_timeout_ms = t->impl_->options.connect_timeout_ms});
    if (!port.ok()) return port.status();
    t->impl_->port = *std::move(port);
    return std::unique_ptr<Transport>(std::move(t));
  }

  std::string address() const override { return impl_->port->address(); }
  void Pull(PullSpec spec, PullDone done) override {
    impl_->port->Pull(std::move(spec), std::move(done));
  }

  LinkOfferHandler* link_offers() override { return this; }

  absl::Status AcceptLinkOffer(const LinkOffer& offer) override {
    if (absl::Status s = ValidateLinkOffer(offer); !s.ok()) return s;
    NcclLinkOptions link = impl_->LinkOptions();
    return impl_->links.OfferServed(
        offer.from_agent_id, offer.link_id,
        [link, id = offer.unique_id, rank = offer.rank](const std::atomic<bool>& stop) {
          return MakeNcclLink(link, id, rank, stop);
        });
  }

 private:
  // The links and the data port over them; the port goes first (it uses the links).
  struct Impl {
    Impl(NcclTransportOptions o, NcclBootstrapFn b)
        : options(std::move(o)),
          bootstrap(std::move(b)),
          links({.max_links = options.max_links},
                [this](const std::string& peer, uint64_t link_id, const std::atomic<bool>& stop) {
                  return Connect(peer, link_id, stop);
                }) {}

    NcclLinkOptions LinkOptions() const {
      return {.device = options.device,
              .staging_bytes = options.staging_bytes,
              .connect_timeout = absl::Milliseconds(options.connect_timeout_ms)};
    }

    // A pull link: a new id, relayed by the manager, joined as rank 0.
    absl::StatusOr<std::unique_ptr<BlockLink>> Connect(const std::string& peer, uint64_t link_id,
                                                       const std::atomic<bool>& stop) {
      absl::StatusOr<std::string> id = NewNcclUniqueId();
      if (!id.ok()) return id.status();
      if (absl::Status s = bootstrap(peer, link_id, *id); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("NcclBootstrap: ", s.message()));
      }
      return MakeNcclLink(LinkOptions(), *id, /*rank=*/0, stop);
    }

    const NcclTransportOptions options;
    const NcclBootstrapFn bootstrap;
    LinkCache links;
    std::unique_ptr<Transport> port;
  };

  NcclTransport(NcclTransportOptions options, NcclBootstrapFn bootstrap)
      : impl_(std::make_unique<Impl>(std::move(options), std::move(bootstrap))) {}

  // Destroys the port (cancelling its transfers and joining its threads) before the links.
  std::unique_ptr<Impl> impl_;
};

}  // namespace

absl::Status NcclTransportOptions::Validate() const {
  if (absl::Status s = data.Validate(); !s.ok()) return s;
  if (agent_id.empty()) return absl::InvalidArgumentError("agent_id is required");
  if (device < 0) return absl::InvalidArgumentError("device must be >= 0");
  if (staging_bytes < 16) return absl::InvalidArgumentError("staging_bytes must be >= 16");
  if (max_links < 1) return absl::InvalidArgumentError("max_links must be >= 1");
  if (connect_timeout_ms < 1) return absl::InvalidArgumentError("connect_timeout_ms must be >= 1");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> MakeNcclTransport(NcclTransportOptions options,
                                                             AgentPools pools, Tier main_tier,
                                                             NcclBootstrapFn bootstrap) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (bootstrap == nullptr) return absl::InvalidArgumentError("bootstrap is required");
  if (options.staging_bytes < pools.main->geometry().bytes_per_block()) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_bytes (", options.staging_bytes, ") must hold one block (",
                     pools.main->geometry().bytes_per_block(), " bytes)"));
  }
  return NcclTransport::Create(std::move(options), pools, main_tier, std::move(bootstrap));
}

}  // namespace kvcm
