// kvcm_replay_test: the replay simulator's readers, generators and oracle, and the
// replay's correctness over the real CacheIndex: the Mooncake trace's published unbounded
// hit rate, opt as an upper bound of every policy, budgets that never exceed capacity, and
// the worker's path on agent ledgers (PoolBacking::kAgent) against the index-only replay.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "bench/replay/generators.h"
#include "bench/replay/json_line.h"
#include "bench/replay/next_use_oracle.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"
#include "bench/workload.h"
#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/service/server_options.h"

namespace kvcm::bench {
namespace {

using ::testing::HasSubstr;

constexpr const char* kAllPolicies[] = {"lru",     "lru-mha",      "cost", "adaptive",
                                        "density", "conversation", "opt"};
const HashKey kKey{1, 2};

// A file under the test's temporary directory, named by the process so that concurrent
// runs (several build trees) never share it; removed when the test ends.
class TempFile {
 public:
  explicit TempFile(const std::string& name)
      : path_(absl::StrCat(::testing::TempDir(), "kvcm_replay_test_", getpid(), "_", name)) {}
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  const std::string path_;
};

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

ModelSpec Spec(uint32_t page_size_tokens) {
  ModelSpec spec = DeepSeekV3Spec();
  spec.page_size_tokens = page_size_tokens;
  return spec;
}

// Bytes a policy charges per page over the real bytes: "lru-mha" budgets every page at its
// MHA-shaped size (~71x the MLA latent for DeepSeek-V3), the others at the real size.
double ChargeRatio(const std::string& policy, const ModelSpec& spec) {
  return policy == "lru-mha"
             ? static_cast<double>(spec.MhaShapedBytesPerToken()) / spec.BytesPerToken()
             : 1.0;
}

// ---------------------------------------------------------------- JSON lines

TEST(JsonObjectTest, KeepsNumbersAndIntArraysAndSkipsTheRest) {
  absl::StatusOr<JsonObject> o = JsonObject::Parse(
      R"( {"timestamp": 12.5, "n": -3, "ids": [1, 2,3], "empty": [], "s": "a\"b\u0041",
           "nested": {"x": [1, {"y": null}]}, "mixed": [1, "a"], "t": true, "e": 1e3} )");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(*o->Number("timestamp", 0, 100), 12.5);
  EXPECT_EQ(*o->Integer("n", -10, 10), -3);
  EXPECT_THAT(**o->IntArray("ids", 0, 10), ::testing::ElementsAre(1, 2, 3));
  EXPECT_TRUE((*o->IntArray("empty", 0, 10))->empty());
  EXPECT_EQ(*o->Number("e", 0, 1e4), 1000);
  EXPECT_THAT(o->Integer("e", 0, 1e4).status().message(), HasSubstr("must be an integer"));
  EXPECT_THAT(o->IntArray("mixed", 0, 10).status().message(), HasSubstr("array of integers"));
  EXPECT_THAT(o->Integer("s", 0, 1).status().message(), HasSubstr("\"s\" must be an integer"));
  EXPECT_THAT(o->Integer("missing", 0, 1).status().message(), HasSubstr("is missing"));
  EXPECT_EQ(*o->IntegerOr("missing", 0, 1, 1), 1);
  EXPECT_THAT(o->Integer("n", 0, 10).status().message(), HasSubstr("must be in [0, 10]"));
  EXPECT_THAT(o->IntArray("ids", 2, 10).status().message(), HasSubstr("element 0"));
}

TEST(JsonObjectTest, ReportsTheColumnOfSyntaxErrors) {
  EXPECT_THAT(JsonObject::Parse("[1]").status().message(), HasSubstr("column 1: expected '{'"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": 1,})").status().message(), HasSubstr("column 9"));
  EXPECT_THAT(JsonObject::Parse(R"({"a" 1})").status().message(), HasSubstr("expected ':'"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": 01})").status().message(), HasSubstr("expected ','"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": [1, 2})").status().message(), HasSubstr("expected ','"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": 1} x)").status().message(), HasSubstr("unexpected text"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": 1, "a": 2})").status().message(),
              HasSubstr("appears twice"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": 99999999999999999999})").status().message(),
              HasSubstr("does not fit"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": "x)").status().message(), HasSubstr("unterminated"));
  EXPECT_THAT(JsonObject::Parse(R"({"a": tru})").status().message(), HasSubstr("expected a value"));
}

// ---------------------------------------------------------------- traces

TEST(TraceTest, MooncakeKeepsWholeBlocksOrEveryBlock) {
  const TempFile file("mooncake.jsonl");
  const std::string& path = file.path();
  WriteText(path,
            "{\"timestamp\": 5, \"input_length\": 1100, \"output_length\": 7, "
            "\"hash_ids\": [0, 1, 2]}\n"
            "\n"
            "{\"timestamp\": 3, \"input_length\": 1024, \"output_length\": 1, "
            "\"hash_ids\": [0, 1], \"extra\": \"ignored\"}\n");
  absl::StatusOr<Trace> drop = ReadMooncakeTrace(path);
  ASSERT_TRUE(drop.ok()) << drop.status();
  EXPECT_EQ(drop->page_size_tokens, 512u);
  ASSERT_EQ(drop->requests.size(), 2u);
  // Sorted by arrival: the 3 ms request first.
  EXPECT_EQ(drop->requests[0].arrival_ms, 3);
  EXPECT_EQ(drop->requests[1].prompt_tokens, 1100u);
  EXPECT_EQ(drop->requests[1].output_tokens, 7u);
  EXPECT_EQ(drop->requests[1].pages.size(), 2u);  // 1100 tokens: 2 whole blocks of 512
  EXPECT_EQ(drop->requests[1].pages[1], MooncakeBlockPage(1));
  EXPECT_EQ(drop->TotalPages(), 4u);
  EXPECT_EQ(drop->DistinctPages(), 2u);

  absl::StatusOr<Trace> keep =
      ReadMooncakeTrace(path, {.partial_last_block = PartialBlock::kKeepAsBlock});
  ASSERT_TRUE(keep.ok()) << keep.status();
  EXPECT_EQ(keep->requests[1].pages.size(), 3u);
  EXPECT_EQ(keep->DistinctPages(), 3u);

  absl::StatusOr<Trace> first = ReadMooncakeTrace(path, {.max_requests = 1});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->requests.size(), 1u);
}

TEST(TraceTest, MooncakeErrorsNameFileAndLine) {
  const TempFile file("bad_mooncake.jsonl");
  const std::string& path = file.path();
  WriteText(
      path,
      "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n"
      "{\"timestamp\": 0, \"input_length\": 1500, \"output_length\": 1, \"hash_ids\": [0]}\n");
  absl::Status s = ReadMooncakeTrace(path).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(path + ":2: hash_ids has 1 ids but input_length 1500"));

