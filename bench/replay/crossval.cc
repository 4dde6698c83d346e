#include "bench/replay/crossval.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/replay/generators.h"
#include "bench/replay/report.h"
#include "server/core/policies/registry.h"

namespace kvcm::bench {
namespace {

// Fixed keys: tenants' pages must differ even for equal tokens (different namespaces).
constexpr HashKey kTenantKeys[] = {{0x6b76636d2d62656eULL, 0x63682d7265706c61ULL},
                                   {0x6b76636d2d6d6978ULL, 0x74656e616e742d31ULL}};
// Below this many points between lru and opt a cell has no gap to close (n/a).
constexpr double kMinGapPoints = 0.1;

// The requests of `trace` that arrive in [from_ms, to_ms), as a trace named `name`.
Trace TimeSlice(const Trace& trace, std::string name, double from_ms, double to_ms) {
  Trace out{.name = std::move(name), .page_size_tokens = trace.page_size_tokens};
  for (const TraceRequest& r : trace.requests) {
    if (r.arrival_ms >= from_ms && r.arrival_ms < to_ms) out.requests.push_back(r);
  }
  return out;
}

// Two token workloads interleaved by arrival time, the second as tenant 1.
Trace Mix(std::string name, const std::vector<TokenRequest>& a, const std::vector<TokenRequest>& b,
          uint32_t page_size) {
  Trace out = HashTokenTrace(std::move(name), a, kTenantKeys[0], page_size);
  Trace second = HashTokenTrace("", b, kTenantKeys[1], page_size);
  for (TraceRequest& r : second.requests) {
    r.tenant = 1;
    out.requests.push_back(std::move(r));
  }
  std::stable_sort(
      out.requests.begin(), out.requests.end(),
      [](const TraceRequest& x, const TraceRequest& y) { return x.arrival_ms < y.arrival_ms; });
  return out;
}

// Generator shapes: 0 the defaults (ARCHITECTURE section 11), 1 the train variant, 2 and 3
// the test variants. Seeds differ per part too.
GeneratorOptions Shape(int shape, uint64_t seed, bool smoke) {
  GeneratorOptions g;
  g.arrival.seed = seed;
  switch (shape) {
    case 1:
      g.chat.system_prompts = 5;
      g.few_shot.prefix_tokens = 700;
      g.multi_turn = {.conversations = 150, .turns = 6, .system_prompts = 2};
      g.shared_prefix = {.groups = 48, .prompts_per_group = 20, .system_tokens = 1536};
      g.random.id_range = 50000;
      g.agent = {.sessions = 150, .concurrent = 24, .steps = 8, .system_prompts = 3};
      g.rag = {.documents = 600, .zipf_s = 0.8};
      g.scan = {.hot_prompts = 300, .zipf_s = 1.0, .scan_every = 80};
      break;
    case 2:
      g.chat = {.requests = 1500, .system_prompts = 10, .message_tokens = 100};
      g.few_shot = {.requests = 1200, .prefix_tokens = 1000, .query_tokens = 60};
      g.multi_turn = {.conversations = 200, .turns = 8, .turn_tokens = 60, .system_prompts = 4};
      g.shared_prefix = {.groups = 32, .prompts_per_group = 32, .system_tokens = 1024};
      g.random.prompt_tokens = 200;
      g.agent = {.sessions = 100,
                 .concurrent = 8,
                 .steps = 14,
                 .system_tokens = 2500,
                 .result_tokens = 200,
                 .system_prompts = 1};
      g.rag = {.requests = 2000,
               .documents = 1000,
               .document_tokens = 512,
               .docs_per_request = 4,
               .zipf_s = 1.1};
      g.scan = {.hot_prompts = 400,
                .hot_prefix_tokens = 1024,
                .zipf_s = 0.7,
                .scan_every = 50,
                .scan_length = 20,
                .scan_tokens = 2048};
      g.arrival.request_rate_per_s = 8;
      break;
    case 3:
      g.chat = {.requests = 800, .system_prompts = 2, .system_tokens = 400};
      g.few_shot.query_tokens = 100;
      g.multi_turn = {.conversations = 60,
                      .turns = 12,
                      .system_tokens = 300,
                      .turn_tokens = 30,
                      .system_prompts = 3};
      g.shared_prefix = {.groups = 96, .prompts_per_group = 10, .system_tokens = 3072};
      g.agent = {.sessions = 80,
                 .concurrent = 32,
                 .steps = 6,
                 .task_tokens = 300,
                 .call_tokens = 80,
                 .result_tokens = 600,
                 .system_prompts = 4};
      g.rag = {.documents = 200,
               .docs_per_request = 5,
               .zipf_s = 0.6,
               .system_tokens = 600,
               .question_tokens = 80};
      g.scan = {.requests = 1500,
                .hot_prompts = 100,
                .hot_body_tokens = 512,
                .zipf_s = 1.2,
                .scan_every = 200,
                .scan_length = 100,
                .scan_tokens = 512};
      g.arrival.request_rate_per_s = 2;
      break;
    default:
      break;
  }
  if (smoke) g.ShrinkForSmoke();
  return g;
}

struct Cell {
  double lru = 0, opt = 0;
  std::map<std::string, double> hit;  // by policy, token hit rate in %
};

std::string Percent(double v) { return absl::StrFormat("%.2f", v); }

// Share of the lru->opt gap closed, or nullopt when there is none.
std::optional<double> GapClosed(double policy, double lru, double opt) {
  if (opt - lru < kMinGapPoints) return std::nullopt;
  return (policy - lru) / (opt - lru);
}

// The tunable parameters of the learning policies; each grid sets one policy's.
struct Tuning {
  AdaptiveParams adaptive;
  DensityParams density;
  ConversationParams conversation;
  SelectParams select = ReplayOptions{}.select;
};

std::string AdaptiveName(const AdaptiveParams& p) {
  return absl::StrFormat("init %.2g step %.2g max %.2g", p.initial_credit, p.step, p.max_credit);
}

std::string DensityName(const DensityParams& p) {
  return absl::StrFormat("%u reuse class%s, lru guard %s", p.reuse_classes,
                         p.reuse_classes == 1 ? "" : "es", p.lru_guard ? "on" : "off");
}

class Evaluation {
 public:
  explicit Evaluation(const CrossvalOptions& options) : options_(options) {}

