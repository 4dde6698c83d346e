#include "bench/replay/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvcm::bench {
namespace {

// One output column: its name and its value for a row, already formatted.
struct Column {
  const char* name;
  bool numeric;  // written bare in JSON; strings are quoted
  std::function<std::string(const ResultRow&)> value;
};

std::string Num(double v) { return absl::StrFormat("%.10g", v); }
std::string Num(uint64_t v) { return absl::StrCat(v); }

const std::vector<Column>& Columns() {
  static const auto* const columns = new std::vector<Column>{
      {"workload", false, [](const ResultRow& r) { return r.workload; }},
      {"policy", false, [](const ResultRow& r) { return r.policy; }},
      {"capacity_fraction", true, [](const ResultRow& r) { return Num(r.capacity_fraction); }},
      {"mode", false, [](const ResultRow& r) { return r.mode; }},
      {"gpus", true, [](const ResultRow& r) { return Num(uint64_t{r.gpus}); }},
      {"route", false, [](const ResultRow& r) { return r.route; }},
      {"backing", false, [](const ResultRow& r) { return r.backing; }},
      {"requests", true, [](const ResultRow& r) { return Num(r.result.requests); }},
      {"prompt_tokens", true, [](const ResultRow& r) { return Num(r.result.prompt_tokens()); }},
      {"hit_tokens", true, [](const ResultRow& r) { return Num(r.result.hit_tokens()); }},
      {"token_hit_rate", true, [](const ResultRow& r) { return Num(r.result.TokenHitRate()); }},
      {"requests_with_hit", true,
       [](const ResultRow& r) { return Num(r.result.requests_with_hit); }},
      {"request_hit_rate", true, [](const ResultRow& r) { return Num(r.result.RequestHitRate()); }},
      {"prefill_tokens_saved", true, [](const ResultRow& r) { return Num(r.result.hit_tokens()); }},
      {"transferred_pages", true,
       [](const ResultRow& r) { return Num(r.result.transferred_pages); }},
      {"recomputed_remote_pages", true,
       [](const ResultRow& r) { return Num(r.result.recomputed_remote_pages); }},
      {"evicted_pages", true, [](const ResultRow& r) { return Num(r.result.evicted_pages); }},
      {"eviction_regret_pages", true,
       [](const ResultRow& r) { return Num(r.result.eviction_regret_pages); }},
      {"failed_inserts", true, [](const ResultRow& r) { return Num(r.result.failed_inserts); }},
      {"lease_expiries", true, [](const ResultRow& r) { return Num(r.result.lease_expiries); }},
      {"select_switches", true, [](const ResultRow& r) { return Num(r.result.select_switches); }},
      {"select_choice", false, [](const ResultRow& r) { return r.result.select_choice; }},
      {"index_pages", true, [](const ResultRow& r) { return Num(r.result.index_pages); }},
      {"select_shadow_pages", true,
       [](const ResultRow& r) { return Num(r.result.select_shadow_pages); }},
      {"short_allocations", true,
       [](const ResultRow& r) { return Num(r.result.short_allocations); }},
      {"allocation_evicted_pages", true,
       [](const ResultRow& r) { return Num(r.result.allocation_evicted_pages); }},
      {"allocation_room_refusals", true,
       [](const ResultRow& r) { return Num(r.result.allocation_room_refusals); }},
      {"agent_demotions", true, [](const ResultRow& r) { return Num(r.result.agent_demotions); }},
      {"agent_failed_demotions", true,
       [](const ResultRow& r) { return Num(r.result.agent_failed_demotions); }},
      {"agent_full_checks", true,
       [](const ResultRow& r) { return Num(r.result.agent_full_checks); }},
      {"page_ops", true, [](const ResultRow& r) { return Num(r.result.page_ops); }},
      {"core_seconds", true, [](const ResultRow& r) { return Num(r.result.core_seconds); }},
      {"page_ops_per_s", true, [](const ResultRow& r) { return Num(r.result.PageOpsPerSecond()); }},
      {"capacity_bytes_per_gpu", true,
       [](const ResultRow& r) { return Num(r.result.capacity_bytes_per_gpu); }},
      {"distinct_pages", true, [](const ResultRow& r) { return Num(r.result.distinct_pages); }},
      {"bytes_per_page", true, [](const ResultRow& r) { return Num(r.result.bytes_per_page); }},
      {"page_size_tokens", true,
       [](const ResultRow& r) { return Num(uint64_t{r.result.page_size_tokens}); }},
      {"simulated_seconds", true,
       [](const ResultRow& r) { return Num(r.result.simulated_seconds); }},
  };
  return *columns;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
    } else {
      out.push_back(c);
    }
  }
  return out + "\"";
}

// RFC 4180: quote a field holding a comma, a quote or a line break.
std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"') out.push_back('"');
    out.push_back(c);
  }
  return out + "\"";
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot create ", path));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    return absl::DataLossError(absl::StrCat("error writing ", path));
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatTable(std::span<const ResultRow> rows) {
  std::string out = absl::StrFormat(
      "%-16s %-8s %7s %-6s %4s %-7s %8s %8s %14s %10s %9s %8s %9s %9s %s\n", "workload", "policy",
      "cap", "mode", "gpus", "backing", "tok_hit%", "req_hit%", "saved_tokens", "evicted", "regret",
      "failed", "xfer_pg", "Mops/s", "choice");
  for (const ResultRow& row : rows) {
    const ReplayResult& r = row.result;
    out += absl::StrFormat(
        "%-16s %-8s %6.2f%% %-6s %4d %-7s %8.2f %8.2f %14d %10d %9d %8d %9d %9.2f %s\n",
        row.workload, row.policy, row.capacity_fraction * 100, row.mode, row.gpus, row.backing,
        r.TokenHitRate() * 100, r.RequestHitRate() * 100, r.hit_tokens(), r.evicted_pages,
        r.eviction_regret_pages, r.failed_inserts, r.transferred_pages, r.PageOpsPerSecond() / 1e6,
        r.select_choice.empty()
            ? ""
            : absl::StrCat(r.select_choice, " after ", r.select_switches, " moves"));
  }
  return out;
}

