// Synthetic token-level workloads for kvcm-bench (ARCHITECTURE.md section 11), with the
// section's figures as defaults.
//
// The four of the MLA-aware RadixAttention proposal (chat, few-shot, multi-turn, random),
// SGLang's generated-shared-prefix benchmark, and three shapes those lack: agent loops whose
// contexts grow by tool results, retrieval with Zipf-popular documents, and a hot working set
// disturbed by scans of one-time prompts. Token ids are drawn uniformly from DeepSeek-V3's
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

// Tool/agent loops: `sessions` sessions of `steps` steps. Step k (1-based) resends the whole
// context: the system/tool-schema prompt of the session's app (`system_prompts` apps,
// round-robin over sessions), the session's unique task, then for each of steps 1..k-1 its
// tool call and tool result. Result lengths are uniform in [result_tokens / 2,
// 3 * result_tokens / 2], drawn per step. `concurrent` sessions are live at a time; each
// request is the next step of a live session chosen uniformly at random, so sessions
// progress at different paces; when one finishes, the next session starts.
struct AgentOptions {
  uint32_t sessions = 120;
  uint32_t concurrent = 16;
  uint32_t steps = 10;
  uint32_t system_tokens = 1500;
  uint32_t task_tokens = 100;
  uint32_t call_tokens = 40;
  uint32_t result_tokens = 300;  // mean of a step's tool result
  uint32_t system_prompts = 2;
  uint32_t output_tokens = 128;
};

// Retrieval-augmented generation: each of `requests` requests is the shared instruction
// prompt, `docs_per_request` distinct documents of a corpus of `documents`, drawn by
// Zipf(`zipf_s`) popularity and kept in the order drawn (the retriever's ranking), then a
// unique question. Only the first document always follows a shared prefix; a later one can
// hit only behind the same documents as before.
struct RagOptions {
  uint32_t requests = 1500;
  uint32_t documents = 400;
  uint32_t document_tokens = 256;
  uint32_t docs_per_request = 3;  // at most `documents`
  double zipf_s = 1.0;            // popularity of the document of rank r ~ r^-zipf_s
  uint32_t system_tokens = 200;
  uint32_t question_tokens = 40;
  uint32_t output_tokens = 128;
};

// A hot working set disturbed by scans: `requests` requests for `hot_prompts` prompts, drawn
// by Zipf(`zipf_s`) popularity, each prompt one of `hot_prefixes` shared prefixes
// (round-robin over prompts) followed by its own body. Before every `scan_every`-th hot request
// (0: never) a burst of `scan_length` one-time prompts of `scan_tokens` unique tokens
// arrives; they are never sent again and share no page with any other request.
struct ScanOptions {
  uint32_t requests = 2000;  // hot requests; the scans come on top
  uint32_t hot_prompts = 200;
  uint32_t hot_prefixes = 4;
  uint32_t hot_prefix_tokens = 512;
  uint32_t hot_body_tokens = 256;
  double zipf_s = 0.9;  // popularity of the prompt of rank r ~ r^-zipf_s
  uint32_t scan_every = 100;
  uint32_t scan_length = 40;
  uint32_t scan_tokens = 1024;
  uint32_t output_tokens = 128;
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
std::vector<TokenRequest> GenerateAgent(const AgentOptions& options, const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateRag(const RagOptions& options, const ArrivalOptions& arrival);
std::vector<TokenRequest> GenerateScan(const ScanOptions& options, const ArrivalOptions& arrival);

// Every generator's options, for choosing one by name.
struct GeneratorOptions {
  ChatOptions chat;
  FewShotOptions few_shot;
  MultiTurnOptions multi_turn;
  RandomOptions random;
  SharedPrefixOptions shared_prefix;
  AgentOptions agent;
  RagOptions rag;
  ScanOptions scan;
  ArrivalOptions arrival;

  // Few enough requests of every generator for a smoke run (CI) to take moments.
  void ShrinkForSmoke() {
    chat.requests = 60;
    few_shot.requests = 60;
    multi_turn.conversations = 12;
    random.prompts = 60;
    shared_prefix.groups = 4;
    shared_prefix.prompts_per_group = 8;
    agent.sessions = 12;
    agent.concurrent = 4;
    rag.requests = 60;
    rag.documents = 40;
    scan.requests = 60;
    scan.hot_prompts = 20;
    scan.scan_every = 20;
    scan.scan_length = 5;
  }
};

// Names GenerateByName accepts, in their canonical order.
inline constexpr absl::string_view kGeneratorNames[] = {"chat", "few-shot", "multi-turn", "random",
                                                        "gsp",  "agent",    "rag",        "scan"};

// The workload called `name` (one of kGeneratorNames); INVALID_ARGUMENT otherwise.
absl::StatusOr<std::vector<TokenRequest>> GenerateByName(absl::string_view name,
                                                         const GeneratorOptions& options);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_GENERATORS_H_
