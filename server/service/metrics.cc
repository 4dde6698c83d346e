#include "server/service/metrics.h"

#include <algorithm>
#include <utility>

#include "common/enum_names.h"
#include "common/server_limits.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

#ifndef KVCM_VERSION
#define KVCM_VERSION "unknown"
#endif

namespace kvcm {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void AddSample(MetricFamily* family, std::vector<ClientMetric::Label> labels, double value) {
  ClientMetric m;
  m.label = std::move(labels);
  if (family->type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  family->metric.push_back(std::move(m));
}

MetricFamily Scalar(std::string name, std::string help, MetricType type, double value) {
  MetricFamily f = Family(std::move(name), std::move(help), type);
  AddSample(&f, {}, value);
  return f;
}

}  // namespace

const std::vector<const google::protobuf::MethodDescriptor*>& LabelledMethods() {
  static const auto* const methods = [] {
    auto* out = new std::vector<const google::protobuf::MethodDescriptor*>;
    for (const google::protobuf::ServiceDescriptor* service :
         {v1::MatchRequest::descriptor()->file()->FindServiceByName("CacheManager"),
          v1::HeartbeatRequest::descriptor()->file()->FindServiceByName("AgentControl")}) {
      for (int i = 0; i < service->method_count(); ++i) {
        const google::protobuf::MethodDescriptor* m = service->method(i);
        if (m->full_name() != "kvcm.v1.AgentControl.Commands") out->push_back(m);
      }
    }
    return out;
  }();
  return *methods;
}

absl::string_view RpcName(Rpc rpc) {
  const std::vector<const google::protobuf::MethodDescriptor*>& methods = LabelledMethods();
  const size_t i = static_cast<size_t>(rpc);
  if (i >= methods.size()) return "unknown";
  if (methods[i]->full_name() == "kvcm.v1.AgentControl.Register") return "RegisterAgent";
  return methods[i]->name();
}

absl::string_view KvcmVersion() { return KVCM_VERSION; }

// Snapshots the index (and the event hub) at scrape time. Thread-safe: Stats() locks the
// index; nothing here is cached.
class ServiceMetrics::IndexCollector final : public prometheus::Collectable {
 public:
  IndexCollector(const CacheIndex* index, const EventHub* hub, const AgentRegistry* agents,
                 const EngineSessions* engines)
      : index_(index), hub_(hub), agents_(agents), engines_(engines) {}