  absl::StatusOr<double> Run(const CrossvalWorkload& w, const std::string& policy, double capacity,
                             const Tuning& tuning) {
    ReplayOptions o = options_.base;
    o.policy = policy;
    o.spec = w.specs[0];
    o.spec.page_size_tokens = w.trace.page_size_tokens;
    o.extra_specs.assign(w.specs.begin() + 1, w.specs.end());
    for (ModelSpec& s : o.extra_specs) s.page_size_tokens = w.trace.page_size_tokens;
    o.capacity_fraction = capacity;
    o.adaptive = tuning.adaptive;
    o.density = tuning.density;
    o.conversation = tuning.conversation;
    o.select = tuning.select;
    absl::StatusOr<ReplayResult> r = Replay(w.trace, o);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat(w.name, " ", policy, " ", capacity, ": ",
                                                          r.status().message()));
    }
    rows_.push_back(ResultRow{.workload = absl::StrCat(w.train ? "train:" : "test:", w.name),
                              .policy = policy,
                              .capacity_fraction = capacity,
                              .mode = std::string(ClusterModeName(o.mode)),
                              .gpus = o.gpus,
                              .route = std::string(RoutePolicyName(o.route)),
                              .result = *r});
    return 100 * r->TokenHitRate();
  }

  const std::vector<ResultRow>& rows() const { return rows_; }

 private:
  const CrossvalOptions& options_;
  std::vector<ResultRow> rows_;
};

// Mean gap closed and cells below lru of one policy over some workloads' cells.
struct Score {
  double sum = 0;
  int cells = 0;
  int below = 0;
  double mean() const { return cells > 0 ? sum / cells : 0; }
};

