#include "bench/replay/generators.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/workload.h"

namespace kvcm::bench {
namespace {

// DeepSeek-V3's vocabulary size: token ids are drawn from [0, kVocab).
constexpr uint32_t kVocab = 129'280;

// Stream tags, so that two kinds of segment never draw the same token ids by design.
enum class Stream : uint64_t {
  kSystem = 1,
  kMessage = 2,
  kTurn = 3,
  kRandom = 4,
  kArrival = 5,
  kShuffle = 6,
  kTask = 7,
  kToolCall = 8,
  kToolResult = 9,
  kResultLength = 10,
  kSchedule = 11,
  kDocument = 12,
  kPopularity = 13,
  kScan = 14,
};

// Seed of segment `index` of `stream`: well mixed, so nearby indices are unrelated.
uint64_t SegmentSeed(uint64_t seed, Stream stream, uint64_t index) {
  uint64_t state = seed ^ (static_cast<uint64_t>(stream) << 56);
  SplitMix64(state);
  state ^= index * 0x9e3779b97f4a7c15ULL;
  return SplitMix64(state);
}

// Appends `n` token ids in [0, range) from segment `index` of `stream`.
void AppendTokens(uint64_t seed, Stream stream, uint64_t index, uint32_t n, uint32_t range,
                  std::vector<int32_t>& out) {
  uint64_t state = SegmentSeed(seed, stream, index);
  for (uint32_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(SplitMix64(state) % range));
}

// Poisson arrivals: exponential gaps of mean 1 / rate seconds, first request at 0 ms.
void SetArrivals(const ArrivalOptions& arrival, std::vector<TokenRequest>& requests) {
  uint64_t state = SegmentSeed(arrival.seed, Stream::kArrival, 0);
  double t_ms = 0;
  for (TokenRequest& r : requests) {
    r.arrival_ms = t_ms;
    // Uniform in (0, 1]: 53 random bits, shifted off zero so the log is finite.
    const double u = (static_cast<double>(SplitMix64(state) >> 11) + 1.0) * 0x1.0p-53;
    t_ms += -std::log(u) / arrival.request_rate_per_s * 1000.0;
  }
}

TokenRequest Request(std::vector<int32_t> tokens, uint32_t output_tokens) {
  return TokenRequest{.arrival_ms = 0, .tokens = std::move(tokens), .output_tokens = output_tokens};
}

// Uniform in [0, 1): 53 random bits.
double Uniform(uint64_t& state) { return static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53; }

// Zipf(s) over ranks 0..n-1 (n 0 is taken as 1): rank r with probability ~ (r + 1)^-s.
class ZipfSampler {
 public:
  ZipfSampler(uint32_t n, double s) {
    cdf_.reserve(std::max(n, 1u));
    double total = 0;
    for (uint32_t r = 0; r < std::max(n, 1u); ++r) {
      total += std::pow(r + 1.0, -s);
      cdf_.push_back(total);
    }
  }

  uint32_t Draw(uint64_t& state) const {
    const double u = Uniform(state) * cdf_.back();
    const size_t r = std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
    return static_cast<uint32_t>(std::min(r, cdf_.size() - 1));
  }