  std::vector<MetricFamily> Collect() const override {
    const IndexStats stats = index_->Stats();
    std::vector<MetricFamily> out;
    constexpr MetricType kGauge = MetricType::Gauge;
    constexpr MetricType kCounter = MetricType::Counter;

    MetricFamily capacity = Family("kvcm_pool_capacity_bytes", "Capacity of a pool.", kGauge);
    MetricFamily used = Family("kvcm_pool_used_bytes", "Bytes of cached pages in a pool.", kGauge);
    MetricFamily pinned =
        Family("kvcm_pool_pinned_bytes", "Bytes of pages held by at least one pin.", kGauge);
    MetricFamily reserved = Family("kvcm_pool_reserved_bytes",
                                   "Headroom reserved in a pool for admitted work.", kGauge);
    MetricFamily ratio =
        Family("kvcm_pool_usage_ratio", "used_bytes / capacity_bytes of a pool.", kGauge);
    MetricFamily pool_pages = Family("kvcm_pool_pages", "Page-locations in a pool.", kGauge);
    for (const PoolStats& p : stats.pools) {
      std::vector<ClientMetric::Label> labels = {{"agent", p.pool.agent_id},
                                                 {"tier", std::string(TierName(p.pool.tier))}};
      AddSample(&capacity, labels, static_cast<double>(p.capacity_bytes));
      AddSample(&used, labels, static_cast<double>(p.used_bytes));
      AddSample(&pinned, labels, static_cast<double>(p.pinned_bytes));
      AddSample(&reserved, labels, static_cast<double>(p.reserved_bytes));
      AddSample(&ratio, labels,
                p.capacity_bytes == 0
                    ? 0.0
                    : static_cast<double>(p.used_bytes) / static_cast<double>(p.capacity_bytes));
      AddSample(&pool_pages, labels, static_cast<double>(p.pages));
    }
    for (MetricFamily* f : {&capacity, &used, &pinned, &reserved, &ratio, &pool_pages}) {
      out.push_back(std::move(*f));
    }

    MetricFamily ns_pages =
        Family("kvcm_namespace_pages", "Distinct pages indexed in a namespace.", kGauge);
    MetricFamily ns_locations = Family("kvcm_namespace_page_locations",
                                       "Page-locations of a namespace (replicas count).", kGauge);
    MetricFamily ns_nodes =
        Family("kvcm_namespace_radix_nodes", "Radix tree nodes of a namespace.", kGauge);
    MetricFamily ns_requested = Family("kvcm_namespace_requested_tokens_total",
                                       "Whole-page tokens asked for by a namespace's non-probe "
                                       "matches (since the namespace was created).",
                                       kCounter);
    MetricFamily ns_matched =
        Family("kvcm_namespace_matched_tokens_total",
               "Tokens found by a namespace's non-probe matches (its prefill saved).", kCounter);
    // Namespaces are made by clients: whatever they register, the exporter shows the
    // kMaxNamespaceSeries largest (by page-locations) and sums the rest into one series.
    std::vector<NamespaceStats> namespaces = stats.namespaces;
    NamespaceStats other;
    if (namespaces.size() > kMaxNamespaceSeries) {
      std::nth_element(namespaces.begin(), namespaces.begin() + kMaxNamespaceSeries,
                       namespaces.end(), [](const NamespaceStats& a, const NamespaceStats& b) {
                         return a.page_locations > b.page_locations;
                       });
      for (auto it = namespaces.begin() + kMaxNamespaceSeries; it != namespaces.end(); ++it) {
        other.pages += it->pages;
        other.page_locations += it->page_locations;
        other.radix_nodes += it->radix_nodes;
        other.requested_tokens += it->requested_tokens;
        other.matched_tokens += it->matched_tokens;
      }
      namespaces.resize(kMaxNamespaceSeries);
      other.ns = NamespaceId{std::string(kOtherLabel), std::string(kOtherLabel)};
      namespaces.push_back(std::move(other));
    }
    for (const NamespaceStats& n : namespaces) {
      std::vector<ClientMetric::Label> labels = {{"model", n.ns.model}, {"tenant", n.ns.tenant}};
      AddSample(&ns_pages, labels, static_cast<double>(n.pages));
      AddSample(&ns_locations, labels, static_cast<double>(n.page_locations));
      AddSample(&ns_nodes, labels, static_cast<double>(n.radix_nodes));
      AddSample(&ns_requested, labels, static_cast<double>(n.requested_tokens));
      AddSample(&ns_matched, labels, static_cast<double>(n.matched_tokens));
    }
    for (MetricFamily* f : {&ns_pages, &ns_locations, &ns_nodes, &ns_requested, &ns_matched}) {
      out.push_back(std::move(*f));
    }
    AddTenants(stats, &out);

    const IndexCounters& c = stats.counters;
    auto counter = [&](std::string name, std::string help, uint64_t value) {
      out.push_back(Scalar(std::move(name), std::move(help), kCounter, static_cast<double>(value)));
    };
    counter("kvcm_match_requests_total", "Non-probe Match calls.", c.match_requests);
    counter("kvcm_requested_pages_total", "Whole pages asked for by non-probe matches.",
            c.requested_pages);
    counter("kvcm_matched_pages_total", "Pages found by non-probe matches.", c.matched_pages);
    counter("kvcm_requested_tokens_total", "Whole-page tokens asked for by non-probe matches.",
            c.requested_tokens);
    counter("kvcm_matched_tokens_total", "Tokens found by non-probe matches.", c.matched_tokens);
    counter("kvcm_prefill_tokens_saved_total",
            "Prompt tokens whose prefill the cache saved (matched tokens).", c.matched_tokens);
    counter("kvcm_pages_inserted_total", "Page-locations added by Insert.", c.inserted_pages);
    counter("kvcm_pages_evicted_total", "Page-locations removed by eviction.", c.evicted_pages);
    counter("kvcm_pages_demoted_total", "Pages evicted from a GPU pool into its agent's HOST pool.",
            c.demoted_pages);
    counter("kvcm_evicted_bytes_total", "Bytes freed by eviction.", c.evicted_bytes);
    counter("kvcm_allocation_room_total",
            "Agents' allocations the manager evicted to make room for (AgentControl.MakeRoom).",
            c.allocation_room_calls);
    counter("kvcm_allocation_evicted_pages_total",
            "Page-locations evicted to make room for agents' allocations (allocation "
            "pressure); also in kvcm_pages_evicted_total.",
            c.allocation_evicted_pages);
    counter("kvcm_allocation_room_refusals_total",
            "MakeRoom calls refused (RESOURCE_EXHAUSTED): pins, reservations or a quota left "
            "too little evictable.",
            c.allocation_room_refusals);
    counter("kvcm_eviction_regret_pages_total",
            "Evicted pages requested again within the regret window.", c.eviction_regret_pages);
    counter("kvcm_pins_taken_total", "Pins taken by Match.", c.pins_taken);
    counter("kvcm_pins_released_total", "Pins dropped by Release.", c.pins_released);
    counter("kvcm_lease_expiries_total", "Pins dropped because their lease lapsed.",
            c.lease_expiries);
    counter("kvcm_pages_dropped_total",
            "Page-locations forgotten because their agent restarted or was declared gone.",
            c.dropped_pages);
    // No tenant or model label: a namespace's own count is in Stats (NamespaceStats).
    counter("kvcm_pages_expired_total",
            "Page-locations removed because they were older than their namespace's max page "
            "age.",
            c.expired_pages);
    out.push_back(Scalar(
        "kvcm_hit_ratio", "matched_tokens_total / requested_tokens_total since start.", kGauge,
        c.requested_tokens == 0
            ? 0.0
            : static_cast<double>(c.matched_tokens) / static_cast<double>(c.requested_tokens)));
    out.push_back(
        Scalar("kvcm_pins_active", "Live pins.", kGauge, static_cast<double>(stats.active_pins)));

    out.push_back(Scalar("kvcm_watch_subscribers", "Open WatchEvents streams.", kGauge,
                         static_cast<double>(hub_->subscribers())));
    counter("kvcm_events_published_total", "Index events numbered for WatchEvents.",
            hub_->published());
    counter("kvcm_watch_overflows_total",
            "WatchEvents streams ended because the subscriber fell behind.", hub_->overflows());

    if (agents_ != nullptr) {
      const AgentCounts a = agents_->Counts();
      MetricFamily by_state =
          Family("kvcm_agents",
                 "Registered agents by liveness (gone: no heartbeat within the timeout).", kGauge);
      AddSample(&by_state, {{"state", "alive"}}, static_cast<double>(a.alive));
      AddSample(&by_state, {{"state", "gone"}}, static_cast<double>(a.gone));
      out.push_back(std::move(by_state));
      counter("kvcm_agent_heartbeats_total", "Heartbeats accepted from agents.",
              a.heartbeats_total);
      AddAgents(&out);
    }

    if (engines_ != nullptr) {
      const EngineCounts e = engines_->Counts();
      MetricFamily live =
          Family("kvcm_engine_sessions",
                 "Engines whose prefix cache the index mirrors now (PublishEngineEvents sessions).",
                 kGauge);
      AddSample(&live, {}, static_cast<double>(e.live));
      out.push_back(std::move(live));
      counter("kvcm_engine_sessions_started_total", "Engine sessions begun.", e.started);
      counter("kvcm_engine_sessions_lapsed_total",
              "Engine sessions ended because no request came within their ttl (their pools "
              "were emptied).",
              e.lapsed);
      counter("kvcm_engine_pages_stored_total", "Page-locations engines' events added.",
              e.stored_pages);
      counter("kvcm_engine_pages_removed_total",
              "Page-locations engines' events removed (clears included).", e.removed_pages);
      counter("kvcm_engine_sequence_refusals_total",
              "Engine requests refused for an unknown session or a sequence gap (the bridge "
              "then resyncs).",
              e.refused_sequence);
    }

    if (stats.selection.has_value()) AddSelection(*stats.selection, &out);

    MetricFamily build =
        Family("kvcm_build_info", "Version and eviction policy; always 1.", kGauge);
    AddSample(&build, {{"policy", stats.policy}, {"version", std::string(KvcmVersion())}}, 1.0);
    out.push_back(std::move(build));

    // The gRPC port's accept4 guard (common/server_limits.h; docs/SECURITY.md).
    const AcceptGuardCounters guard = GetAcceptGuardCounters();
    MetricFamily accepted = Family("kvcm_grpc_connections_accepted_total",
                                   "TCP connections the gRPC port accepted.", kCounter);
    AddSample(&accepted, {}, static_cast<double>(guard.accepted));
    MetricFamily refused =
        Family("kvcm_grpc_connections_refused_total",
               "TCP connections the gRPC port closed as it accepted them, by the limit that "
               "refused them (grpc_max_connections, grpc_max_connections_per_peer, or the "
               "process out of fds).",
               kCounter);
    AddSample(&refused, {{"reason", "grpc_max_connections"}},
              static_cast<double>(guard.refused_total_cap));
    AddSample(&refused, {{"reason", "grpc_max_connections_per_peer"}},
              static_cast<double>(guard.refused_peer_cap));
    AddSample(&refused, {{"reason", "out_of_fds"}}, static_cast<double>(guard.shed_fd_exhausted));
    out.push_back(std::move(accepted));
    out.push_back(std::move(refused));
    MetricFamily suppressed =
        Family("kvcm_grpc_log_lines_suppressed_total",
               "gRPC log lines dropped over the 20-a-second limit (one per timed-out handshake "
               "in a flood).",
               kCounter);
    AddSample(&suppressed, {}, static_cast<double>(SuppressedGrpcLogLines()));
    out.push_back(std::move(suppressed));
    return out;
  }