void Add(Score& s, double hit, double lru, double opt) {
  if (hit < lru - 1e-9) ++s.below;
  if (std::optional<double> g = GapClosed(hit, lru, opt); g.has_value()) {
    s.sum += *g;
    ++s.cells;
  }
}

// Replays `policy` with each point of `grid` on the train part's real traces (generators
// choose nothing), prints each point's score,
// and returns the index of the best: fewest cells below lru, then the largest mean share of
// the gap closed (the first such point on a tie).
absl::StatusOr<size_t> ChooseOnTrain(Evaluation& eval,
                                     const std::vector<CrossvalWorkload>& workloads,
                                     const std::vector<double>& caps,
                                     const std::vector<std::vector<Cell>>& cells,
                                     const std::string& policy, const std::vector<Tuning>& grid,
                                     const std::vector<std::string>& names) {
  std::printf("\n## Choosing %s's parameters on the train part's real traces\n\n", policy.c_str());
  std::printf("| parameters | train cells below lru | mean gap closed (train) |\n|---|---|---|\n");
  size_t best = 0;
  Score best_score;
  for (size_t k = 0; k < grid.size(); ++k) {
    Score s;
    for (size_t w = 0; w < workloads.size(); ++w) {
      if (!workloads[w].train || !workloads[w].real) continue;
      for (size_t c = 0; c < caps.size(); ++c) {
        absl::StatusOr<double> hit = eval.Run(workloads[w], policy, caps[c], grid[k]);
        if (!hit.ok()) return hit.status();
        Add(s, *hit, cells[w][c].lru, cells[w][c].opt);
      }
    }
    std::printf("| %s | %d | %.1f %% |\n", names[k].c_str(), s.below, 100 * s.mean());
    std::fflush(stdout);
    if (k == 0 || s.below < best_score.below ||
        (s.below == best_score.below && s.mean() > best_score.mean())) {
      best = k;
      best_score = s;
    }
  }
  std::printf("\nchosen: %s\n", names[best].c_str());
  return best;
}

// Replays select with each point of `grid` on every train cell, real and generated (select
// is judged against its candidates, which every workload has), prints each point's score,
// and returns the index of the best: fewest cells more than 0.5 point below lru (the
// issue's bound), then the highest mean of select - the best candidate of the cell (the
// first such point on a tie). REQUIRES: the candidates' hits in `cells`.
absl::StatusOr<size_t> ChooseSelectOnTrain(Evaluation& eval,
                                           const std::vector<CrossvalWorkload>& workloads,
                                           const std::vector<double>& caps,
                                           const std::vector<std::vector<Cell>>& cells,
                                           const std::vector<std::string>& candidates,
                                           const std::vector<Tuning>& grid,
                                           const std::vector<std::string>& names) {
  std::printf("\n## Choosing select's parameters on every train cell\n\n");
  std::printf(
      "| parameters | train cells below lru - 0.5 | mean select - best | worst select - best "
      "|\n|---|---|---|---|\n");
  size_t best = 0;
  int best_below = 0;
  double best_mean = 0;
  for (size_t k = 0; k < grid.size(); ++k) {
    int below = 0, n = 0;
    double sum = 0, worst = 0;
    for (size_t w = 0; w < workloads.size(); ++w) {
      if (!workloads[w].train) continue;
      for (size_t c = 0; c < caps.size(); ++c) {
        absl::StatusOr<double> hit = eval.Run(workloads[w], "select", caps[c], grid[k]);
        if (!hit.ok()) return hit.status();
        const Cell& cell = cells[w][c];
        double top = cell.lru;
        for (const std::string& policy : candidates) top = std::max(top, cell.hit.at(policy));
        if (*hit < cell.lru - 0.5) ++below;
        sum += *hit - top;
        worst = std::min(worst, *hit - top);
        ++n;
      }
    }
    const double mean = n > 0 ? sum / n : 0;
    std::printf("| %s | %d | %.2f | %.2f |\n", names[k].c_str(), below, mean, worst);
    std::fflush(stdout);
    if (k == 0 || below < best_below || (below == best_below && mean > best_mean)) {
      best = k;
      best_below = below;
      best_mean = mean;
    }
  }
  std::printf("\nchosen: %s\n", names[best].c_str());
  return best;
}

}  // namespace

