#include "bench/load/load_stats.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvcm::load {

const char* RpcKindName(RpcKind kind) {
  switch (kind) {
    case RpcKind::kMatch:
      return "match";
    case RpcKind::kInsert:
      return "insert";
    case RpcKind::kRelease:
      return "release";
    case RpcKind::kRoute:
      return "route";
    case RpcKind::kProbe:
      return "probe";
  }
  return "?";
}

const char* GrpcCodeName(int code) {
  static constexpr const char* kNames[kNumGrpcCodes] = {"OK",
                                                        "CANCELLED",
                                                        "UNKNOWN",
                                                        "INVALID_ARGUMENT",
                                                        "DEADLINE_EXCEEDED",
                                                        "NOT_FOUND",
                                                        "ALREADY_EXISTS",
                                                        "PERMISSION_DENIED",
                                                        "RESOURCE_EXHAUSTED",
                                                        "FAILED_PRECONDITION",
                                                        "ABORTED",
                                                        "OUT_OF_RANGE",
                                                        "UNIMPLEMENTED",
                                                        "INTERNAL",
                                                        "UNAVAILABLE",
                                                        "DATA_LOSS",
                                                        "UNAUTHENTICATED"};
  return code >= 0 && code < kNumGrpcCodes ? kNames[code] : "?";
}

absl::StatusOr<RpcMix> RpcMix::Parse(absl::string_view spec) {
  RpcMix mix;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, ':');
    uint32_t w = 0;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &w)) {
      return absl::InvalidArgumentError(absl::StrCat("--mix: \"", part, "\" is not kind:weight"));
    }
    int kind = -1;
    for (int k = 0; k < kNumRpcKinds; ++k) {
      if (kv[0] == RpcKindName(static_cast<RpcKind>(k))) {
        kind = k;
      }
    }
    if (kind < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix: unknown kind \"", kv[0], "\" (match, insert, release, route)"));
    }
    mix.weights_[kind] += w;
    mix.total_ += w;
  }
  if (mix.total_ == 0) {
    return absl::InvalidArgumentError("--mix: all weights are 0");
  }
  return mix;
}

RpcKind RpcMix::Draw(std::mt19937_64& rng) const {
  uint32_t x = static_cast<uint32_t>(rng() % total_);
  for (int k = 0; k < kNumRpcKinds; ++k) {
    if (x < weights_[k]) {
      return static_cast<RpcKind>(k);
    }
    x -= weights_[k];
  }
  return RpcKind::kMatch;
}

std::string RpcMix::ToString() const {
  std::vector<std::string> parts;
  for (int k = 0; k < kNumRpcKinds; ++k) {
    if (weights_[k] > 0) {
      parts.push_back(absl::StrCat(RpcKindName(static_cast<RpcKind>(k)), ":", weights_[k]));
    }
  }
  return absl::StrJoin(parts, ",");
}

void KindStats::Merge(const KindStats& other) {
  latency.Merge(other.latency);
  for (int c = 0; c < kNumGrpcCodes; ++c) {
    codes[c] += other.codes[c];
  }
  pages += other.pages;
  hit_pages += other.hit_pages;
}

void RunStats::Merge(const RunStats& other) {
  for (int k = 0; k < kNumRpcKinds; ++k) {
    kinds[k].Merge(other.kinds[k]);
  }
  unsent += other.unsent;
}

uint64_t RunStats::calls() const {
  uint64_t n = 0;
  for (const KindStats& k : kinds) {
    n += k.calls();
  }
  return n;
}

uint64_t RunStats::errors() const {
  uint64_t n = 0;
  for (const KindStats& k : kinds) {
    n += k.errors();
  }
  return n;
}

void WorkerStats::Record(RpcKind kind, int grpc_code, int64_t latency_ns, bool measured) {
  const int code = grpc_code >= 0 && grpc_code < kNumGrpcCodes ? grpc_code : 2;  // UNKNOWN
  std::lock_guard<std::mutex> lock(mu_);
  KindStats& i = interval_.kinds[static_cast<int>(kind)];
  i.latency.Record(latency_ns);
  ++i.codes[code];
  if (measured) {
    KindStats& t = total_.kinds[static_cast<int>(kind)];
    t.latency.Record(latency_ns);
    ++t.codes[code];
  }
}

void WorkerStats::RecordPages(RpcKind kind, uint64_t pages, uint64_t hit_pages, bool measured) {
  std::lock_guard<std::mutex> lock(mu_);
  KindStats& i = interval_.kinds[static_cast<int>(kind)];
  i.pages += pages;
  i.hit_pages += hit_pages;
  if (measured) {
    KindStats& t = total_.kinds[static_cast<int>(kind)];
    t.pages += pages;
    t.hit_pages += hit_pages;
  }
}

void WorkerStats::AddUnsent(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  total_.unsent += n;
}

void WorkerStats::TakeInterval(RunStats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->Merge(interval_);
  interval_.Clear();
}

