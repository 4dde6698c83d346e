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

absl::StatusOr<std::vector<TokenRequest>> GenerateByName(absl::string_view name,
                                                         const GeneratorOptions& options) {
  if (name == "chat") return GenerateChat(options.chat, options.arrival);
  if (name == "few-shot") return GenerateFewShot(options.few_shot, options.arrival);
  if (name == "multi-turn") return GenerateMultiTurn(options.multi_turn, options.arrival);
  if (name == "random") return GenerateRandom(options.random, options.arrival);
  if (name == "gsp") return GenerateSharedPrefix(options.shared_prefix, options.arrival);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown workload \"", name, "\"; known: ", absl::StrJoin(kGeneratorNames, ", ")));
}

}  // namespace kvcm::bench