absl::StatusOr<std::vector<CrossvalWorkload>> BuildCrossvalWorkloads(
    const CrossvalOptions& options) {
  std::vector<CrossvalWorkload> out;
  absl::StatusOr<Trace> mooncake = ReadMooncakeTrace(
      options.mooncake_trace, MooncakeReadOptions{.max_requests = options.smoke ? 600u : 0u});
  if (!mooncake.ok()) return mooncake.status();
  if (mooncake->requests.empty()) return absl::InvalidArgumentError("empty Mooncake trace");
  const double first = mooncake->requests.front().arrival_ms;
  const double mid = (first + mooncake->requests.back().arrival_ms) / 2;
  out.push_back({"mooncake-1st-half",
                 true,
                 true,
                 TimeSlice(*mooncake, "mooncake-1st-half", first, mid),
                 {options.mla}});
  CrossvalWorkload second{"mooncake-2nd-half",
                          false,
                          true,
                          TimeSlice(*mooncake, "mooncake-2nd-half", mid, 1e300),
                          {options.mla}};

  constexpr uint32_t kPage = 16;
  // Train: seed 1 default shapes, seed 2 the first variant; test: seeds 3 and 4, the others.
  struct Part {
    bool train;
    int shape;
    uint64_t seed;
  };
  const Part parts[] = {{true, 0, 1}, {true, 1, 2}, {false, 2, 3}, {false, 3, 4}};
  std::vector<CrossvalWorkload> test;
  for (const Part& part : parts) {
    const GeneratorOptions g = Shape(part.shape, part.seed, options.smoke);
    for (absl::string_view name : kGeneratorNames) {
      absl::StatusOr<std::vector<TokenRequest>> requests = GenerateByName(name, g);
      if (!requests.ok()) return requests.status();
      const std::string label = absl::StrCat(name, "/shape", part.shape, "/seed", part.seed);
      CrossvalWorkload w{label,
                         part.train,
                         false,
                         HashTokenTrace(label, *requests, kTenantKeys[0], kPage),
                         {options.mla}};
      (part.train ? out : test).push_back(std::move(w));
    }
  }
  // Mixes: two workloads of two models under two tenants, sharing the pool.
  struct MixSpec {
    bool train;
    const char* a;
    const char* b;
    int shape;
    uint64_t seed;
  };
  const MixSpec mixes[] = {{true, "multi-turn", "gsp", 0, 5},
                           {false, "chat", "multi-turn", 2, 6},
                           {false, "gsp", "multi-turn", 3, 7}};
  for (const MixSpec& m : mixes) {
    GeneratorOptions ga = Shape(m.shape, m.seed, options.smoke);
    GeneratorOptions gb = Shape(m.shape, m.seed + 100, options.smoke);
    absl::StatusOr<std::vector<TokenRequest>> a = GenerateByName(m.a, ga);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<TokenRequest>> b = GenerateByName(m.b, gb);
    if (!b.ok()) return b.status();
    const ModelSpec& gqa = m.train ? options.gqa_train : options.gqa_test;
    const std::string label =
        absl::StrCat("mix:", m.a, "(", options.mla_name, ")+", m.b, "(",
                     m.train ? options.gqa_train_name : options.gqa_test_name, ")/seed", m.seed);
    CrossvalWorkload w{label, m.train, false, Mix(label, *a, *b, kPage), {options.mla, gqa}};
    (m.train ? out : test).push_back(std::move(w));
  }
  test.insert(test.begin(), std::move(second));
  for (const std::string& path : options.extra_test_traces) {
    absl::StatusOr<Trace> t =
        ReadMooncakeTrace(path, MooncakeReadOptions{.max_requests = options.smoke ? 600u : 0u});
    if (!t.ok()) return t.status();
    const size_t slash = path.find_last_of('/');
    t->name = slash == std::string::npos ? path : path.substr(slash + 1);
    test.push_back({t->name, false, true, std::move(*t), {options.mla}});
  }
  for (CrossvalWorkload& w : test) out.push_back(std::move(w));
  return out;
}