void WorkerStats::AddTotal(RunStats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->Merge(total_);
}

namespace {

double Us(int64_t ns) { return static_cast<double>(ns) / 1000.0; }

// Percent of the prompts' pages that hit; -1 without pages.
double HitPercent(const KindStats& k) {
  return k.pages == 0 ? -1 : 100.0 * static_cast<double>(k.hit_pages) / k.pages;
}

std::string ErrorList(const KindStats& k) {
  std::vector<std::string> parts;
  for (int c = 1; c < kNumGrpcCodes; ++c) {
    if (k.codes[c] > 0) {
      parts.push_back(absl::StrCat(GrpcCodeName(c), "=", k.codes[c]));
    }
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, ",");
}

}  // namespace

std::string FormatStatsTable(const RunStats& stats, double seconds) {
  std::string out = absl::StrFormat("%-8s %10s %10s %9s %9s %9s %9s %9s %9s %6s  %s\n", "rpc",
                                    "calls", "calls/s", "mean_us", "p50_us", "p90_us", "p99_us",
                                    "p99.9_us", "max_us", "hit%", "errors");
  KindStats all;
  auto row = [&](const char* name, const KindStats& k) {
    const LatencyHistogram& h = k.latency;
    const double hit = HitPercent(k);
    absl::StrAppendFormat(&out, "%-8s %10d %10.0f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %6s  %s\n",
                          name, k.calls(), k.calls() / seconds, h.mean_ns() / 1000.0,
                          Us(h.Percentile(0.5)), Us(h.Percentile(0.9)), Us(h.Percentile(0.99)),
                          Us(h.Percentile(0.999)), Us(h.max_ns()),
                          hit < 0 ? "-" : absl::StrFormat("%.1f", hit), ErrorList(k));
  };
  for (int k = 0; k < kNumRpcKinds; ++k) {
    if (stats.kinds[k].calls() == 0) {
      continue;
    }
    row(RpcKindName(static_cast<RpcKind>(k)), stats.kinds[k]);
    all.Merge(stats.kinds[k]);
  }
  all.pages = all.hit_pages = 0;  // a hit means something else per kind
  row("all", all);
  if (stats.unsent > 0) {
    absl::StrAppendFormat(&out, "unsent (open loop: due before the end, not sent by then): %d\n",
                          stats.unsent);
  }
  return out;
}

std::string FormatIntervalLine(const RunStats& stats, double seconds) {
  std::string out = absl::StrFormat("%.0f calls/s", stats.calls() / seconds);
  for (int k = 0; k < kNumRpcKinds; ++k) {
    const KindStats& s = stats.kinds[k];
    if (s.calls() == 0) {
      continue;
    }
    absl::StrAppendFormat(&out, " | %s %.0f/s p50 %.0f p99 %.0f us",
                          RpcKindName(static_cast<RpcKind>(k)), s.calls() / seconds,
                          Us(s.latency.Percentile(0.5)), Us(s.latency.Percentile(0.99)));
  }
  absl::StrAppendFormat(&out, " | errors %d", stats.errors());
  return out;
}

std::string StatsToJson(const RunStats& stats, double seconds) {
  std::vector<std::string> kinds;
  for (int k = 0; k < kNumRpcKinds; ++k) {
    const KindStats& s = stats.kinds[k];
    if (s.calls() == 0) {
      continue;
    }
    std::vector<std::string> codes;
    for (int c = 1; c < kNumGrpcCodes; ++c) {
      if (s.codes[c] > 0) {
        codes.push_back(absl::StrFormat("\"%s\":%d", GrpcCodeName(c), s.codes[c]));
      }
    }
    const LatencyHistogram& h = s.latency;
    kinds.push_back(absl::StrFormat(
        "\"%s\":{\"calls\":%d,\"calls_per_s\":%.1f,\"mean_us\":%.2f,\"p50_us\":%.2f,"
        "\"p90_us\":%.2f,\"p99_us\":%.2f,\"p999_us\":%.2f,\"max_us\":%.2f,\"pages\":%d,"
        "\"hit_pages\":%d,\"errors\":{%s}}",
        RpcKindName(static_cast<RpcKind>(k)), s.calls(), s.calls() / seconds, h.mean_ns() / 1000.0,
        Us(h.Percentile(0.5)), Us(h.Percentile(0.9)), Us(h.Percentile(0.99)),
        Us(h.Percentile(0.999)), Us(h.max_ns()), s.pages, s.hit_pages, absl::StrJoin(codes, ",")));
  }
  return absl::StrFormat(
      "{\"seconds\":%.3f,\"calls\":%d,\"calls_per_s\":%.1f,\"errors\":%d,\"unsent\":%d,"
      "\"rpcs\":{%s}}",
      seconds, stats.calls(), stats.calls() / seconds, stats.errors(), stats.unsent,
      absl::StrJoin(kinds, ","));
}

}  // namespace kvcm::load
