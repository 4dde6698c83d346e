#include "bench/load/prompt_set.h"

#include <random>

#include "absl/strings/str_cat.h"

namespace kvcm::load {

absl::Status PromptSetOptions::Validate() const {
  if (num_prefixes == 0 || prompts_per_prefix == 0) {
    return absl::InvalidArgumentError("num_prefixes and prompts_per_prefix must be > 0");
  }
  if (prefix_pages + suffix_pages == 0) {
    return absl::InvalidArgumentError("prefix_pages + suffix_pages must be > 0");
  }
  const uint64_t pages = uint64_t{num_prefixes} * prefix_pages +
                         uint64_t{num_prefixes} * prompts_per_prefix * suffix_pages;
  if (pages >= uint64_t{1} << 31) {
    return absl::InvalidArgumentError(absl::StrCat("the set has ", pages, " pages; at most 2^31"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PromptSet> PromptSet::Make(const PromptSetOptions& options,
                                          uint32_t page_size_tokens, HashFn hash) {
  if (absl::Status s = options.Validate(); !s.ok()) {
    return s;
  }
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int32_t> token(1, 120'000);
  auto random_tokens = [&](uint32_t pages) {
    std::vector<int32_t> t(size_t{pages} * page_size_tokens);
    for (int32_t& x : t) {
      x = token(rng);
    }
    return t;
  };

  // Block ids: the prefixes' pages first, then every prompt's suffix pages.
  const BlockId suffix_base = options.num_prefixes * options.prefix_pages;
  PromptSet set;
  set.prompts_.reserve(size_t{options.num_prefixes} * options.prompts_per_prefix);
  for (uint32_t p = 0; p < options.num_prefixes; ++p) {
    const std::vector<int32_t> prefix = random_tokens(options.prefix_pages);
    for (uint32_t i = 0; i < options.prompts_per_prefix; ++i) {
      LoadPrompt prompt;
      std::vector<int32_t> tokens = prefix;
      const std::vector<int32_t> suffix = random_tokens(options.suffix_pages);
      tokens.insert(tokens.end(), suffix.begin(), suffix.end());
      absl::StatusOr<std::vector<PageHash>> pages = hash(tokens);
      if (!pages.ok()) {
        return pages.status();
      }
      prompt.pages = *std::move(pages);
      for (uint32_t j = 0; j < options.prefix_pages; ++j) {
        prompt.block_ids.push_back(p * options.prefix_pages + j);
      }
      const BlockId first_suffix =
          suffix_base + static_cast<BlockId>(set.prompts_.size()) * options.suffix_pages;
      for (uint32_t j = 0; j < options.suffix_pages; ++j) {
        prompt.block_ids.push_back(first_suffix + j);
      }
      if (options.keep_tokens) {
        prompt.tokens = std::move(tokens);
      }
      set.prompts_.push_back(std::move(prompt));
    }
  }
  return set;
}

}  // namespace kvcm::load
