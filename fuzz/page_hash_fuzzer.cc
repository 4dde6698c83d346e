// Prompt resolution: the input's first byte picks the namespace a request names (the seeded
// one, an unknown one) and the limits, the rest is a v1::Prompt, resolved by ResolvePrompt
// against a ManagerWorld. A resolved prompt must be what its wire form says: page_hashes
// decode to pages that encode back to the same bytes, tokens hash to HashPages of the
// namespace's key. DecodePageHashes / EncodePageHashes also round-trip the input itself.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/page_hash.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/manager_world.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm;
  using namespace kvcm::fuzz;
  if (size < 1) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);

  const std::string_view whole = bytes.substr(0, bytes.size() / 16 * 16);
  Require(EncodePageHashes(DecodePageHashes(whole)) == whole, "page hash wire round trip");

  static ManagerWorld* world = new ManagerWorld;  // ResolvePrompt only reads it
  const NamespaceId ns = data[0] & 1 ? NamespaceId{"tenant-a", "unknown"} : SeedNamespace();
  RequestLimits limits = world->limits;
  if (data[0] & 2) limits.max_pages_per_request = 3;
  if (data[0] & 4) limits.max_tokens_per_request = 9;
  v1::Prompt prompt;
  if (!Parse(bytes, &prompt)) return 0;
  absl::StatusOr<ResolvedPrompt> resolved =
      ResolvePrompt(*world->index, ns, data[0] & 8 ? nullptr : &prompt, limits);
  if (!resolved.ok()) return 0;
  Require(resolved->page_size_tokens == SeedSpec().page_size_tokens, "page size");
  Require(resolved->pages.size() <= limits.max_pages_per_request, "within max_pages_per_request");
  if (prompt.has_tokens()) {
    const auto& ids = prompt.tokens().ids();
    Require(resolved->pages == HashPages(world->ns.hash_key,
                                         std::span<const int32_t>(ids.data(), ids.size()),
                                         resolved->page_size_tokens),
            "tokens hash to the namespace's pages");
  } else {
    Require(EncodePageHashes(resolved->pages) == prompt.page_hashes(), "page_hashes round trip");
  }
  return 0;
}
