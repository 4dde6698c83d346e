#include "client/kvcmctl_print.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli_inputs.h"
#include "common/enum_names.h"
#include "common/model_catalog.h"

namespace kvcm::cli {

std::string HumanBytes(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) {
    return absl::StrCat(bytes, " B");
  }
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string FormatExpiry(absl::Time t) {
  if (t == absl::InfinitePast()) {
    return "none";
  }
  return absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", t, absl::UTCTimeZone()), " (in ",
                      absl::ToInt64Milliseconds(t - absl::Now()), " ms)");
}

void PrintEvent(const WatchedEvent& e) {
  static constexpr const char* kKinds[] = {"unspecified", "stored", "removed", "cleared"};
  absl::PrintF("seq=%d %s ns=%s pool=%s pages=%d%s%s\n", e.sequence,
               kKinds[static_cast<int>(e.kind)], e.ns.ToString(), e.pool.ToString(), e.pages.size(),
               e.pages.empty() ? "" : " first=", e.pages.empty() ? "" : e.pages[0].ToHex());
}

void PrintStats(absl::string_view address, const ManagerStats& stats) {
  const ManagerStats::Limits& l = stats.limits;
  absl::PrintF("manager %s  policy=%s  active_pins=%d\n", address, stats.policy, stats.active_pins);
  absl::PrintF(
      "limits: max_tokens_per_request=%u max_pages_per_request=%u max_lease_ttl_ms=%u "
      "default_lease_ttl_ms=%u\n",
      l.max_tokens_per_request, l.max_pages_per_request, l.max_lease_ttl_ms,
      l.default_lease_ttl_ms);

  if (stats.selection.has_value()) {
    // Hit rates of the miniature caches (a sample of the pages), not of the real pools.
    const ManagerStats::Selection& sel = *stats.selection;
    absl::PrintF("\nPOLICY CHOICE (%s)\n", stats.policy);
    absl::PrintF(
        "choice=%s moves=%d sampled_lookup_pages=%d sampled_store_pages=%d shadow_pages=%d "
        "pools=%d min_sample_rate=%g\n",
        sel.active, sel.switches, sel.sampled_lookup_pages, sel.sampled_store_pages,
        sel.shadow_pages, sel.pools, sel.min_sample_rate);
    absl::PrintF("%-16s %6s %15s\n", "CANDIDATE", "CHOSEN", "SHADOW_HIT_RATE");
    for (const ManagerStats::Selection::Candidate& c : sel.candidates) {
      absl::PrintF("%-16s %6s %15.4f\n", c.name, c.name == sel.active ? "*" : "",
                   c.shadow_hit_rate);
    }
  }

  absl::PrintF("\nPOOLS (%d)\n", stats.pools.size());
  absl::PrintF("%-24s %-5s %12s %12s %12s %10s %7s\n", "AGENT", "TIER", "CAPACITY", "USED",
               "PINNED", "PAGES", "USED%");
  for (const ManagerStats::Pool& p : stats.pools) {
    const double used_pct = p.capacity_bytes == 0 ? 0.0 : 100.0 * p.used_bytes / p.capacity_bytes;
    // An engine's pool has no capacity of kvcm's: the engine's own.
    absl::PrintF("%-24s %-5s %12s %12s %12s %10llu %7s\n", p.pool.agent_id, TierName(p.pool.tier),
                 p.engine ? std::string("engine") : HumanBytes(p.capacity_bytes),
                 HumanBytes(p.used_bytes), HumanBytes(p.pinned_bytes), p.pages,
                 p.engine ? std::string("-") : absl::StrFormat("%.2f", used_pct));
  }

  absl::PrintF("\nNAMESPACES (%d)\n", stats.namespaces.size());
  absl::PrintF("%-32s %-4s %-5s %5s %12s %12s %10s %10s %8s %10s %10s\n", "NAMESPACE", "ATTN",
               "DTYPE", "PAGE", "BYTES/TOKEN", "BYTES/PAGE", "PAGES", "LOCATIONS", "NODES",
               "MAX_AGE_S", "EXPIRED");
  for (const ManagerStats::Namespace& n : stats.namespaces) {
    absl::PrintF(
        "%-32s %-4s %-5s %5u %12llu %12llu %10llu %10llu %8llu %10s %10llu\n", n.ns.ToString(),
        AttentionName(n.spec.attention), DtypeName(n.spec.dtype), n.spec.page_size_tokens,
        n.bytes_per_token, n.bytes_per_page, n.pages, n.page_locations, n.radix_nodes,
        n.max_page_age_s == 0 ? std::string("-") : absl::StrCat(n.max_page_age_s), n.expired_pages);
  }

  absl::PrintF("\nAGENTS (%d)\n", stats.agents.size());
  absl::PrintF("%-24s %-10s %-5s %-6s %20s %12s %12s %10s\n", "AGENT", "DEVICE", "TIER", "STATE",
               "EPOCH", "HEARTBEAT", "USED", "FREE_BLKS");
  for (const ManagerStats::Agent& a : stats.agents) {
    absl::PrintF("%-24s %-10s %-5s %-6s %20d %10dms %12s %10d\n", a.agent_id, a.device,
                 TierName(a.tier), a.alive ? "alive" : "gone", a.epoch, a.last_heartbeat_age_ms,
                 HumanBytes(a.used_bytes), a.free_blocks);
  }

  if (!stats.engines.empty()) {
    absl::PrintF("\nENGINES (%d)\n", stats.engines.size());
    absl::PrintF("%-24s %-32s %20s %10s %12s %10s\n", "ENGINE", "NAMESPACE", "SESSION", "SEQUENCE",
                 "LAST", "PAGES");
    for (const ManagerStats::Engine& e : stats.engines) {
      absl::PrintF("%-24s %-32s %20d %10d %10dms %10d\n", e.engine_id, e.ns.ToString(), e.session,
                   e.sequence, e.last_publish_age_ms, e.pages);
    }
  }

  const ManagerStats::Counters& c = stats.counters;
  absl::PrintF("\nCOUNTERS\n");
  const std::pair<const char*, uint64_t> rows[] = {
      {"match_requests", c.match_requests},
      {"requested_pages", c.requested_pages},
      {"matched_pages", c.matched_pages},
      {"requested_tokens", c.requested_tokens},
      {"matched_tokens", c.matched_tokens},
      {"inserted_pages", c.inserted_pages},
      {"evicted_pages", c.evicted_pages},
      {"evicted_bytes", c.evicted_bytes},
      {"eviction_regret_pages", c.eviction_regret_pages},
      {"pins_taken", c.pins_taken},
      {"pins_released", c.pins_released},
      {"lease_expiries", c.lease_expiries},
      {"demoted_pages", c.demoted_pages},
      {"dropped_pages", c.dropped_pages},
      {"expired_pages", c.expired_pages},
  };
  for (const auto& [name, value] : rows) {
    absl::PrintF("%-24s %d\n", name, value);
  }
  if (c.requested_tokens > 0) {
    absl::PrintF("%-24s %.4f\n", "token_hit_ratio",
                 static_cast<double>(c.matched_tokens) / c.requested_tokens);
  }
}

absl::Status PrintModels(std::span<const KvDtype> dtypes, uint32_t page_size_tokens) {
  absl::PrintF("%-18s %-4s %6s %-5s %17s %11s %12s %10s %10s\n", "MODEL", "ATTN", "LAYERS", "DTYPE",
               "BYTES/TOKEN/LAYER", "BYTES/TOKEN", "BYTES/PAGE", "TOKENS/GIB", "MHA-SHAPED");
  for (const CatalogModel& m : Catalog()) {
    for (KvDtype dtype : dtypes) {
      absl::StatusOr<ModelSpec> spec = FindModel(m.name, dtype);
      if (!spec.ok()) {
        return spec.status();
      }
      spec->page_size_tokens = page_size_tokens;
      const KvFootprint f = FootprintOf(*spec);
      const std::string ratio = spec->attention == AttentionKind::kMla
                                    ? absl::StrFormat("%.1fx", f.mha_shaped_ratio)
                                    : std::string("-");
      absl::PrintF("%-18s %-4s %6u %-5s %17u %11u %12u %10u %10s\n", m.name,
                   AttentionName(spec->attention), spec->num_layers, DtypeName(spec->dtype),
                   f.bytes_per_token_per_layer, f.bytes_per_token, f.bytes_per_page,
                   f.tokens_per_gib, ratio);
    }
  }
  absl::PrintF(
      "\nBytes of KV cache. BYTES/PAGE: pages of %u tokens. TOKENS/GIB: floor(2^30 / "
      "BYTES/TOKEN).\n"
      "MHA-SHAPED (MLA only): how many times more a cache of full per-head K and V would take.\n"
      "fp8 MLA: FlashMLA's layout (an fp32 scale per 128 latents, bf16 RoPE); int8 adds fp32 "
      "scales.\n"
      "Dimensions: each model's Hugging Face config.json. Register one with 'register-model "
      "--preset=NAME'.\n",
      page_size_tokens);
  return absl::OkStatus();
}

absl::Status PrintModelsJson(std::span<const KvDtype> dtypes, uint32_t page_size_tokens) {
  // Catalogue names and enum names are [a-z0-9.-]: nothing to escape.
  std::vector<std::string> rows;
  for (const CatalogModel& m : Catalog()) {
    for (KvDtype dtype : dtypes) {
      absl::StatusOr<ModelSpec> spec = FindModel(m.name, dtype);
      if (!spec.ok()) {
        return spec.status();
      }
      spec->page_size_tokens = page_size_tokens;
      const KvFootprint f = FootprintOf(*spec);
      rows.push_back(absl::StrFormat(
          "{\"name\":\"%s\",\"family\":\"%s\",\"attention\":\"%s\",\"num_layers\":%u,"
          "\"kv_dtype\":\"%s\",\"bytes_per_token_per_layer\":%u,\"bytes_per_token\":%u,"
          "\"bytes_per_page\":%u,\"tokens_per_gib\":%u,\"mha_shaped_ratio\":%.3f}",
          m.name, m.family, AttentionName(spec->attention), spec->num_layers,
          DtypeName(spec->dtype), f.bytes_per_token_per_layer, f.bytes_per_token, f.bytes_per_page,
          f.tokens_per_gib, f.mha_shaped_ratio));
    }
  }
  absl::PrintF("{\"page_size_tokens\":%u,\"models\":[%s]}\n", page_size_tokens,
               absl::StrJoin(rows, ","));
  return absl::OkStatus();
}

}  // namespace kvcm::cli