  WriteText(path, "{\"timestamp\": 0, \"input_length\": 512, \"hash_ids\": [0]}\n");
  EXPECT_THAT(ReadMooncakeTrace(path).status().message(),
              HasSubstr(":1: field \"output_length\" is missing"));
  WriteText(path, "\n{\"timestamp\": 0, \"input_length\": 512 \"hash_ids\": [0]}\n");
  EXPECT_THAT(ReadMooncakeTrace(path).status().message(),
              HasSubstr(":2: column 38: expected ',' or '}'"));
  EXPECT_TRUE(absl::IsNotFound(ReadMooncakeTrace(TempFile("missing.jsonl").path()).status()));
}

TEST(TraceTest, TokenTraceRoundTripsAndHashesWholePages) {
  const std::vector<TokenRequest> requests = {
      {.arrival_ms = 0.125, .tokens = {1, 2, 3, 4, 5}, .output_tokens = 9},
      {.arrival_ms = 1e-3, .tokens = {1, 2, 3, 4, -7, 2147483647}, .output_tokens = 0},
      {.arrival_ms = 7, .tokens = {}, .output_tokens = 1}};
  const TempFile file("tokens.jsonl");
  const std::string& path = file.path();
  ASSERT_TRUE(WriteTokenTrace(path, requests).ok());
  absl::StatusOr<std::vector<TokenRequest>> read = ReadTokenTrace(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*read)[i].arrival_ms, requests[i].arrival_ms);
    EXPECT_EQ((*read)[i].tokens, requests[i].tokens);
    EXPECT_EQ((*read)[i].output_tokens, requests[i].output_tokens);
  }
  const Trace trace = HashTokenTrace("t", *read, kKey, 2);
  ASSERT_EQ(trace.requests.size(), 3u);
  EXPECT_EQ(trace.requests[0].arrival_ms, 1e-3);  // sorted by arrival
  EXPECT_EQ(trace.requests[0].pages.size(), 3u);
  EXPECT_EQ(trace.requests[1].pages.size(), 2u);  // 5 tokens: the 5th is a partial page
  EXPECT_EQ(trace.requests[1].prompt_tokens, 5u);
  // Shared first four tokens: equal first two pages.
  EXPECT_EQ(trace.requests[0].pages[1], trace.requests[1].pages[1]);
  EXPECT_NE(trace.requests[0].pages[2], trace.requests[1].pages[0]);
  EXPECT_EQ(trace.DistinctPages(), 3u);

  WriteText(path, "{\"timestamp\": 0, \"tokens\": [1, 2147483648], \"output_length\": 1}\n");
  EXPECT_THAT(ReadTokenTrace(path).status().message(), HasSubstr(":1: field \"tokens\" element 1"));
}

// ---------------------------------------------------------------- generators

// Pages shared by requests a and b of `t`: the length of their common page prefix.
size_t CommonPages(const Trace& t, size_t a, size_t b) {
  const auto& x = t.requests[a].pages;
  const auto& y = t.requests[b].pages;
  size_t n = 0;
  while (n < x.size() && n < y.size() && x[n] == y[n]) ++n;
  return n;
}

TEST(GeneratorsTest, ShapesMatchArchitectureSection11) {
  const GeneratorOptions defaults;
  const Trace chat =
      HashTokenTrace("chat", GenerateChat(defaults.chat, defaults.arrival), kKey, 16);
  ASSERT_EQ(chat.requests.size(), 1000u);
  EXPECT_EQ(chat.requests[0].prompt_tokens, 250u);
  EXPECT_EQ(chat.requests[0].pages.size(), 15u);
  EXPECT_EQ(CommonPages(chat, 0, 3), 12u);  // same system prompt: 192 of its 200 tokens
  EXPECT_EQ(CommonPages(chat, 0, 1), 0u);
  EXPECT_EQ(chat.DistinctPages(), 3 * 12 + 1000 * 3u);

  const Trace few =
      HashTokenTrace("few", GenerateFewShot(defaults.few_shot, defaults.arrival), kKey, 16);
  ASSERT_EQ(few.requests.size(), 1000u);
  EXPECT_EQ(few.requests[0].prompt_tokens, 530u);
  EXPECT_EQ(CommonPages(few, 0, 999), 31u);

  const std::vector<TokenRequest> mt = GenerateMultiTurn(defaults.multi_turn, defaults.arrival);
  ASSERT_EQ(mt.size(), 500u);
  EXPECT_EQ(mt[0].tokens.size(), 140u);    // turn 1 of conversation 0
  EXPECT_EQ(mt[100].tokens.size(), 180u);  // turn 2 of conversation 0
  EXPECT_TRUE(std::equal(mt[0].tokens.begin(), mt[0].tokens.end(), mt[100].tokens.begin()));
  EXPECT_TRUE(std::equal(mt[0].tokens.begin(), mt[0].tokens.begin() + 100, mt[1].tokens.begin()));
  EXPECT_NE(mt[0].tokens[100], mt[1].tokens[100]);

  const std::vector<TokenRequest> random = GenerateRandom(defaults.random, defaults.arrival);
  ASSERT_EQ(random.size(), 1000u);
  for (const TokenRequest& r : random) {
    ASSERT_EQ(r.tokens.size(), 100u);
    for (int32_t t : r.tokens) ASSERT_TRUE(t >= 0 && t < 100000);
  }

  const Trace gsp = HashTokenTrace(
      "gsp", GenerateSharedPrefix(defaults.shared_prefix, defaults.arrival), kKey, 16);
  ASSERT_EQ(gsp.requests.size(), 1024u);
  EXPECT_EQ(gsp.requests[0].prompt_tokens, 2176u);
  EXPECT_EQ(gsp.requests[0].output_tokens, 256u);
  absl::flat_hash_set<PageHash> prefixes;
  for (const TraceRequest& r : gsp.requests) prefixes.insert(r.pages[127]);  // 2048 / 16 - 1
  EXPECT_EQ(prefixes.size(), 64u);
  // Shuffled: the first 16 requests are not all one group.
  absl::flat_hash_set<PageHash> first16;
  for (size_t i = 0; i < 16; ++i) first16.insert(gsp.requests[i].pages[0]);
  EXPECT_GT(first16.size(), 1u);
}

