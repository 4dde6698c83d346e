// Synthetic token-level workloads for kvcm-bench (ARCHITECTURE.md section 11), with the
// section's figures as defaults.
//
// The four of the MLA-aware RadixAttention proposal (chat, few-shot, multi-turn, random) and
// SGLang's generated-shared-prefix benchmark. Token ids are drawn uniformly from DeepSeek-V3's
// vocabulary from per-purpose seeded streams, so two independently generated segments
// never share a page by accident, while a segment meant to be shared (a system prompt, the
// few-shot examples, an earlier turn) is repeated token for token.
//
// Arrivals: a Poisson process of `request_rate_per_s`, in the order each generator lists
// its requests. Every request also decodes `output_tokens` tokens.
//
// Pure functions of their options; thread-safe.
#ifndef KVCM_BENCH_REPLAY_GENERATORS_H_
#define KVCM_BENCH_REPLAY_GENERATORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/replay/trace.h"

namespace kvcm::bench {

struct ArrivalOptions {
  double request_rate_per_s = 4.0;  // mean of the Poisson arrivals
  uint64_t seed = 1;                // token ids, arrival gaps and shuffles
};

// 1,000 requests; 3 system prompts of 200 tokens used round-robin, each followed by a
// unique 50-token user message.
struct ChatOptions {
  uint32_t requests = 1000;
  uint32_t system_prompts = 3;
  uint32_t system_tokens = 200;
  uint32_t message_tokens = 50;
  uint32_t output_tokens = 128;
};

// 1,000 requests sharing one 500-token prefix (5 examples of 100 tokens) plus a unique
// 30-token query.
struct FewShotOptions {
  uint32_t requests = 1000;
  uint32_t prefix_tokens = 500;
  uint32_t query_tokens = 30;
  uint32_t output_tokens = 128;
};

// 100 conversations of 5 turns. Turn t (1-based) resends the whole context: the 100-token
// system part, then 40 tokens for each of turns 1..t (the user message and the model's
// answer to it). Conversations are interleaved turn by turn (turn 1 of every conversation,
// then turn 2, ...), as concurrent users think between turns. `system_prompts` distinct
// system parts are used round-robin over conversations (1: one application prompt shared
// by every conversation).
struct MultiTurnOptions {
  uint32_t conversations = 100;
  uint32_t turns = 5;
  uint32_t system_tokens = 100;
  uint32_t turn_tokens = 40;
  uint32_t system_prompts = 1;
  uint32_t output_tokens = 128;
};

// 1,000 prompts of 100 token ids drawn uniformly from [0, id_range).
struct RandomOptions {
  uint32_t prompts = 1000;
  uint32_t prompt_tokens = 100;
  uint32_t id_range = 100000;
  uint32_t output_tokens = 128;
};

// SGLang bench_serving's "generated-shared-prefix": groups x prompts_per_group prompts, each
// its group's system prompt followed by a unique question, shuffled (as SGLang does).
struct SharedPrefixOptions {
  uint32_t groups = 64;
  uint32_t prompts_per_group = 16;
  uint32_t system_tokens = 2048;
  uint32_t question_tokens = 128;
  uint32_t output_tokens = 256;
};

std::vector<TokenRequest> GenerateChat(const ChatOptions& options, const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateFewShot(const FewShotOptions& options,
                                          const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateMultiTurn(const MultiTurnOptions& options,
                                            const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateRandom(const RandomOptions& options,
                                         const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateSharedPrefix(const SharedPrefixOptions& options,
                                               const ArrivalOptions& arrival);

// Every generator's options, for choosing one by name.
struct GeneratorOptions {
  ChatOptions chat;
  FewShotOptions few_shot;
  MultiTurnOptions multi_turn;
  RandomOptions random;
  SharedPrefixOptions shared_prefix;
  ArrivalOptions arrival;

  // Few enough requests of every generator for a smoke run (CI) to take moments.
  void ShrinkForSmoke() {
    chat.requests = 60;
    few_shot.requests = 60;
    multi_turn.conversations = 12;
    random.prompts = 60;
    shared_prefix.groups = 4;
    shared_prefix.prompts_per_group = 8;
  }
};

// Names GenerateByName accepts, in their canonical order.
inline constexpr absl::string_view kGeneratorNames[] = {"chat", "few-shot", "multi-turn", "random",
                                                        "gsp"};

// The workload called `name` (one of kGeneratorNames); INVALID_ARGUMENT otherwise.
absl::StatusOr<std::vector<TokenRequest>> GenerateByName(absl::string_view name,
                                                         const GeneratorOptions& options);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_GENERATORS_H_