 private:
  // One series per tenant (the kMaxNamespaceSeries largest by held bytes; the rest summed
  // into kOtherLabel) and the quotas in force.
  static void AddTenants(const IndexStats& stats, std::vector<MetricFamily>* out) {
    std::vector<TenantStats> tenants = stats.tenants;
    if (tenants.size() > kMaxNamespaceSeries) {
      std::nth_element(tenants.begin(), tenants.begin() + kMaxNamespaceSeries, tenants.end(),
                       [](const TenantStats& a, const TenantStats& b) {
                         return a.held_bytes() > b.held_bytes();
                       });
      TenantStats other;
      other.tenant = std::string(kOtherLabel);
      for (auto it = tenants.begin() + kMaxNamespaceSeries; it != tenants.end(); ++it) {
        other.namespaces += it->namespaces;
        other.stored_bytes += it->stored_bytes;
        other.pinned_bytes += it->pinned_bytes;
        other.reserved_bytes += it->reserved_bytes;
        other.pins += it->pins;
      }
      tenants.resize(kMaxNamespaceSeries);
      tenants.push_back(std::move(other));
    }
    constexpr MetricType kGauge = MetricType::Gauge;
    MetricFamily stored = Family("kvcm_tenant_stored_bytes",
                                 "Bytes of a tenant's page-locations in live pools.", kGauge);
    MetricFamily pinned = Family("kvcm_tenant_pinned_bytes",
                                 "Of a tenant's stored bytes, those held by a pin.", kGauge);
    MetricFamily reserved =
        Family("kvcm_tenant_reserved_bytes", "Headroom a tenant reserved, in all pools.", kGauge);
    MetricFamily pins = Family("kvcm_tenant_pins", "A tenant's live pins.", kGauge);
    MetricFamily namespaces =
        Family("kvcm_tenant_namespaces", "A tenant's registered namespaces.", kGauge);
    for (const TenantStats& t : tenants) {
      // Tenant "" holds the operators' reservations; an empty label value would drop the label.
      std::vector<ClientMetric::Label> labels = {
          {"tenant", t.tenant.empty() ? std::string(kOperatorTenantLabel) : t.tenant}};
      AddSample(&stored, labels, static_cast<double>(t.stored_bytes));
      AddSample(&pinned, labels, static_cast<double>(t.pinned_bytes));
      AddSample(&reserved, labels, static_cast<double>(t.reserved_bytes));
      AddSample(&pins, labels, static_cast<double>(t.pins));
      AddSample(&namespaces, labels, static_cast<double>(t.namespaces));
    }
    for (MetricFamily* f : {&stored, &pinned, &reserved, &pins, &namespaces}) {
      out->push_back(std::move(*f));
    }
    out->push_back(Scalar("kvcm_tenant_max_bytes",
                          "Quota on each tenant's stored + reserved bytes (0: unlimited).", kGauge,
                          static_cast<double>(stats.tenant_max_bytes)));
    out->push_back(Scalar("kvcm_tenant_max_pinned_bytes",
                          "Quota on each tenant's pinned bytes (0: unlimited).", kGauge,
                          static_cast<double>(stats.tenant_max_pinned_bytes)));
  }

