// PromptSet: kvcm-load's prefix-sharing prompts, hashed once before the run.
//
// num_prefixes shared prefixes ("system prompts") of prefix_pages pages each; behind each,
// prompts_per_prefix prompts that add suffix_pages pages of their own. Every page has a
// fixed block id, distinct across the set, so any prompt may be inserted into an index-only
// pool at any time without two pages ever claiming one block.
//
// Immutable after Make(): safe to read from any number of threads.
#ifndef KVCM_BENCH_LOAD_PROMPT_SET_H_
#define KVCM_BENCH_LOAD_PROMPT_SET_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/types.h"

namespace kvcm::load {

struct PromptSetOptions {
  uint32_t num_prefixes = 64;
  uint32_t prompts_per_prefix = 64;
  uint32_t prefix_pages = 8;
  uint32_t suffix_pages = 24;
  // Keep the token ids too (kvcm::Client::Route hashes tokens itself); costs 4 B per token.
  bool keep_tokens = false;
  uint64_t seed = 1;

  absl::Status Validate() const;
};

struct LoadPrompt {
  std::vector<PageHash> pages;     // chained page hashes, prompt order
  std::vector<BlockId> block_ids;  // one per page, fixed for that page
  std::vector<int32_t> tokens;     // only with keep_tokens
};

class PromptSet {
 public:
  // Tokens -> chained page hashes of the namespace (kvcm::Client::HashPrompt).
  using HashFn = absl::FunctionRef<absl::StatusOr<std::vector<PageHash>>(std::span<const int32_t>)>;

  // Generates the prompts' tokens (page_size_tokens per page) and hashes each with `hash`.
  static absl::StatusOr<PromptSet> Make(const PromptSetOptions& options, uint32_t page_size_tokens,
                                        HashFn hash);

  size_t size() const { return prompts_.size(); }
  const LoadPrompt& operator[](size_t i) const { return prompts_[i]; }

 private:
  std::vector<LoadPrompt> prompts_;
};

}  // namespace kvcm::load

#endif  // KVCM_BENCH_LOAD_PROMPT_SET_H_