// select's margin to the best candidate and to lru in every cell, and the worst of each.
void PrintSelectAgainstBest(const std::vector<CrossvalWorkload>& workloads,
                            const std::vector<double>& caps,
                            const std::vector<std::vector<Cell>>& cells) {
  std::printf(
      "\n## select against the best candidate of each cell (points of token hit rate)\n\n"
      "Each cell: select - best candidate (which one) / select - lru.\n\n");
  std::vector<std::string> header;
  for (double cap : caps) header.push_back(absl::StrCat(cap * 100, " %"));
  std::printf("| part | workload | %s |\n|---|---|%s\n", absl::StrJoin(header, " | ").c_str(),
              absl::StrJoin(std::vector<std::string>(caps.size(), "---|"), "").c_str());
  double worst_best = 1e300, worst_lru = 1e300, sum_best = 0;
  int n = 0;
  for (size_t w = 0; w < workloads.size(); ++w) {
    std::vector<std::string> out;
    for (size_t c = 0; c < caps.size(); ++c) {
      const Cell& cell = cells[w][c];
      std::string best_name = "lru";
      for (const PolicyEntry& row : PolicyTable()) {
        if (!row.candidate) continue;
        const std::string name(row.name);
        if (cell.hit.contains(name) && cell.hit.at(name) > cell.hit.at(best_name)) {
          best_name = name;
        }
      }
      const double to_best = cell.hit.at("select") - cell.hit.at(best_name);
      const double to_lru = cell.hit.at("select") - cell.lru;
      worst_best = std::min(worst_best, to_best);
      worst_lru = std::min(worst_lru, to_lru);
      sum_best += to_best;
      ++n;
      out.push_back(absl::StrFormat("%+.2f (%s) / %+.2f%s", to_best, best_name, to_lru,
                                    to_lru < -0.5 ? " **below lru - 0.5**" : ""));
    }
    std::printf("| %s | %s | %s |\n", workloads[w].train ? "train" : "test",
                workloads[w].name.c_str(), absl::StrJoin(out, " | ").c_str());
  }
  std::printf(
      "\nselect - best candidate: worst %+.2f, mean %+.2f points; select - lru: worst %+.2f "
      "points (%d cells)\n",
      worst_best, n > 0 ? sum_best / n : 0, worst_lru, n);
}