  // Policy "select"'s choice: one series per candidate policy (a fixed table, so bounded).
  static void AddSelection(const SelectionStats& sel, std::vector<MetricFamily>* out) {
    constexpr MetricType kGauge = MetricType::Gauge;
    constexpr MetricType kCounter = MetricType::Counter;
    MetricFamily choice = Family(
        "kvcm_policy_choice",
        "1 for the candidate policy \"select\" evicts in the order of, 0 for the others.", kGauge);
    MetricFamily hit = Family("kvcm_policy_shadow_hit_ratio",
                              "Hit ratio of a candidate's miniature caches (a sample of the "
                              "pages, simulated), over a decaying window; not the real pools'.",
                              kGauge);
    for (const SelectionStats::Candidate& c : sel.candidates) {
      std::vector<ClientMetric::Label> labels = {{"candidate", c.name}};
      AddSample(&choice, labels, c.name == sel.active ? 1.0 : 0.0);
      AddSample(&hit, labels, c.hit_rate);
    }
    out->push_back(std::move(choice));
    out->push_back(std::move(hit));
    out->push_back(Scalar("kvcm_policy_moves_total",
                          "Times \"select\" moved its choice to another candidate.", kCounter,
                          static_cast<double>(sel.switches)));
    out->push_back(Scalar("kvcm_policy_shadow_pages",
                          "Page-locations all candidates' miniature caches hold.", kGauge,
                          static_cast<double>(sel.shadow_pages)));
    MetricFamily sampled = Family("kvcm_policy_sampled_pages_total",
                                  "Pages of GPU pools' lookups and stores that fell in "
                                  "\"select\"'s sample (its miniature caches saw them).",
                                  kCounter);
    AddSample(&sampled, {{"kind", "lookup"}}, static_cast<double>(sel.sampled_lookup_pages));
    AddSample(&sampled, {{"kind", "store"}}, static_cast<double>(sel.sampled_store_pages));
    out->push_back(std::move(sampled));
    out->push_back(Scalar("kvcm_policy_min_sample_rate",
                          "Smallest share of a GPU pool's pages \"select\" simulates (1: all); "
                          "0 before the first prompt.",
                          kGauge, sel.min_sample_rate));
  }