TEST(GeneratorsTest, PoissonArrivalsHaveTheRequestedRate) {
  const ArrivalOptions arrival{.request_rate_per_s = 10, .seed = 7};
  const std::vector<TokenRequest> r = GenerateRandom({.prompts = 20000}, arrival);
  for (size_t i = 1; i < r.size(); ++i) ASSERT_GE(r[i].arrival_ms, r[i - 1].arrival_ms);
  const double mean_gap_ms = r.back().arrival_ms / (r.size() - 1);
  EXPECT_NEAR(mean_gap_ms, 100, 3);  // 1 / rate, within ~4 standard errors
  EXPECT_FALSE(GenerateByName("nope", {}).ok());
}

// Tokens [from, from + n) of `r`, as a key.
std::vector<int32_t> Slice(const TokenRequest& r, size_t from, size_t n) {
  return std::vector<int32_t>(r.tokens.begin() + from, r.tokens.begin() + from + n);
}

bool StartsWith(const TokenRequest& r, const TokenRequest& prefix) {
  return r.tokens.size() >= prefix.tokens.size() &&
         std::equal(prefix.tokens.begin(), prefix.tokens.end(), r.tokens.begin());
}

TEST(GeneratorsTest, AgentStepsExtendTheirSessionsContext) {
  const AgentOptions o{.sessions = 20,
                       .concurrent = 5,
                       .steps = 6,
                       .system_tokens = 64,
                       .task_tokens = 16,
                       .call_tokens = 8,
                       .result_tokens = 32,
                       .system_prompts = 2,
                       .output_tokens = 7};
  const std::vector<TokenRequest> r = GenerateAgent(o, {.seed = 5});
  ASSERT_EQ(r.size(), 20u * 6);
  // A session is known by its task, which follows the system prompt.
  std::map<std::vector<int32_t>, std::vector<size_t>> by_task;
  for (size_t i = 0; i < r.size(); ++i) {
    ASSERT_GE(r[i].tokens.size(), 80u);
    EXPECT_EQ(r[i].output_tokens, 7u);
    by_task[Slice(r[i], 64, 16)].push_back(i);
  }
  ASSERT_EQ(by_task.size(), 20u);
  const Trace t = HashTokenTrace("agent", r, kKey, 16);
  std::map<std::vector<int32_t>, int> sessions_per_app;
  absl::flat_hash_set<size_t> increments;
  std::vector<std::pair<size_t, size_t>> spans;  // first and last request of each session
  for (const auto& [task, steps] : by_task) {
    ASSERT_EQ(steps.size(), 6u);
    EXPECT_EQ(r[steps[0]].tokens.size(), 80u);  // step 1: system prompt and task
    for (size_t k = 1; k < steps.size(); ++k) {
      const TokenRequest& prev = r[steps[k - 1]];
      const TokenRequest& cur = r[steps[k]];
      ASSERT_TRUE(StartsWith(cur, prev)) << "step " << k + 1;
      const size_t added = cur.tokens.size() - prev.tokens.size();
      EXPECT_GE(added, 8u + 16);  // a call and a result of 16..48 tokens
      EXPECT_LE(added, 8u + 48);
      increments.insert(added);
    }
    ++sessions_per_app[Slice(r[steps[0]], 0, 64)];
    spans.emplace_back(steps.front(), steps.back());
  }
  EXPECT_GT(increments.size(), 5u);  // result lengths vary
  // Two apps of 10 sessions; requests of different apps share no page.
  ASSERT_EQ(sessions_per_app.size(), 2u);
  for (const auto& [system, n] : sessions_per_app) EXPECT_EQ(n, 10);
  for (size_t i = 1; i < r.size(); ++i) {
    const bool same_app = Slice(r[0], 0, 64) == Slice(r[i], 0, 64);
    if (same_app) {
      EXPECT_GE(CommonPages(t, 0, i), 4u);  // the 64-token system prompt
    } else {
      EXPECT_EQ(CommonPages(t, 0, i), 0u);
    }
  }
  // Interleaved: never more than 5 sessions live, usually 5; some finish before others that
  // started earlier.
  std::sort(spans.begin(), spans.end());
  size_t max_live = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    size_t live = 0;
    for (const auto& [first, last] : spans) live += first <= i && i <= last;
    max_live = std::max(max_live, live);
  }
  EXPECT_EQ(max_live, 5u);
  bool overtaken = false;
  for (size_t a = 0; a + 1 < spans.size(); ++a) overtaken |= spans[a + 1].second < spans[a].second;
  EXPECT_TRUE(overtaken);
}

