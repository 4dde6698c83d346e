#include "common/enum_names.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcm {
namespace {

template <typename E>
struct Named {
  absl::string_view name;
  E value;
};

constexpr Named<Tier> kTiers[] = {
    {"gpu", Tier::kGpu}, {"host", Tier::kHost}, {"disk", Tier::kDisk}};
constexpr Named<AttentionKind> kAttentions[] = {{"mla", AttentionKind::kMla},
                                                {"gqa", AttentionKind::kGqa},
                                                {"mha", AttentionKind::kMha},
                                                {"mqa", AttentionKind::kMqa}};
constexpr Named<KvDtype> kDtypes[] = {{"bf16", KvDtype::kBf16},
                                      {"fp16", KvDtype::kFp16},
                                      {"fp8", KvDtype::kFp8},
                                      {"int8", KvDtype::kInt8}};

template <typename E, size_t N>
absl::string_view NameOf(const Named<E> (&names)[N], E value) {
  for (const Named<E>& n : names) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <typename E, size_t N>
absl::StatusOr<E> Parse(const Named<E> (&names)[N], absl::string_view text,
                        absl::string_view field) {
  const std::string lower = absl::AsciiStrToLower(text);
  std::vector<absl::string_view> choices;
  for (const Named<E>& n : names) {
    if (n.name == lower) return n.value;
    choices.push_back(n.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", absl::StrJoin(choices, "|"), ", got '", text, "'"));
}

}  // namespace

absl::string_view TierName(Tier tier) { return NameOf(kTiers, tier); }
absl::string_view AttentionName(AttentionKind kind) { return NameOf(kAttentions, kind); }
absl::string_view DtypeName(KvDtype dtype) { return NameOf(kDtypes, dtype); }

absl::StatusOr<Tier> ParseTier(absl::string_view text, absl::string_view field) {
  return Parse(kTiers, text, field);
}
absl::StatusOr<AttentionKind> ParseAttention(absl::string_view text, absl::string_view field) {
  return Parse(kAttentions, text, field);
}
absl::StatusOr<KvDtype> ParseDtype(absl::string_view text, absl::string_view field) {
  return Parse(kDtypes, text, field);
}

}  // namespace kvcm
