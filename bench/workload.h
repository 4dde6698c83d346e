// Synthetic workloads and measurement helpers shared by kvcm_core_bench and kvcm_rpc_bench.
//
// ChatWorkload models chat traffic behind a few system prompts: `groups` system prompts
// whose lengths vary from a few pages to most of a prompt, each followed by many
// conversations that grow turn by turn to `prompt_pages` pages. Indexing every turn of
// every conversation gives a radix tree with a wide fan-out under each system prompt and a
// chain of one node per turn below it, the shape multi-turn chat produces. Each
// conversation lives on one agent (pool); a system prompt is replicated on every agent
// that serves one of its conversations.
//
// Page hashes are the real kvcm chained hashes (HashPages over generated token ids), as a
// client computes them before calling Match. Nothing here is thread-safe.
#ifndef KVCM_BENCH_WORKLOAD_H_
#define KVCM_BENCH_WORKLOAD_H_

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/cache_index.h"

namespace kvcm::bench {

// DeepSeek-V3 / R1: MLA, 61 layers, kv_lora_rank 512, rope 64, bf16 KV, 64-token pages:
// 70,272 B per token, 4,497,408 B per page.
ModelSpec DeepSeekV3Spec();

// SplitMix64: a fast, well-mixed stream of 64-bit values for token ids and choices.
uint64_t SplitMix64(uint64_t& state);

struct ChatWorkloadOptions {
  uint32_t groups = 64;                    // system prompts
  uint32_t conversations_per_group = 224;  // conversations behind each system prompt
  uint32_t prompt_pages = 128;             // pages of a conversation after its last turn
  uint32_t turns = 4;                      // inserts per conversation, each a longer prefix
  uint32_t agents = 8;                     // pools (agent-0 .. agent-N, GPU tier)
  uint32_t page_size_tokens = kDefaultPageSizeTokens;
  uint64_t seed = 1;
};

class ChatWorkload {
 public:
  ChatWorkload(const ChatWorkloadOptions& options, const HashKey& key);

  const ChatWorkloadOptions& options() const { return options_; }
  uint32_t conversations() const { return static_cast<uint32_t>(prefix_pages_.size()); }
  // Distinct pages of all conversations (system prompts counted once).
  uint64_t distinct_pages() const { return distinct_pages_; }

  // The prompt_pages page hashes of conversation `c` after its last turn.
  std::span<const PageHash> Context(uint32_t c) const {
    return {contexts_.data() + size_t{c} * options_.prompt_pages, options_.prompt_pages};
  }
  // Pages of conversation `c` that are its system prompt.
  uint32_t PrefixPages(uint32_t c) const { return prefix_pages_[c]; }
  // Pages of conversation `c` once turn `t` (0-based) is done. TurnEnd(c, turns - 1) is
  // prompt_pages.
  uint32_t TurnEnd(uint32_t c, uint32_t t) const;
  // Agent (pool) that serves conversation `c`.
  const PoolKey& PoolOf(uint32_t c) const { return pools_[c % pools_.size()]; }
  const std::vector<PoolKey>& pools() const { return pools_; }

  // Writes `out.size()` pages that continue the chain after `prev` (the hash of the page
  // before them; PageHash{} at the start of a prompt), hashed from random token ids drawn
  // from `fresh_seed`: pages no workload conversation holds.
  void FreshPages(PageHash prev, uint64_t fresh_seed, std::span<PageHash> out) const;

  // A prompt_pages prompt: the first `shared_pages` pages of conversation `c`, then fresh
  // pages from `fresh_seed`.
  std::vector<PageHash> Diverging(uint32_t c, uint32_t shared_pages, uint64_t fresh_seed) const;

 private:
  ChatWorkloadOptions options_;
  HashKey key_;
  std::vector<PageHash> contexts_;  // [conversations, prompt_pages]
  std::vector<uint32_t> prefix_pages_;
  std::vector<PoolKey> pools_;
  uint64_t distinct_pages_ = 0;
};

// Gives every page-location a distinct block id, per pool, as an agent's allocator would.
class BlockAllocator {
 public:
  // Block ids for `pages` new pages of pool `pool_index`.
  std::span<const BlockId> Next(uint32_t pool_index, uint32_t pages);

 private:
  std::vector<uint32_t> next_;
  std::vector<BlockId> scratch_;
};

struct BuildResult {
  uint64_t inserts = 0;
  uint64_t inserted_pages = 0;  // page-locations the inserts added (new + replicated)
  double seconds = 0;           // wall time spent inside CacheIndex::Insert
};
// Inserts every turn of every conversation into `index`, turn-major (turn 0 of all
// conversations, then turn 1, ...) the way interleaved conversations arrive.
// REQUIRES: `ns` is registered with the hash key `workload` was built with.
absl::StatusOr<BuildResult> BuildIndex(const ChatWorkload& workload, const NamespaceId& ns,
                                       CacheIndex& index);

// Resident set size of this process in bytes (VmRSS of /proc/self/status); 0 if unknown.
uint64_t ResidentBytes();
// Bytes the C allocator has handed out and not taken back (mallinfo2().uordblks +
// hblkhd): the heap the process really uses, without RSS's page granularity.
uint64_t HeapInUseBytes();

// Per-call latencies of one measured loop, in nanoseconds.
class LatencyHistogram {
 public:
  void Reserve(size_t n) { samples_ns_.reserve(n); }
  void Add(std::chrono::steady_clock::duration d) {
    samples_ns_.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  }
  size_t size() const { return samples_ns_.size(); }
  double total_seconds() const;
  double mean_ns() const;
  // Nearest-rank percentile, q in [0, 1]. Sorts the samples on first use.
  double Percentile(double q);

 private:
  std::vector<int64_t> samples_ns_;
  bool sorted_ = false;
};

// Median cost of one std::chrono::steady_clock::now() pair, in ns: the floor below which
// a per-call latency measured with it means nothing.
double SteadyClockOverheadNs();

// CPU time of the whole process (every thread: client, in-process servers, gRPC's), seconds.
double ProcessCpuSeconds();

// Machine and load facts for the header of a benchmark run: "cpus=2 model=... load=...".
std::string MachineSummary();

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_WORKLOAD_H_