 private:
  std::vector<double> cdf_;  // cumulative weights of ranks 0..r
};

}  // namespace

std::vector<TokenRequest> GenerateChat(const ChatOptions& o, const ArrivalOptions& arrival) {
  std::vector<TokenRequest> requests;
  requests.reserve(o.requests);
  for (uint32_t i = 0; i < o.requests; ++i) {
    std::vector<int32_t> tokens;
    tokens.reserve(o.system_tokens + o.message_tokens);
    AppendTokens(arrival.seed, Stream::kSystem, i % std::max(o.system_prompts, 1u), o.system_tokens,
                 kVocab, tokens);
    AppendTokens(arrival.seed, Stream::kMessage, i, o.message_tokens, kVocab, tokens);
    requests.push_back(Request(std::move(tokens), o.output_tokens));
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateFewShot(const FewShotOptions& o, const ArrivalOptions& arrival) {
  std::vector<TokenRequest> requests;
  requests.reserve(o.requests);
  std::vector<int32_t> prefix;
  AppendTokens(arrival.seed, Stream::kSystem, 0, o.prefix_tokens, kVocab, prefix);
  for (uint32_t i = 0; i < o.requests; ++i) {
    std::vector<int32_t> tokens = prefix;
    AppendTokens(arrival.seed, Stream::kMessage, i, o.query_tokens, kVocab, tokens);
    requests.push_back(Request(std::move(tokens), o.output_tokens));
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateMultiTurn(const MultiTurnOptions& o,
                                            const ArrivalOptions& arrival) {
  // Each conversation's full context after its last turn; turn t sends a prefix of it.
  std::vector<std::vector<int32_t>> contexts(o.conversations);
  for (uint32_t c = 0; c < o.conversations; ++c) {
    contexts[c].reserve(o.system_tokens + size_t{o.turns} * o.turn_tokens);
    AppendTokens(arrival.seed, Stream::kSystem, c % std::max(o.system_prompts, 1u), o.system_tokens,
                 kVocab, contexts[c]);
    for (uint32_t t = 0; t < o.turns; ++t) {
      AppendTokens(arrival.seed, Stream::kTurn, uint64_t{c} * o.turns + t, o.turn_tokens, kVocab,
                   contexts[c]);
    }
  }
  std::vector<TokenRequest> requests;
  requests.reserve(size_t{o.conversations} * o.turns);
  for (uint32_t t = 1; t <= o.turns; ++t) {
    for (uint32_t c = 0; c < o.conversations; ++c) {
      const size_t n = o.system_tokens + size_t{t} * o.turn_tokens;
      requests.push_back(Request(std::vector<int32_t>(contexts[c].begin(), contexts[c].begin() + n),
                                 o.output_tokens));
    }
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateRandom(const RandomOptions& o, const ArrivalOptions& arrival) {
  std::vector<TokenRequest> requests;
  requests.reserve(o.prompts);
  for (uint32_t i = 0; i < o.prompts; ++i) {
    std::vector<int32_t> tokens;
    tokens.reserve(o.prompt_tokens);
    AppendTokens(arrival.seed, Stream::kRandom, i, o.prompt_tokens, std::max(o.id_range, 1u),
                 tokens);
    requests.push_back(Request(std::move(tokens), o.output_tokens));
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateSharedPrefix(const SharedPrefixOptions& o,
                                               const ArrivalOptions& arrival) {
  std::vector<TokenRequest> requests;
  requests.reserve(size_t{o.groups} * o.prompts_per_group);
  for (uint32_t g = 0; g < o.groups; ++g) {
    std::vector<int32_t> system;
    AppendTokens(arrival.seed, Stream::kSystem, g, o.system_tokens, kVocab, system);
    for (uint32_t p = 0; p < o.prompts_per_group; ++p) {
      std::vector<int32_t> tokens = system;
      AppendTokens(arrival.seed, Stream::kMessage, uint64_t{g} * o.prompts_per_group + p,
                   o.question_tokens, kVocab, tokens);
      requests.push_back(Request(std::move(tokens), o.output_tokens));
    }
  }
  // Fisher-Yates, as SGLang shuffles its generated requests before sending them.
  uint64_t state = SegmentSeed(arrival.seed, Stream::kShuffle, 0);
  for (size_t i = requests.size(); i > 1; --i) {
    std::swap(requests[i - 1], requests[SplitMix64(state) % i]);
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateAgent(const AgentOptions& o, const ArrivalOptions& arrival) {
  if (o.sessions == 0 || o.steps == 0) return {};
  // Each session's full context after its last step, and ends[s][k]: the length of step k + 1's
  // prompt, a prefix of it.
  const uint32_t min_result = o.result_tokens / 2;
  const uint32_t max_result = o.result_tokens + o.result_tokens / 2;
  std::vector<std::vector<int32_t>> contexts(o.sessions);
  std::vector<std::vector<size_t>> ends(o.sessions);
  for (uint32_t s = 0; s < o.sessions; ++s) {
    std::vector<int32_t>& context = contexts[s];
    AppendTokens(arrival.seed, Stream::kSystem, s % std::max(o.system_prompts, 1u), o.system_tokens,
                 kVocab, context);
    AppendTokens(arrival.seed, Stream::kTask, s, o.task_tokens, kVocab, context);
    ends[s].push_back(context.size());
    for (uint32_t k = 0; k + 1 < o.steps; ++k) {
      const uint64_t step = uint64_t{s} * o.steps + k;
      AppendTokens(arrival.seed, Stream::kToolCall, step, o.call_tokens, kVocab, context);
      uint64_t length = SegmentSeed(arrival.seed, Stream::kResultLength, step);
      const uint32_t result_tokens =
          min_result + static_cast<uint32_t>(SplitMix64(length) % (max_result - min_result + 1));
      AppendTokens(arrival.seed, Stream::kToolResult, step, result_tokens, kVocab, context);
      ends[s].push_back(context.size());
    }
  }
  // Live sessions; each request advances one of them, chosen uniformly.
  std::vector<uint32_t> live;
  uint32_t next_session = std::min(std::max(o.concurrent, 1u), o.sessions);
  for (uint32_t s = 0; s < next_session; ++s) live.push_back(s);
  std::vector<uint32_t> next_step(o.sessions, 0);
  std::vector<TokenRequest> requests;
  requests.reserve(size_t{o.sessions} * o.steps);
  uint64_t state = SegmentSeed(arrival.seed, Stream::kSchedule, 0);
  while (!live.empty()) {
    const size_t i = SplitMix64(state) % live.size();
    const uint32_t s = live[i];
    const size_t n = ends[s][next_step[s]++];
    requests.push_back(Request(std::vector<int32_t>(contexts[s].begin(), contexts[s].begin() + n),
                               o.output_tokens));
    if (next_step[s] < o.steps) continue;
    if (next_session < o.sessions) {
      live[i] = next_session++;
    } else {
      live[i] = live.back();
      live.pop_back();
    }
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateRag(const RagOptions& o, const ArrivalOptions& arrival) {
  const ZipfSampler popularity(o.documents, o.zipf_s);
  const uint32_t docs_per_request = std::min(o.docs_per_request, std::max(o.documents, 1u));
  std::vector<TokenRequest> requests;
  requests.reserve(o.requests);
  std::vector<uint32_t> docs;
  for (uint32_t i = 0; i < o.requests; ++i) {
    // Distinct documents in the order drawn: a repeat is drawn again.
    uint64_t state = SegmentSeed(arrival.seed, Stream::kPopularity, i);
    docs.clear();
    while (docs.size() < docs_per_request) {
      const uint32_t d = popularity.Draw(state);
      if (std::find(docs.begin(), docs.end(), d) == docs.end()) docs.push_back(d);
    }
    std::vector<int32_t> tokens;
    tokens.reserve(o.system_tokens + size_t{docs_per_request} * o.document_tokens +
                   o.question_tokens);
    AppendTokens(arrival.seed, Stream::kSystem, 0, o.system_tokens, kVocab, tokens);
    for (uint32_t d : docs) {
      AppendTokens(arrival.seed, Stream::kDocument, d, o.document_tokens, kVocab, tokens);
    }
    AppendTokens(arrival.seed, Stream::kMessage, i, o.question_tokens, kVocab, tokens);
    requests.push_back(Request(std::move(tokens), o.output_tokens));
  }
  SetArrivals(arrival, requests);
  return requests;
}

std::vector<TokenRequest> GenerateScan(const ScanOptions& o, const ArrivalOptions& arrival) {
  const uint32_t hot_prompts = std::max(o.hot_prompts, 1u);
  std::vector<std::vector<int32_t>> hot(hot_prompts);
  for (uint32_t p = 0; p < hot_prompts; ++p) {
    hot[p].reserve(o.hot_prefix_tokens + o.hot_body_tokens);
    AppendTokens(arrival.seed, Stream::kSystem, p % std::max(o.hot_prefixes, 1u),
                 o.hot_prefix_tokens, kVocab, hot[p]);
    AppendTokens(arrival.seed, Stream::kMessage, p, o.hot_body_tokens, kVocab, hot[p]);
  }
  const ZipfSampler popularity(hot_prompts, o.zipf_s);
  uint64_t state = SegmentSeed(arrival.seed, Stream::kPopularity, 0);
  uint64_t scans = 0;
  std::vector<TokenRequest> requests;
  for (uint32_t i = 0; i < o.requests; ++i) {
    if (o.scan_every > 0 && i > 0 && i % o.scan_every == 0) {
      for (uint32_t b = 0; b < o.scan_length; ++b) {
        std::vector<int32_t> tokens;
        tokens.reserve(o.scan_tokens);
        AppendTokens(arrival.seed, Stream::kScan, scans++, o.scan_tokens, kVocab, tokens);
        requests.push_back(Request(std::move(tokens), o.output_tokens));
      }
    }
    requests.push_back(Request(hot[popularity.Draw(state)], o.output_tokens));
  }
  SetArrivals(arrival, requests);
  return requests;
}

absl::StatusOr<std::vector<TokenRequest>> GenerateByName(absl::string_view name,
                                                         const GeneratorOptions& options) {
  if (name == "chat") return GenerateChat(options.chat, options.arrival);
  if (name == "few-shot") return GenerateFewShot(options.few_shot, options.arrival);
  if (name == "multi-turn") return GenerateMultiTurn(options.multi_turn, options.arrival);
  if (name == "random") return GenerateRandom(options.random, options.arrival);
  if (name == "gsp") return GenerateSharedPrefix(options.shared_prefix, options.arrival);
  if (name == "agent") return GenerateAgent(options.agent, options.arrival);
  if (name == "rag") return GenerateRag(options.rag, options.arrival);
  if (name == "scan") return GenerateScan(options.scan, options.arrival);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown workload \"", name, "\"; known: ", absl::StrJoin(kGeneratorNames, ", ")));
}

}  // namespace kvcm::bench
