// "lru" and "lru-mha": least recently used first, as SGLang's RadixCache evicts (lru-mha is
// the same order; CacheIndex charges MHA-shaped bytes for it: the byte-blind baseline).
#include "server/core/eviction_policy.h"

namespace kvcm {
namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(absl::string_view name) : name_(name) {}
  absl::string_view name() const override { return name_; }

 protected:
  // Stamps are below 2^53 for any realistic run, so the double is exact.
  double Score(const RadixNode& node) const override {
    return static_cast<double>(node.last_access);
  }

 private:
  const absl::string_view name_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>("lru"); }

std::unique_ptr<EvictionPolicy> MakeLruMhaPolicy() {
  return std::make_unique<LruPolicy>("lru-mha");
}

}  // namespace kvcm
