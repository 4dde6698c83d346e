// kvcm_rebuild_bench: how long a restarted manager takes to rebuild its index from an agent's
// inventory (RestoreInventory), beside building the same index by Insert in the same run.
//
// Workload: `groups` shared prefixes of `prefix_pages` pages, each followed by `per_group`
// prompts of `suffix_pages` unique pages, all in one DeepSeek-V3 pool; the defaults give
// 1,024,000 page-locations. The inventory lists every page once, shuffled (an agent reports
// its blocks in block order, which need not follow prompts). Each arm runs `reps` times
// into a fresh index; the table shows the median.
//
//   kvcm_rebuild_bench [--smoke] [--reps=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "bench/smoke_flag.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "server/core/cache_index.h"
#include "server/core/inventory_restore.h"

namespace kvcm {
namespace {

struct Shape {
  uint32_t groups = 1000;
  uint32_t prefix_pages = 64;
  uint32_t per_group = 15;
  uint32_t suffix_pages = 64;
};

const NamespaceId kNs{"acme", "deepseek-v3"};
const PoolKey kPool{"gpu-0", Tier::kGpu};

struct Workload {
  std::vector<std::vector<PageHash>> prompts;
  std::vector<std::vector<BlockId>> blocks;
  InventoryBatch inventory;
};

Workload Make(const Shape& s, const ModelSpec& spec) {
  Workload w;
  w.inventory.ns = kNs;
  w.inventory.spec = spec;
  const HashKey key{1, 2};
  BlockId next_block = 0;
  std::vector<int32_t> page(spec.page_size_tokens);
  int32_t token = 0;
  auto add_page = [&](std::vector<PageHash>& pages, std::vector<BlockId>& blocks) {
    for (int32_t& t : page) t = token++;
    const PageHash parent = pages.empty() ? PageHash{} : pages.back();
    pages.push_back(HashPage(key, parent, page));
    blocks.push_back(next_block);
    w.inventory.pages.push_back({.block = next_block++, .page = pages.back(), .parent = parent});
  };
  for (uint32_t g = 0; g < s.groups; ++g) {
    std::vector<PageHash> prefix;
    std::vector<BlockId> prefix_blocks;
    for (uint32_t i = 0; i < s.prefix_pages; ++i) add_page(prefix, prefix_blocks);
    for (uint32_t p = 0; p < s.per_group; ++p) {
      std::vector<PageHash> pages = prefix;
      std::vector<BlockId> blocks = prefix_blocks;
      for (uint32_t i = 0; i < s.suffix_pages; ++i) add_page(pages, blocks);
      w.prompts.push_back(std::move(pages));
      w.blocks.push_back(std::move(blocks));
    }
  }
  std::shuffle(w.inventory.pages.begin(), w.inventory.pages.end(), std::mt19937_64(7));
  return w;
}

std::unique_ptr<CacheIndex> FreshIndex(const ModelSpec& spec, uint64_t pages) {
  auto index = std::make_unique<CacheIndex>(
      CacheIndexOptions{.hash_secret = HashKey{1, 2}, .default_pool_capacity_bytes = 0});
  (void)index->SetPoolCapacity(kPool, pages * spec.BytesPerPage());
  return index;
}

uint64_t PoolPages(const CacheIndex& index) {
  for (const PoolStats& p : index.Stats().pools) {
    if (p.pool == kPool) return p.pages;
  }
  return 0;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

int Run(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm_rebuild_bench",
                       "kvcm_rebuild_bench [--smoke] [--reps=N]: a restarted manager rebuilding "
                       "its index from an agent's inventory, beside Insert");
  Shape shape;
  int reps = 3;
  std::vector<char*> args;
  const bool smoke = bench::TakeSmokeFlag(argc, argv, &args);
  for (size_t i = 1; i < args.size(); ++i) {
    if (std::strncmp(args[i], "--reps=", 7) == 0 && absl::SimpleAtoi(args[i] + 7, &reps) &&
        reps > 0) {
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--reps=N]\n", argv[0]);
      return 2;
    }
  }
  if (smoke) {
    shape = Shape{.groups = 20, .prefix_pages = 8, .per_group = 4, .suffix_pages = 8};
    reps = 1;
  }
  const ModelSpec spec = *FindModel("deepseek-v3", KvDtype::kBf16);
  const Workload w = Make(shape, spec);
  const uint64_t pages = w.inventory.pages.size();
  std::vector<double> insert_s, restore_s;
  for (int r = 0; r < reps; ++r) {
    {
      std::unique_ptr<CacheIndex> index = FreshIndex(spec, pages);
      (void)index->RegisterModel(kNs, spec);
      const auto start = std::chrono::steady_clock::now();
      for (size_t p = 0; p < w.prompts.size(); ++p) {
        if (!index->Insert(kNs, w.prompts[p], kPool, w.blocks[p]).ok()) return 1;
      }
      insert_s.push_back(Seconds(std::chrono::steady_clock::now() - start));
      if (PoolPages(*index) != pages) return 1;
    }
    {
      std::unique_ptr<CacheIndex> index = FreshIndex(spec, pages);
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<RestoreResult> restored =
          RestoreInventory(*index, kPool, spec.BytesPerPage(), w.inventory);
      restore_s.push_back(Seconds(std::chrono::steady_clock::now() - start));
      if (!restored.ok() || restored->indexed_pages != pages || !restored->to_free.empty() ||
          PoolPages(*index) != pages) {
        std::fprintf(stderr, "restore did not rebuild the index\n");
        return 1;
      }
    }
  }
  std::sort(insert_s.begin(), insert_s.end());
  std::sort(restore_s.begin(), restore_s.end());
  const double ins = insert_s[insert_s.size() / 2];
  const double res = restore_s[restore_s.size() / 2];
  absl::PrintF("page-locations %d (%d prompts), %d reps, median:\n", pages, w.prompts.size(), reps);
  absl::PrintF("  build by Insert        %8.3f s  (%.2f M page-locations/s)\n", ins,
               pages / ins / 1e6);
  absl::PrintF("  rebuild from inventory %8.3f s  (%.2f M page-locations/s)\n", res,
               pages / res / 1e6);
  absl::PrintF("  rebuild / insert       %8.2f\n", res / ins);
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Run(argc, argv); }
