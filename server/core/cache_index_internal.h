// Internals of CacheIndex shared by its .cc files (cache_index.cc: namespaces, matching,
// inserting, pins; cache_index_eviction.cc: budgets, eviction, demotion). Not a public API.
#ifndef KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_
#define KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_

#include <cstdint>
#include <utility>

#include "server/core/cache_index.h"

namespace kvcm {

struct CacheIndex::Namespace {
  Namespace(NamespaceId id_in, const ModelSpec& spec_in, HashKey key_in, uint64_t page_bytes)
      : id(std::move(id_in)), spec(spec_in), key(key_in), bytes_per_page(page_bytes), tree(this) {
    tree.set_page_cost(page_bytes, spec_in.page_size_tokens);
  }

  const NamespaceId id;
  const ModelSpec spec;
  const HashKey key;
  const uint64_t bytes_per_page;
  RadixTree tree;
};

inline CacheIndex::Namespace* OwnerOf(const RadixNode* node) {
  return static_cast<CacheIndex::Namespace*>(node->tree->owner());
}

inline uint64_t NodeBytes(const RadixNode* node) {
  return uint64_t{node->size()} * OwnerOf(node)->bytes_per_page;
}

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_