  // One series per registered agent (agents are a cluster's nodes, so bounded), and the
  // suspects: alive, but silent for more than half the heartbeat timeout.
  void AddAgents(std::vector<MetricFamily>* out) const {
    constexpr MetricType kGauge = MetricType::Gauge;
    const absl::Duration timeout = agents_->heartbeat_timeout();
    MetricFamily up = Family("kvcm_agent_up", "1 while an agent is alive, 0 once gone.", kGauge);
    MetricFamily age = Family("kvcm_agent_last_heartbeat_age_seconds",
                              "Time since an agent's last Register or Heartbeat.", kGauge);
    MetricFamily epoch =
        Family("kvcm_agent_epoch", "An agent's registered epoch (its incarnation).", kGauge);
    MetricFamily beats = Family("kvcm_agent_epoch_heartbeats_total",
                                "Heartbeats accepted from an agent in its current epoch (from 0 "
                                "again when it registers a new one).",
                                MetricType::Counter);
    uint64_t suspect = 0;
    for (const AgentInfo& a : agents_->Snapshot()) {
      std::vector<ClientMetric::Label> labels = {{"agent", a.registration.agent_id}};
      AddSample(&up, labels, a.alive ? 1.0 : 0.0);
      AddSample(&age, labels, absl::ToDoubleSeconds(a.last_heartbeat_age));
      // Epochs are microseconds since 1970: exact in a double until the year 2255.
      AddSample(&epoch, labels, static_cast<double>(a.registration.epoch));
      AddSample(&beats, labels, static_cast<double>(a.heartbeats));
      if (a.alive && a.last_heartbeat_age > timeout / 2) ++suspect;
    }
    for (MetricFamily* f : {&up, &age, &epoch, &beats}) out->push_back(std::move(*f));
    out->push_back(Scalar("kvcm_agents_suspect",
                          "Alive agents silent for more than half the heartbeat timeout (also "
                          "counted in kvcm_agents{state=\"alive\"}).",
                          kGauge, static_cast<double>(suspect)));
    out->push_back(Scalar("kvcm_agent_heartbeat_timeout_seconds",
                          "Silence after which an agent is declared gone.", kGauge,
                          absl::ToDoubleSeconds(timeout)));
  }