std::string FormatBackingComparison(std::span<const ResultRow> rows) {
  struct Pair {
    const ResultRow* index;
    const ResultRow* agent;
    double diff;  // points, agent - index
  };
  std::vector<Pair> pairs;
  for (const ResultRow& a : rows) {
    if (a.backing != "agent") continue;
    for (const ResultRow& i : rows) {
      if (i.backing == "index" && i.workload == a.workload && i.policy == a.policy &&
          i.capacity_fraction == a.capacity_fraction && i.mode == a.mode) {
        pairs.push_back({&i, &a, (a.result.TokenHitRate() - i.result.TokenHitRate()) * 100});
        break;
      }
    }
  }
  std::string out = absl::StrFormat(
      "\ntoken hit rate, index-only vs agent-backed pools (points; agent - index)\n"
      "%-16s %-8s %7s %-6s %9s %9s %8s %10s %10s %8s %8s %9s\n",
      "workload", "policy", "cap", "mode", "index%", "agent%", "diff", "idx_evict", "agt_evict",
      "idx_fail", "agt_fail", "short_alc");
  double worst = 0;
  const Pair* worst_pair = nullptr;
  for (const Pair& p : pairs) {
    const ReplayResult& i = p.index->result;
    const ReplayResult& a = p.agent->result;
    out += absl::StrFormat("%-16s %-8s %6.2f%% %-6s %9.4f %9.4f %+8.4f %10d %10d %8d %8d %9d\n",
                           p.agent->workload, p.agent->policy, p.agent->capacity_fraction * 100,
                           p.agent->mode, i.TokenHitRate() * 100, a.TokenHitRate() * 100, p.diff,
                           i.evicted_pages, a.evicted_pages, i.failed_inserts, a.failed_inserts,
                           a.short_allocations);
    if (worst_pair == nullptr || std::abs(p.diff) > worst) {
      worst = std::abs(p.diff);
      worst_pair = &p;
    }
  }
  if (worst_pair != nullptr) {
    out += absl::StrFormat("largest |difference|: %.4f points (%s %s %.2f%% %s)\n", worst,
                           worst_pair->agent->workload, worst_pair->agent->policy,
                           worst_pair->agent->capacity_fraction * 100, worst_pair->agent->mode);
  }
  return out;
}

absl::Status WriteCsv(const std::string& path, std::span<const ResultRow> rows) {
  std::vector<std::string> names;
  for (const Column& c : Columns()) names.push_back(c.name);
  std::string text = absl::StrJoin(names, ",") + "\n";
  for (const ResultRow& row : rows) {
    std::vector<std::string> values;
    for (const Column& c : Columns()) values.push_back(CsvField(c.value(row)));
    text += absl::StrJoin(values, ",") + "\n";
  }
  return WriteFile(path, text);
}

absl::Status WriteJson(const std::string& path,
                       std::span<const std::pair<std::string, std::string>> config,
                       std::span<const ResultRow> rows) {
  std::string text = "{\n  \"config\": {";
  for (size_t i = 0; i < config.size(); ++i) {
    absl::StrAppend(&text, i == 0 ? "\n    " : ",\n    ", JsonString(config[i].first), ": ",
                    JsonString(config[i].second));
  }
  text += "\n  },\n  \"results\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    text += i == 0 ? "\n    {" : ",\n    {";
    bool first = true;
    for (const Column& c : Columns()) {
      const std::string v = c.value(rows[i]);
      absl::StrAppend(&text, first ? "" : ", ", JsonString(c.name), ": ",
                      c.numeric ? v : JsonString(v));
      first = false;
    }
    text += "}";
  }
  text += "\n  ]\n}\n";
  return WriteFile(path, text);
}

ProgressBar::ProgressBar(size_t total_runs)
    : enabled_(isatty(STDERR_FILENO) == 1), total_runs_(total_runs) {}

void ProgressBar::Finish() {
  if (enabled_ && drawn_width_ > 0) {
    std::fprintf(stderr, "\r%*s\r", static_cast<int>(drawn_width_), "");
    std::fflush(stderr);
    drawn_width_ = 0;
  }
}

void ProgressBar::Update(size_t run, const std::string& label, size_t done, size_t total) {
  if (!enabled_) return;
  constexpr int kWidth = 30;
  const double runs_done =
      total_runs_ == 0 ? 1 : (run + (total == 0 ? 1.0 : double(done) / total)) / total_runs_;
  const int filled = std::clamp(static_cast<int>(runs_done * kWidth), 0, kWidth);
  const std::string line =
      absl::StrFormat("[%s%s] %d/%d %s  %d/%d", std::string(filled, '='),
                      std::string(kWidth - filled, ' '), run + 1, total_runs_, label, done, total);
  // Pad over what the previous, possibly longer, line left.
  std::fprintf(stderr, "\r%-*s", static_cast<int>(std::max(drawn_width_, line.size())),
               line.c_str());
  std::fflush(stderr);
  drawn_width_ = line.size();
}

}  // namespace kvcm::bench
