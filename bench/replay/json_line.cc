#include "bench/replay/json_line.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcm::bench {

// Recursive descent over one line. Only the top-level object's fields are stored.
class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<JsonObject> ParseObjectLine() {
    JsonObject object;
    SkipSpace();
    if (!Consume('{')) return Error("expected '{' at the start of the object");
    SkipSpace();
    if (!Consume('}')) {
      while (true) {
        SkipSpace();
        absl::StatusOr<std::string> name = ParseString();
        if (!name.ok()) return name.status();
        SkipSpace();
        if (!Consume(':')) return Error(absl::StrCat("expected ':' after \"", *name, "\""));
        SkipSpace();
        absl::StatusOr<JsonField> value = ParseTopValue();
        if (!value.ok()) return value.status();
        if (!object.fields_.emplace(*name, std::move(*value)).second) {
          return Error(absl::StrCat("field \"", *name, "\" appears twice"));
        }
        SkipSpace();
        if (Consume('}')) break;
        if (!Consume(',')) return Error("expected ',' or '}' after a value");
      }
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the object");
    return object;
  }

 private:
  static constexpr int kMaxDepth = 64;  // nesting of skipped values

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("column ", pos_ + 1, ": ", what));
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }
  bool Consume(char c) {
    if (Peek() != c) return false;
    ++pos_;
    return true;
  }
  void SkipSpace() {
    while (!AtEnd() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\r' ||
                        text_[pos_] == '\n')) {
      ++pos_;
    }
  }

  // A value of the top-level object: numbers and integer arrays are kept.
  absl::StatusOr<JsonField> ParseTopValue() {
    JsonField field;
    const char c = Peek();
    if (c == '-' || absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      absl::Status s = ParseNumber(&field);
      if (!s.ok()) return s;
      field.kind = JsonField::Kind::kNumber;
      return field;
    }
    if (c == '[') {
      // Integer arrays are the common case (hash_ids, tokens); anything else is skipped.
      const size_t start = pos_;
      absl::StatusOr<bool> ints = ParseIntArray(&field.integers);
      if (!ints.ok()) return ints.status();
      if (*ints) {
        field.kind = JsonField::Kind::kIntArray;
        return field;
      }
      pos_ = start;
      field.integers.clear();
    }
    absl::Status s = SkipValue(0);
    if (!s.ok()) return s;
    field.kind = JsonField::Kind::kOther;
    return field;
  }

  // Parses '[' int, ... ']' into `out`. Returns false (position undefined) when an element
  // is not an integer, so the caller can skip the array as some other value.
  absl::StatusOr<bool> ParseIntArray(std::vector<int64_t>* out) {
    Consume('[');
    SkipSpace();
    if (Consume(']')) return true;
    while (true) {
      SkipSpace();
      const char c = Peek();
      if (c != '-' && !absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
      JsonField n;
      absl::Status s = ParseNumber(&n);
      if (!s.ok()) return s;
      if (!n.is_integer) return false;
      out->push_back(n.integer);
      SkipSpace();
      if (Consume(']')) return true;
      if (!Consume(',')) return Error("expected ',' or ']' in an array");
    }
  }

  // JSON number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  absl::Status ParseNumber(JsonField* field) {
    const size_t start = pos_;
    Consume('-');
    if (Consume('0')) {
      // A leading zero stands alone.
    } else if (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
      while (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) ++pos_;
    } else {
      return Error("expected a digit");
    }
    bool integer = true;
    if (Consume('.')) {
      integer = false;
      if (!absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
        return Error("expected a digit after '.'");
      }
      while (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) ++pos_;
    }
    if (Peek() == 'e' || Peek() == 'E') {
      integer = false;
      ++pos_;
      if (Peek() == '+' || Peek() == '-') ++pos_;
      if (!absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
        return Error("expected a digit in the exponent");
      }
      while (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) ++pos_;
    }
    const std::string token(text_.substr(start, pos_ - start));
    if (!absl::SimpleAtod(token, &field->number) || !std::isfinite(field->number)) {
      pos_ = start;
      return Error(absl::StrCat("number ", token, " is out of range"));
    }
    field->is_integer = integer && absl::SimpleAtoi(token, &field->integer);
    if (integer && !field->is_integer) {
      pos_ = start;
      return Error(absl::StrCat("integer ", token, " does not fit in 64 bits"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ParseString() {
    if (!Consume('"')) return Error("expected '\"'");
    std::string out;
    while (true) {
      if (AtEnd()) return Error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (AtEnd()) return Error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out.push_back(e);
          break;
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          out.push_back(' ');  // field names and skipped strings only: the exact byte is moot
          break;
        case 'u':
          for (int i = 0; i < 4; ++i) {
            if (!absl::ascii_isxdigit(static_cast<unsigned char>(Peek()))) {
              return Error("expected 4 hex digits after \\u");
            }
            ++pos_;
          }
          out.push_back('?');
          break;
        default:
          --pos_;
          return Error("unknown escape in a string");
      }
    }
  }

  absl::Status SkipValue(int depth) {
    if (depth > kMaxDepth) return Error("values nested too deeply");
    SkipSpace();
    const char c = Peek();
    if (c == '"') return ParseString().status();
    if (c == '-' || absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      JsonField ignored;
      return ParseNumber(&ignored);
    }
    for (absl::string_view word : {"true", "false", "null"}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return absl::OkStatus();
      }
    }
    const bool object = c == '{';
    if (!object && c != '[') return Error("expected a value");
    const char close = object ? '}' : ']';
    ++pos_;
    SkipSpace();
    if (Consume(close)) return absl::OkStatus();
    while (true) {
      SkipSpace();
      if (object) {
        if (absl::Status s = ParseString().status(); !s.ok()) return s;
        SkipSpace();
        if (!Consume(':')) return Error("expected ':' after a field name");
      }
      if (absl::Status s = SkipValue(depth + 1); !s.ok()) return s;
      SkipSpace();
      if (Consume(close)) return absl::OkStatus();
      if (!Consume(','))
        return Error(absl::StrCat("expected ',' or '", std::string(1, close), "'"));
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<JsonObject> JsonObject::Parse(absl::string_view text) {
  return JsonParser(text).ParseObjectLine();
}

namespace {

absl::Status FieldError(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("field \"", name, "\" ", what));
}

}  // namespace

absl::StatusOr<int64_t> JsonObject::Integer(absl::string_view name, int64_t min,
                                            int64_t max) const {
  auto it = fields_.find(name);
  if (it == fields_.end()) return FieldError(name, "is missing");
  const JsonField& f = it->second;
  if (f.kind != JsonField::Kind::kNumber || !f.is_integer) {
    return FieldError(name, "must be an integer");
  }
  if (f.integer < min || f.integer > max) {
    return FieldError(name, absl::StrCat("must be in [", min, ", ", max, "], got ", f.integer));
  }
  return f.integer;
}

absl::StatusOr<int64_t> JsonObject::IntegerOr(absl::string_view name, int64_t min, int64_t max,
                                              int64_t default_value) const {
  if (!Has(name)) return default_value;
  return Integer(name, min, max);
}

absl::StatusOr<double> JsonObject::Number(absl::string_view name, double min, double max) const {
  auto it = fields_.find(name);
  if (it == fields_.end()) return FieldError(name, "is missing");
  const JsonField& f = it->second;
  if (f.kind != JsonField::Kind::kNumber) return FieldError(name, "must be a number");
  if (f.number < min || f.number > max) {
    return FieldError(name, absl::StrCat("must be in [", min, ", ", max, "], got ", f.number));
  }
  return f.number;
}

absl::StatusOr<const std::vector<int64_t>*> JsonObject::IntArray(absl::string_view name,
                                                                 int64_t min, int64_t max) const {
  auto it = fields_.find(name);
  if (it == fields_.end()) return FieldError(name, "is missing");
  const JsonField& f = it->second;
  if (f.kind != JsonField::Kind::kIntArray) return FieldError(name, "must be an array of integers");
  for (size_t i = 0; i < f.integers.size(); ++i) {
    if (f.integers[i] < min || f.integers[i] > max) {
      return FieldError(name, absl::StrCat("element ", i, " must be in [", min, ", ", max,
                                           "], got ", f.integers[i]));
    }
  }
  return &f.integers;
}

}  // namespace kvcm::bench