TEST(GeneratorsTest, RagRequestsShareTheInstructionAndPopularDocuments) {
  const RagOptions o{.requests = 600,
                     .documents = 50,
                     .document_tokens = 32,
                     .docs_per_request = 3,
                     .zipf_s = 1.0,
                     .system_tokens = 48,
                     .question_tokens = 16};
  const std::vector<TokenRequest> r = GenerateRag(o, {.seed = 5});
  ASSERT_EQ(r.size(), 600u);
  const Trace t = HashTokenTrace("rag", r, kKey, 16);
  std::map<std::vector<int32_t>, int> requests_per_doc;
  std::set<std::vector<int32_t>> questions;
  for (size_t i = 0; i < r.size(); ++i) {
    ASSERT_EQ(r[i].tokens.size(), 48u + 3 * 32 + 16);
    EXPECT_EQ(Slice(r[i], 0, 48), Slice(r[0], 0, 48));
    std::set<std::vector<int32_t>> docs;
    for (size_t d = 0; d < 3; ++d) docs.insert(Slice(r[i], 48 + 32 * d, 32));
    EXPECT_EQ(docs.size(), 3u) << "request " << i;
    for (const std::vector<int32_t>& doc : docs) ++requests_per_doc[doc];
    questions.insert(Slice(r[i], 48 + 96, 16));
    // The instruction's 3 pages are shared; with the same first document, its 2 too.
    if (i > 0 && Slice(r[i], 48, 32) == Slice(r[0], 48, 32)) {
      EXPECT_GE(CommonPages(t, 0, i), 5u) << "request " << i;
    } else if (i > 0) {
      EXPECT_EQ(CommonPages(t, 0, i), 3u) << "request " << i;
    }
  }
  EXPECT_EQ(questions.size(), 600u);
  EXPECT_LE(requests_per_doc.size(), 50u);
  std::vector<int> counts;
  for (const auto& [doc, n] : requests_per_doc) counts.push_back(n);
  std::sort(counts.rbegin(), counts.rend());
  // Zipf(1) over 50: the top document is in about half the requests, the median one in a
  // few percent.
  EXPECT_GT(counts.front(), 200);
  EXPECT_GT(counts.front(), 4 * counts[counts.size() / 2]);
}

TEST(GeneratorsTest, ScanPromptsAreNeverReusedAndHotPromptsRepeat) {
  const ScanOptions o{.requests = 400,
                      .hot_prompts = 30,
                      .hot_prefixes = 3,
                      .hot_prefix_tokens = 64,
                      .hot_body_tokens = 32,
                      .zipf_s = 0.9,
                      .scan_every = 50,
                      .scan_length = 10,
                      .scan_tokens = 80};
  const std::vector<TokenRequest> r = GenerateScan(o, {.seed = 5});
  ASSERT_EQ(r.size(), 400u + 7 * 10);  // a burst before hot requests 50, 100, ..., 350
  const Trace t = HashTokenTrace("scan", r, kKey, 16);
  absl::flat_hash_map<PageHash, int> uses;
  for (const TraceRequest& req : t.requests) {
    for (const PageHash& p : req.pages) ++uses[p];
  }
  std::map<std::vector<int32_t>, int> hot;
  std::set<std::vector<int32_t>> prefixes;
  for (size_t i = 0; i < r.size(); ++i) {
    // Position within a cycle of 50 hot requests and 10 scans (the first cycle has no scans).
    const bool scan = i >= 50 && (i - 50) % 60 < 10;
    ASSERT_EQ(r[i].tokens.size(), scan ? 80u : 96u) << "request " << i;
    if (scan) {
      for (const PageHash& p : t.requests[i].pages) EXPECT_EQ(uses[p], 1) << "request " << i;
    } else {
      ++hot[r[i].tokens];
      prefixes.insert(Slice(r[i], 0, 64));
    }
  }
  EXPECT_LE(hot.size(), 30u);
  EXPECT_EQ(prefixes.size(), 3u);
  int most = 0;
  for (const auto& [tokens, n] : hot) most = std::max(most, n);
  EXPECT_GT(most, 40);  // Zipf(0.9) over 30: about a fifth of the hot requests
}

// Every generator is a function of its seed: equal for one seed, different for another,
// with non-decreasing arrivals.
TEST(GeneratorsTest, DeterministicForASeedAndDifferentForAnother) {
  GeneratorOptions a;
  a.ShrinkForSmoke();
  GeneratorOptions b = a;
  b.arrival.seed = a.arrival.seed + 1;
  for (absl::string_view name : kGeneratorNames) {
    SCOPED_TRACE(name);
    absl::StatusOr<std::vector<TokenRequest>> first = GenerateByName(name, a);
    absl::StatusOr<std::vector<TokenRequest>> again = GenerateByName(name, a);
    absl::StatusOr<std::vector<TokenRequest>> other = GenerateByName(name, b);
    ASSERT_TRUE(first.ok() && again.ok() && other.ok());
    ASSERT_FALSE(first->empty());
    ASSERT_EQ(first->size(), again->size());
    bool tokens_differ = first->size() != other->size();
    for (size_t i = 0; i < first->size(); ++i) {
      EXPECT_EQ((*first)[i].tokens, (*again)[i].tokens);
      EXPECT_EQ((*first)[i].arrival_ms, (*again)[i].arrival_ms);
      EXPECT_EQ((*first)[i].output_tokens, (*again)[i].output_tokens);
      if (i > 0) {
        EXPECT_GE((*first)[i].arrival_ms, (*first)[i - 1].arrival_ms);
      }
      if (i < other->size()) tokens_differ |= (*first)[i].tokens != (*other)[i].tokens;
    }
    EXPECT_TRUE(tokens_differ);
  }
}

// Belady's order bounds lru on the three newer shapes too, where every prompt fits beside
// the pinned ones (no failed inserts; with them, neither bounds the other).
TEST(GeneratorsTest, OptHitsAtLeastAsMuchAsLruOnAgentRagAndScan) {
  const ArrivalOptions arrival{.seed = 3};
  const Trace traces[] = {
      HashTokenTrace("agent",
                     GenerateAgent({.sessions = 40,
                                    .concurrent = 8,
                                    .steps = 6,
                                    .system_tokens = 256,
                                    .task_tokens = 32,
                                    .call_tokens = 16,
                                    .result_tokens = 64},
                                   arrival),
                     kKey, 16),
      HashTokenTrace(
          "rag", GenerateRag({.requests = 300, .documents = 60, .document_tokens = 64}, arrival),
          kKey, 16),
      HashTokenTrace("scan",
                     GenerateScan({.requests = 400,
                                   .hot_prompts = 40,
                                   .hot_prefix_tokens = 128,
                                   .hot_body_tokens = 64,
                                   .scan_every = 50,
                                   .scan_length = 10,
                                   .scan_tokens = 256},
                                  arrival),
                     kKey, 16)};
  for (const Trace& trace : traces) {
    for (double capacity : {0.2, 0.5}) {
      SCOPED_TRACE(absl::StrCat(trace.name, " capacity ", capacity));
      ReplayOptions options;
      options.spec = Spec(16);
      options.capacity_fraction = capacity;
      options.policy = "opt";
      absl::StatusOr<ReplayResult> opt = Replay(trace, options);
      ASSERT_TRUE(opt.ok()) << opt.status();
      options.policy = "lru";
      absl::StatusOr<ReplayResult> lru = Replay(trace, options);
      ASSERT_TRUE(lru.ok()) << lru.status();
      EXPECT_EQ(opt->failed_inserts, 0u);
      EXPECT_EQ(lru->failed_inserts, 0u);
      EXPECT_GE(opt->hit_pages, lru->hit_pages);
    }
  }
}

// ---------------------------------------------------------------- oracle

TEST(TraceNextUseOracleTest, FirstRequestAfterTheCursor) {
  Trace t;
  t.page_size_tokens = 1;
  const PageHash a{1, 0}, b{2, 0}, c{3, 0};
  t.requests = {{.pages = {a, b}}, {.pages = {c}}, {.pages = {a}}, {.pages = {a, b, a}}};
  TraceNextUseOracle oracle(t);
  constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
  oracle.set_cursor(0);
  EXPECT_EQ(oracle.NextUse(a), 2u);
  EXPECT_EQ(oracle.NextUse(b), 3u);
  EXPECT_EQ(oracle.NextUse(c), 1u);
  EXPECT_EQ(oracle.NextUse(PageHash{9, 9}), kNever);
  oracle.set_cursor(2);
  EXPECT_EQ(oracle.NextUse(a), 3u);
  EXPECT_EQ(oracle.NextUse(c), kNever);
  oracle.set_cursor(3);
  EXPECT_EQ(oracle.NextUse(a), kNever);

  // Only the requests routed to GPU 1 (1 and 3), indices still the trace's.
  const std::vector<uint32_t> routes = {0, 1, 0, 1};
  TraceNextUseOracle gpu1(t, routes, 1);
  gpu1.set_cursor(0);
  EXPECT_EQ(gpu1.NextUse(a), 3u);
  EXPECT_EQ(gpu1.NextUse(c), 1u);
}

// ---------------------------------------------------------------- replay

// (a) The Mooncake conversation trace with unbounded capacity. traces/README.md: 288,500
// blocks, 182,790 distinct, 36.64 % hits, where the README counts EVERY hash id, the
// partial last block of a prompt included (len(hash_ids) = ceil(input_length / 512)), and a
// hit is an id seen before (every one lies on a repeated prefix). 105,710 = 288,500 -
// 182,790 hits. kvcm never caches a partial page, so the replay reproduces that figure
// exactly when it reads the trace with PartialBlock::kKeepAsBlock; with the default kDrop
// (whole blocks only) the same trace has 276,491 blocks, 170,899 distinct and 105,592 hits
// (38.19 %): 118 of the README's hits are partial last blocks.
struct MooncakeExpectation {
  PartialBlock partial;
  uint64_t pages;
  uint64_t distinct;
  uint64_t hits;
  double rate;  // hits / pages, to 4 digits
};

void PrintTo(const MooncakeExpectation& e, std::ostream* os) {
  *os << (e.partial == PartialBlock::kDrop ? "whole blocks" : "every block") << ": " << e.pages
      << " pages, " << e.distinct << " distinct, " << e.hits << " hits (" << e.rate * 100 << " %)";
}

class MooncakeUnboundedTest : public ::testing::TestWithParam<MooncakeExpectation> {};

TEST_P(MooncakeUnboundedTest, EveryPolicyHitsEveryRepeatedBlock) {
  const MooncakeExpectation& want = GetParam();
  absl::StatusOr<Trace> trace =
      ReadMooncakeTrace(KVCM_MOONCAKE_TRACE, {.partial_last_block = want.partial});
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->requests.size(), 12031u);
  ASSERT_EQ(trace->TotalPages(), want.pages);
  ASSERT_EQ(trace->DistinctPages(), want.distinct);
  for (const char* policy : kAllPolicies) {
    SCOPED_TRACE(policy);
    ReplayOptions options;
    options.policy = policy;
    options.spec = Spec(kMooncakeBlockTokens);
    // 100 % of the distinct pages in real bytes. "lru-mha" charges every page MHA-shaped
    // bytes (~71x more for DeepSeek-V3), so its unbounded pool is that much larger.
    options.capacity_fraction = ChargeRatio(policy, options.spec);
    absl::StatusOr<ReplayResult> r = Replay(*trace, options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->prompt_pages, want.pages);
    EXPECT_EQ(r->hit_pages, want.hits);
    EXPECT_NEAR(r->TokenHitRate(), want.rate, 5e-5);
    EXPECT_EQ(r->evicted_pages, 0u);
    EXPECT_EQ(r->failed_inserts, 0u);
    EXPECT_EQ(r->lease_expiries, 0u);
    EXPECT_EQ(r->inserted_page_locations, want.distinct);
  }
}

INSTANTIATE_TEST_SUITE_P(Mooncake, MooncakeUnboundedTest,
                         ::testing::Values(MooncakeExpectation{PartialBlock::kKeepAsBlock, 288'500,
                                                               182'790, 105'710, 0.3664},
                                           MooncakeExpectation{PartialBlock::kDrop, 276'491,
                                                               170'899, 105'592, 0.3819}),
                         [](const auto& info) {
                           return info.param.partial == PartialBlock::kDrop ? "WholeBlocks"
                                                                            : "EveryBlock";
                         });

// Small synthetic workloads, 16-token pages.
std::vector<Trace> SmallTraces() {
  const ArrivalOptions arrival{.request_rate_per_s = 4, .seed = 3};
  std::vector<Trace> traces;
  traces.push_back(HashTokenTrace("chat", GenerateChat({.requests = 300}, arrival), kKey, 16));
  traces.push_back(
      HashTokenTrace("few-shot", GenerateFewShot({.requests = 300}, arrival), kKey, 16));
  traces.push_back(HashTokenTrace(
      "multi-turn", GenerateMultiTurn({.conversations = 40, .system_prompts = 4}, arrival), kKey,
      16));
  traces.push_back(HashTokenTrace(
      "gsp",
      GenerateSharedPrefix({.groups = 12, .prompts_per_group = 8, .system_tokens = 512}, arrival),
      kKey, 16));
  return traces;
}

// (b) Belady's clairvoyant order is an upper bound of every other policy on one GPU.
TEST(ReplayTest, OptHitsAtLeastAsMuchAsEveryPolicy) {
  for (const Trace& trace : SmallTraces()) {
    for (double capacity : {0.02, 0.05, 0.1, 0.2, 0.5}) {
      SCOPED_TRACE(absl::StrCat(trace.name, " capacity ", capacity));
      ReplayOptions options;
      options.spec = Spec(16);
      options.capacity_fraction = capacity;
      options.policy = "opt";
      absl::StatusOr<ReplayResult> opt = Replay(trace, options);
      ASSERT_TRUE(opt.ok()) << opt.status();
      for (const char* policy : {"lru", "lru-mha", "cost", "adaptive", "density"}) {
        options.policy = policy;
        absl::StatusOr<ReplayResult> other = Replay(trace, options);
        ASSERT_TRUE(other.ok()) << other.status();
        EXPECT_GE(opt->hit_pages, other->hit_pages) << policy;
      }
    }
  }
}

// (c) No pool ever holds more than its capacity, nor pins more than it holds, checked after
// every request, in both cluster modes, with every policy, at capacities tight enough to
// evict and to refuse inserts.
TEST(ReplayTest, BudgetsNeverExceedCapacity) {
  for (const Trace& trace : SmallTraces()) {
    for (ClusterMode mode : {ClusterMode::kGlobal, ClusterMode::kLocal}) {
      for (const char* policy : kAllPolicies) {
        SCOPED_TRACE(absl::StrCat(trace.name, " ", ClusterModeName(mode), " ", policy));
        ReplayOptions options;
        options.spec = Spec(16);
        options.policy = policy;
        // 20 % of the distinct pages: every prompt fits one GPU's half, the working set
        // does not. "lru-mha" is given the same page count in its MHA-shaped bytes.
        options.capacity_fraction = 0.2 * ChargeRatio(policy, options.spec);
        options.gpus = 2;
        options.mode = mode;
        uint64_t checked = 0;
        uint64_t max_used = 0;
        options.after_request = [&](size_t, std::span<CacheIndex* const> indexes) {
          for (CacheIndex* index : indexes) {
            for (const PoolStats& p : index->Stats().pools) {
              ASSERT_LE(p.used_bytes, p.capacity_bytes) << p.pool.ToString();
              ASSERT_LE(p.pinned_bytes, p.used_bytes) << p.pool.ToString();
              max_used = std::max(max_used, p.used_bytes);
              ++checked;
            }
          }
        };
        absl::StatusOr<ReplayResult> r = Replay(trace, options);
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(checked, trace.requests.size() * 2);  // two pools after every request
        EXPECT_GT(r->evicted_pages, 0u);                // the bound was really exercised
        EXPECT_GT(max_used, 0u);
        EXPECT_EQ(r->lease_expiries, 0u);
      }
    }
  }
}

// On one GPU every hit is a local match, so the replay's hits are exactly the pages the
// core counted as matched, and its lookups the pages the core was asked for.
TEST(ReplayTest, OneGpuHitsAreTheCoresMatchedPages) {
  for (const Trace& trace : SmallTraces()) {
    for (const char* policy : kAllPolicies) {
      SCOPED_TRACE(absl::StrCat(trace.name, " ", policy));
      ReplayOptions options;
      options.spec = Spec(16);
      options.policy = policy;
      options.capacity_fraction = 0.2 * ChargeRatio(policy, options.spec);
      IndexCounters counters;
      options.after_request = [&](size_t, std::span<CacheIndex* const> indexes) {
        counters = indexes[0]->Stats().counters;
      };
      absl::StatusOr<ReplayResult> r = Replay(trace, options);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->hit_pages, counters.matched_pages);
      EXPECT_EQ(r->prompt_pages, counters.requested_pages);
      EXPECT_EQ(r->hit_tokens(), counters.matched_tokens);
      EXPECT_EQ(r->transferred_pages + r->recomputed_remote_pages, 0u);
      EXPECT_GT(r->hit_pages, 0u);
    }
  }
}

TEST(ReplayTest, PromptsLargerThanAPoolAreFailedInserts) {
  const Trace trace = SmallTraces()[3];  // gsp: 40-page prompts
  ReplayOptions options;
  options.spec = Spec(16);
  options.gpus = 2;
  // 5 % of 1,152 distinct pages is 57 pages, 28 per GPU: no prompt fits.
  options.capacity_fraction = 0.05;
  absl::StatusOr<ReplayResult> r = Replay(trace, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(trace.DistinctPages(), 1152u);
  EXPECT_EQ(r->failed_inserts, trace.requests.size());
  EXPECT_EQ(r->hit_pages, 0u);
  EXPECT_EQ(r->inserted_page_locations, 0u);
}

TEST(ReplayTest, GlobalModeTransfersLocalModeDoesNot) {
  const Trace trace = SmallTraces()[1];  // few-shot: one prefix every GPU wants
  ReplayOptions options;
  options.spec = Spec(16);
  options.gpus = 4;
  options.mode = ClusterMode::kGlobal;
  absl::StatusOr<ReplayResult> global = Replay(trace, options);
  ASSERT_TRUE(global.ok()) << global.status();
  // The prefix is computed once, then fetched by the three other GPUs once each.
  EXPECT_EQ(global->transferred_pages, 3 * 31u);
  EXPECT_EQ(global->hit_pages, (trace.requests.size() - 1) * 31);

  options.mode = ClusterMode::kLocal;
  absl::StatusOr<ReplayResult> local = Replay(trace, options);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->transferred_pages, 0u);
  EXPECT_EQ(local->hit_pages, (trace.requests.size() - 4) * 31);  // each GPU computes it once

  // A link too slow to beat prefill: remote prefixes are recomputed, not transferred.
  options.mode = ClusterMode::kGlobal;
  options.link_gbps = 0.001;
  absl::StatusOr<ReplayResult> slow = Replay(trace, options);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_EQ(slow->transferred_pages, 0u);
  EXPECT_EQ(slow->recomputed_remote_pages, 3 * 31u);
  EXPECT_EQ(slow->hit_pages, local->hit_pages);
}

TEST(ReplayTest, RoutesSpreadOrConcentrateRequests) {
  const Trace trace = SmallTraces()[0];  // chat: 3 system prompts
  ReplayOptions options;
  options.spec = Spec(16);
  options.gpus = 3;
  options.mode = ClusterMode::kLocal;
  options.route = RoutePolicy::kFirstPageHash;
  absl::StatusOr<ReplayResult> by_hash = Replay(trace, options);
  ASSERT_TRUE(by_hash.ok()) << by_hash.status();
  options.route = RoutePolicy::kLeastLoaded;
  absl::StatusOr<ReplayResult> least = Replay(trace, options);
  ASSERT_TRUE(least.ok()) << least.status();
  // Routing by the first page sends each system prompt to one GPU: it is computed once.
  EXPECT_EQ(by_hash->hit_pages, (trace.requests.size() - 3) * 12);
  EXPECT_LT(least->hit_pages, by_hash->hit_pages);
}

TEST(ReplayTest, PrefillSavedRoutingMovesLessThanRoundRobin) {
  const Trace trace = SmallTraces()[0];  // chat: 3 system prompts
  ReplayOptions options;
  options.spec = Spec(16);
  options.gpus = 2;  // three system prompts do not follow a 2-way round-robin
  options.route = RoutePolicy::kRoundRobin;
  absl::StatusOr<ReplayResult> rr = Replay(trace, options);
  ASSERT_TRUE(rr.ok()) << rr.status();
  options.route = RoutePolicy::kPrefillSaved;
  absl::StatusOr<ReplayResult> saved = Replay(trace, options);
  ASSERT_TRUE(saved.ok()) << saved.status();
  // Round-robin hits the system prompts through transfers; routing by prefill saved sends
  // each request where its prompt already is, so the same hits need fewer transfers.
  EXPECT_GT(rr->transferred_pages, 0u);
  EXPECT_LT(saved->transferred_pages, rr->transferred_pages);
  EXPECT_GE(saved->hit_pages, rr->hit_pages);
}