  const CacheIndex* const index_;
  const EventHub* const hub_;
  const AgentRegistry* const agents_;
  const EngineSessions* const engines_;
};

ServiceMetrics::ServiceMetrics(const CacheIndex* index, const EventHub* hub,
                               const AgentRegistry* agents, const EngineSessions* engines)
    : registry_(std::make_shared<prometheus::Registry>()),
      index_collector_(std::make_shared<IndexCollector>(index, hub, agents, engines)),
      rpcs_(std::make_unique<PrometheusRpcRecorder<Rpc, kNumRpcs>>(
          *registry_, "kvcm_rpc", "CacheManager and AgentControl", [](Rpc rpc) {
            const size_t i = static_cast<size_t>(rpc);
            if (i >= LabelledMethods().size()) return false;
            const google::protobuf::MethodDescriptor* m = LabelledMethods()[i];
            return m->client_streaming() || m->server_streaming();
          })) {
  prometheus::Family<prometheus::Counter>& commands =
      prometheus::BuildCounter()
          .Name("kvcm_agent_commands_total")
          .Help(
              "Manager -> agent commands (FreeBlocks, DemoteBlocks) by result: acked, failed or "
              "dropped.")
          .Register(*registry_);
  agent_commands_[static_cast<int>(AgentCommandResult::kAcked)] =
      &commands.Add({{"result", "acked"}});
  agent_commands_[static_cast<int>(AgentCommandResult::kFailed)] =
      &commands.Add({{"result", "failed"}});
  agent_commands_[static_cast<int>(AgentCommandResult::kDropped)] =
      &commands.Add({{"result", "dropped"}});
}

ServiceMetrics::~ServiceMetrics() = default;

void ServiceMetrics::RecordAgentCommand(AgentCommandResult result) {
  agent_commands_[static_cast<int>(result)]->Increment();
}

std::vector<std::weak_ptr<prometheus::Collectable>> ServiceMetrics::collectables() const {
  return {registry_, index_collector_};
}

std::string ServiceMetrics::RenderText() const {
  std::vector<MetricFamily> families = registry_->Collect();
  std::vector<MetricFamily> index = index_collector_->Collect();
  families.insert(families.end(), std::make_move_iterator(index.begin()),
                  std::make_move_iterator(index.end()));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvcm
