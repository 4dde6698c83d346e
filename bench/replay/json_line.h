// A small parser for one JSON object per line (JSON lines), enough for request traces.
//
// It accepts any valid JSON object and keeps only the top-level fields a trace needs:
// numbers, and arrays whose elements are all integers. Other values (strings, booleans,
// null, nested objects, arrays holding anything else) are checked for syntax and skipped.
// There is no JSON library in kvcm's dependencies, and a trace line needs no more.
//
// Pure functions; safe to call concurrently.
#ifndef KVCM_BENCH_REPLAY_JSON_LINE_H_
#define KVCM_BENCH_REPLAY_JSON_LINE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm::bench {

struct JsonField {
  enum class Kind : uint8_t { kNumber, kIntArray, kOther };
  Kind kind = Kind::kOther;
  double number = 0;              // kNumber
  bool is_integer = false;        // kNumber written without fraction or exponent
  int64_t integer = 0;            // kNumber when is_integer
  std::vector<int64_t> integers;  // kIntArray (an empty array is one too)
};

// The top-level fields of a flat JSON object, by name.
class JsonObject {
 public:
  // Parses `text`, which must hold exactly one JSON object (surrounding whitespace allowed).
  // INVALID_ARGUMENT says what was expected and at which column (1-based).
  static absl::StatusOr<JsonObject> Parse(absl::string_view text);

  bool Has(absl::string_view name) const { return fields_.contains(name); }

  // The value of field `name` as an integer in [min, max]. INVALID_ARGUMENT naming the
  // field when it is missing (unless a default is given), not an integer, or out of range.
  absl::StatusOr<int64_t> Integer(absl::string_view name, int64_t min, int64_t max) const;
  absl::StatusOr<int64_t> IntegerOr(absl::string_view name, int64_t min, int64_t max,
                                    int64_t default_value) const;
  // Any number (integer or not) in [min, max].
  absl::StatusOr<double> Number(absl::string_view name, double min, double max) const;
  // An array of integers, each in [min, max].
  absl::StatusOr<const std::vector<int64_t>*> IntArray(absl::string_view name, int64_t min,
                                                       int64_t max) const;

 private:
  friend class JsonParser;
  absl::flat_hash_map<std::string, JsonField> fields_;
};

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_JSON_LINE_H_