// (d) Two tenants of two models in one pool: each request goes to its own namespace, an
// unbounded pool hits every repeated page of both, and capacity fractions count each page at
// its own model's bytes.
TEST(ReplayTest, TwoTenantsOfTwoModelsShareThePool) {
  const ArrivalOptions arrival{.request_rate_per_s = 4, .seed = 5};
  Trace mix = HashTokenTrace("mix", GenerateChat({.requests = 200}, arrival), kKey, 16);
  const Trace other =
      HashTokenTrace("other", GenerateMultiTurn({.conversations = 20}, arrival), HashKey{3, 4}, 16);
  for (TraceRequest r : other.requests) {
    r.tenant = 1;
    mix.requests.push_back(std::move(r));
  }
  std::stable_sort(
      mix.requests.begin(), mix.requests.end(),
      [](const TraceRequest& a, const TraceRequest& b) { return a.arrival_ms < b.arrival_ms; });
  absl::StatusOr<ModelSpec> llama = FindModel("llama-3-8b");
  ASSERT_TRUE(llama.ok()) << llama.status();
  llama->page_size_tokens = 16;
  ReplayOptions options;
  options.spec = Spec(16);
  options.extra_specs = {*llama};
  for (const char* policy : {"lru", "cost", "adaptive", "density", "opt"}) {
    SCOPED_TRACE(policy);
    options.policy = policy;
    options.capacity_fraction = 1.0;
    absl::StatusOr<ReplayResult> r = Replay(mix, options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->hit_pages, mix.TotalPages() - mix.DistinctPages());
    EXPECT_EQ(r->evicted_pages, 0u);
    // Each distinct page at its own model's bytes.
    uint64_t want = 0;
    absl::flat_hash_set<PageHash> seen;
    for (const TraceRequest& q : mix.requests) {
      for (const PageHash& p : q.pages) {
        if (seen.insert(p).second) {
          want += q.tenant == 0 ? options.spec.BytesPerPage() : llama->BytesPerPage();
        }
      }
    }
    EXPECT_NEAR(static_cast<double>(r->capacity_bytes_per_gpu), static_cast<double>(want), 1.0);
    options.capacity_fraction = 0.1;
    ASSERT_TRUE(Replay(mix, options).ok());
  }
  options.extra_specs.clear();
  EXPECT_EQ(Replay(mix, options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReplayTest, RejectsBadOptions) {
  const Trace trace = SmallTraces()[0];
  ReplayOptions options;
  options.spec = Spec(64);
  EXPECT_THAT(Replay(trace, options).status().message(), HasSubstr("16-token pages"));
  options.spec = Spec(16);
  options.policy = "fifo";
  EXPECT_TRUE(absl::IsInvalidArgument(Replay(trace, options).status()));
  options.policy = "lru";
  options.capacity_fraction = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(Replay(trace, options).status()));
  options.capacity_fraction = 1;
  options.gpus = 2;
  options.mode = ClusterMode::kLocal;
  options.route = RoutePolicy::kPrefillSaved;
  EXPECT_THAT(Replay(trace, options).status().message(), HasSubstr("global index"));
  EXPECT_FALSE(ParseClusterMode("mesh").ok());
  options.route = RoutePolicy::kRoundRobin;
  options.backing = PoolBacking::kAgent;
  absl::StatusOr<ModelSpec> llama = FindModel("llama-3-8b");
  ASSERT_TRUE(llama.ok()) << llama.status();
  llama->page_size_tokens = 16;
  options.extra_specs = {*llama};  // another block size than the pool's
  EXPECT_THAT(Replay(trace, options).status().message(), HasSubstr("one size"));
  EXPECT_FALSE(ParsePoolBacking("disk").ok());
}

// ---------------------------------------------------------------- agent-backed pools

// Both ways, the same options but the backing; the agent's replay checks its ledgers
// against the index in full after every request.
struct BothWays {
  ReplayResult index;
  ReplayResult agent;
};

BothWays ReplayBothWays(const Trace& trace, ReplayOptions options) {
  BothWays out;
  options.backing = PoolBacking::kIndexOnly;
  absl::StatusOr<ReplayResult> index = Replay(trace, options);
  EXPECT_TRUE(index.ok()) << index.status();
  options.backing = PoolBacking::kAgent;
  options.agent_full_check_every = 1;
  absl::StatusOr<ReplayResult> agent = Replay(trace, options);
  EXPECT_TRUE(agent.ok()) << agent.status();
  if (index.ok()) out.index = *index;
  if (agent.ok()) out.agent = *agent;
  return out;
}

// Issue 33: a worker's store (Allocate on its agent, EvictForAllocation when the agent is
// short, Commit, Insert) keeps the hit rate of the index-only replay, whose Insert evicts, to
// 0.1 point: on a generated multi-turn workload and the first 2,000 requests of the bundled
// trace, for lru and the manager's default policy, at two capacities where pools fill up.
TEST(AgentBackedReplayTest, HitRatesEqualTheIndexOnlyReplay) {
  absl::StatusOr<Trace> mooncake = ReadMooncakeTrace(KVCM_MOONCAKE_TRACE, {.max_requests = 2000});
  ASSERT_TRUE(mooncake.ok()) << mooncake.status();
  const struct {
    Trace trace;
    std::vector<double> capacities;
  } cases[] = {{SmallTraces()[2], {0.15, 0.3}}, {*mooncake, {0.02, 0.1}}};
  for (const auto& c : cases) {
    for (const std::string& policy : {std::string("lru"), ServerOptions{}.policy}) {
      for (double capacity : c.capacities) {
        SCOPED_TRACE(absl::StrCat(c.trace.name, " ", policy, " ", capacity));
        ReplayOptions options;
        options.spec = Spec(c.trace.page_size_tokens);
        options.policy = policy;
        options.capacity_fraction = capacity;
        const BothWays r = ReplayBothWays(c.trace, options);
        EXPECT_NEAR(r.agent.TokenHitRate(), r.index.TokenHitRate(), 0.001);
        EXPECT_GT(r.agent.evicted_pages, 0u);
        EXPECT_EQ(r.agent.failed_inserts, 0u);
        EXPECT_EQ(r.index.failed_inserts, 0u);
        // The pools really filled: agents were short, and the index made room for them.
        EXPECT_GT(r.agent.short_allocations, 0u);
        EXPECT_GT(r.agent.allocation_evicted_pages, 0u);
        EXPECT_EQ(r.agent.allocation_room_refusals, 0u);
        EXPECT_EQ(r.agent.agent_full_checks, c.trace.requests.size() + 1);
        EXPECT_EQ(r.agent.lease_expiries, 0u);
      }
    }
  }
}

// Two GPUs in both cluster modes (transfers in global mode), and a HOST tier the "cost"
// policy demotes into: the ledgers stay in step with the index (the HOST ledger takes the
// demoted copies, AssignBlocks records them), and the hit rate is the index-only replay's.
// Every demotion here succeeds; one the agent cannot carry out (its HOST pool short) is
// abandoned, which the index-only replay never does, and then the two may differ.
TEST(AgentBackedReplayTest, GpusAndAHostTierKeepLedgersAndIndexInStep) {
  const Trace trace = SmallTraces()[0];  // chat
  for (ClusterMode mode : {ClusterMode::kGlobal, ClusterMode::kLocal}) {
    for (const char* policy : {"lru", "cost"}) {
      SCOPED_TRACE(absl::StrCat(ClusterModeName(mode), " ", policy));
      ReplayOptions options;
      options.spec = Spec(16);
      options.policy = policy;
      options.capacity_fraction = 0.2;
      options.host_capacity_fraction = 0.3;
      options.gpus = 2;
      options.mode = mode;
      const BothWays r = ReplayBothWays(trace, options);
      EXPECT_NEAR(r.agent.TokenHitRate(), r.index.TokenHitRate(), 0.001);
      EXPECT_GT(r.agent.short_allocations, 0u);
      EXPECT_EQ(r.agent.failed_inserts, r.index.failed_inserts);
      EXPECT_EQ(r.agent.agent_failed_demotions, 0u);
      if (std::string(policy) == "cost") {
        EXPECT_GT(r.agent.agent_demotions, 0u);
      } else {
        EXPECT_EQ(r.agent.agent_demotions, 0u);
      }
      if (mode == ClusterMode::kGlobal) {
        EXPECT_GT(r.agent.transferred_pages, 0u);
      }
    }
  }
}

}  // namespace
}  // namespace kvcm::bench