absl::Status RunCrossval(const CrossvalOptions& options) {
  absl::StatusOr<std::vector<CrossvalWorkload>> workloads = BuildCrossvalWorkloads(options);
  if (!workloads.ok()) return workloads.status();
  if (options.train_only) {
    std::erase_if(*workloads, [](const CrossvalWorkload& w) { return !w.train; });
  }
  Evaluation eval(options);
  const std::vector<double>& caps = options.capacities;

  // lru and opt of every cell first: every score needs them.
  std::vector<std::vector<Cell>> cells(workloads->size(), std::vector<Cell>(caps.size()));
  for (size_t w = 0; w < workloads->size(); ++w) {
    for (size_t c = 0; c < caps.size(); ++c) {
      for (const char* policy : {"lru", "opt", "cost"}) {
        absl::StatusOr<double> hit = eval.Run((*workloads)[w], policy, caps[c], {});
        if (!hit.ok()) return hit.status();
        cells[w][c].hit[policy] = *hit;
      }
      cells[w][c].lru = cells[w][c].hit["lru"];
      cells[w][c].opt = cells[w][c].hit["opt"];
    }
  }

  // Each learning policy's grid, scored on the train part only; the chosen point then
  // runs on both parts.
  std::vector<Tuning> adaptive_grid;
  for (double initial : {0.0, 0.5, 1.0}) {
    for (double step : {0.02, 0.1}) {
      for (double max_credit : {1.0, 2.0, 8.0}) {
        adaptive_grid.push_back(
            {.adaptive = {.initial_credit = initial, .max_credit = max_credit, .step = step}});
      }
    }
  }
  std::vector<Tuning> density_grid;
  for (uint32_t classes : {1u, 2u, 4u}) {
    for (bool guard : {false, true}) {
      density_grid.push_back({.density = {.reuse_classes = classes, .lru_guard = guard}});
    }
  }
  std::vector<Tuning> conversation_grid;
  for (double shift : {0.25, 0.5, 1.0, 2.0, 4.0}) {
    conversation_grid.push_back({.conversation = {.shift = shift}});
  }
  if (options.smoke) {
    adaptive_grid.resize(2);
    density_grid.resize(2);
    conversation_grid.resize(2);
  }
  if (options.only_params.has_value()) adaptive_grid = {{.adaptive = *options.only_params}};
  if (options.only_density.has_value()) density_grid = {{.density = *options.only_density}};
  if (options.only_conversation.has_value()) {
    conversation_grid = {{.conversation = *options.only_conversation}};
  }
  std::map<std::string, Tuning> chosen;  // each learning policy's chosen point
  for (const auto& [policy, grid] :
       {std::pair{"adaptive", &adaptive_grid}, std::pair{"density", &density_grid},
        std::pair{"conversation", &conversation_grid}}) {
    std::vector<std::string> names;
    for (const Tuning& t : *grid) {
      const std::string p = policy;
      names.push_back(p == "adaptive"  ? AdaptiveName(t.adaptive)
                      : p == "density" ? DensityName(t.density)
                                       : absl::StrFormat("shift %.2g", t.conversation.shift));
    }
    absl::StatusOr<size_t> best =
        ChooseOnTrain(eval, *workloads, caps, cells, policy, *grid, names);
    if (!best.ok()) return best.status();
    chosen[policy] = (*grid)[*best];
    for (size_t w = 0; w < workloads->size(); ++w) {
      for (size_t c = 0; c < caps.size(); ++c) {
        absl::StatusOr<double> hit = eval.Run((*workloads)[w], policy, caps[c], (*grid)[*best]);
        if (!hit.ok()) return hit.status();
        cells[w][c].hit[policy] = *hit;
      }
    }
  }

  // A candidate of the policy table with no grid here (a new one) runs with its defaults.
  std::vector<std::string> candidates;
  for (const PolicyEntry& row : PolicyTable()) {
    if (row.candidate) candidates.emplace_back(row.name);
  }
  for (const std::string& policy : candidates) {
    if (cells.empty() || cells[0].empty() || cells[0][0].hit.contains(policy)) continue;
    for (size_t w = 0; w < workloads->size(); ++w) {
      for (size_t c = 0; c < caps.size(); ++c) {
        absl::StatusOr<double> hit = eval.Run((*workloads)[w], policy, caps[c], {});
        if (!hit.ok()) return hit.status();
        cells[w][c].hit[policy] = *hit;
      }
    }
  }

  // select over the candidates as chosen; its starting candidate and dwell chosen on the
  // train part too. Its window and margin stay where an earlier grid on the train part's
  // real half put them (a 2 x 2 x 5 grid with windows of 2 and 4 chose the same point, at
  // twice the time); shadow_pages is a bound on memory, not tuned.
  std::vector<Tuning> select_grid;
  for (const std::string& initial : candidates) {
    for (double dwell : {1.0, 4.0}) {
      Tuning t{.adaptive = chosen["adaptive"].adaptive,
               .density = chosen["density"].density,
               .conversation = chosen["conversation"].conversation};
      t.select.initial = initial;
      t.select.dwell_capacities = dwell;
      select_grid.push_back(t);
    }
  }
  if (options.smoke) select_grid.resize(2);
  if (options.only_select.has_value()) {
    select_grid.resize(1);
    select_grid[0].select = *options.only_select;
  }
  std::vector<std::string> select_names;
  for (const Tuning& t : select_grid) {
    select_names.push_back(absl::StrFormat(
        "initial %s, dwell %.2g capacities, window %.2g capacities, margin %.2g points",
        t.select.initial, t.select.dwell_capacities, t.select.window_capacities,
        t.select.margin_points));
  }
  absl::StatusOr<size_t> select_best =
      ChooseSelectOnTrain(eval, *workloads, caps, cells, candidates, select_grid, select_names);
  if (!select_best.ok()) return select_best.status();
  for (size_t w = 0; w < workloads->size(); ++w) {
    for (size_t c = 0; c < caps.size(); ++c) {
      absl::StatusOr<double> hit =
          eval.Run((*workloads)[w], "select", caps[c], select_grid[*select_best]);
      if (!hit.ok()) return hit.status();
      cells[w][c].hit["select"] = *hit;
    }
  }

  // Per workload: hit rates, then the gap closed; "(below lru)" flags a cell.
  // The table's candidates, select, then the bound.
  std::vector<std::string> shown = candidates;
  shown.insert(shown.end(), {"select", "opt"});
  std::vector<std::string> header;
  for (double cap : caps) header.push_back(absl::StrCat(cap * 100, " %"));
  std::printf("\n## Token hit rate (%%) and share of the lru->opt gap closed\n\n");
  std::printf("| part | workload | policy | %s |\n|---|---|---|%s\n",
              absl::StrJoin(header, " | ").c_str(),
              absl::StrJoin(std::vector<std::string>(caps.size(), "---|"), "").c_str());
  // (train, real, policy)
  std::map<std::tuple<bool, bool, std::string>, std::vector<Score>> by_cap;
  for (size_t w = 0; w < workloads->size(); ++w) {
    const CrossvalWorkload& wl = (*workloads)[w];
    for (const std::string& policy : shown) {
      std::vector<std::string> out;
      std::vector<Score>& scores = by_cap[{wl.train, wl.real, policy}];
      scores.resize(caps.size());
      for (size_t c = 0; c < caps.size(); ++c) {
        const Cell& cell = cells[w][c];
        const double hit = cell.hit.at(policy);
        Add(scores[c], hit, cell.lru, cell.opt);
        std::string text = Percent(hit);
        if (policy != "lru" && policy != "opt") {
          std::optional<double> g = GapClosed(hit, cell.lru, cell.opt);
          text += g.has_value() ? absl::StrFormat(" (%.0f %%)", 100 * *g) : " (n/a)";
          if (hit < cell.lru - 1e-9) text += " **below lru**";
        }
        out.push_back(text);
      }
      std::printf("| %s | %s | %s | %s |\n", wl.train ? "train" : "test", wl.name.c_str(),
                  policy.c_str(), absl::StrJoin(out, " | ").c_str());
    }
  }

  std::printf(
      "\n## Summary: mean share of the lru->opt gap closed (cells with a gap), cells "
      "below lru\n\n");
  std::printf(
      "| part | workloads | policy | %s | all | cells below lru |\n|---|---|---|%s---|---|\n",
      absl::StrJoin(header, " | ").c_str(),
      absl::StrJoin(std::vector<std::string>(caps.size(), "---|"), "").c_str());
  for (const auto& [train, real] : {std::pair{true, true}, std::pair{false, true},
                                    std::pair{true, false}, std::pair{false, false}}) {
    std::vector<std::string> summarized(candidates.begin() + 1, candidates.end());  // not lru
    summarized.push_back("select");
    for (const std::string& policy : summarized) {
      const auto it = by_cap.find({train, real, policy});
      if (it == by_cap.end()) continue;
      const std::vector<Score>& scores = it->second;
      Score all;
      std::vector<std::string> out;
      for (const Score& s : scores) {
        out.push_back(absl::StrFormat("%.1f %%", 100 * s.mean()));
        all.sum += s.sum;
        all.cells += s.cells;
        all.below += s.below;
      }
      std::printf("| %s | %s | %s | %s | %.1f %% | %d |\n", train ? "train" : "test",
                  real ? "real traces" : "generators", policy.c_str(),
                  absl::StrJoin(out, " | ").c_str(), 100 * all.mean(), all.below);
    }
  }
  PrintSelectAgainstBest(*workloads, caps, cells);
  if (!options.csv.empty()) return WriteCsv(options.csv, eval.rows());
  return absl::OkStatus();
}

}  // namespace kvcm::bench
