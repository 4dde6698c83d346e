// The input layout the multi-call harnesses share: a sequence of records, each a tag byte
// (which call), a 2-byte little-endian length and that many bytes (the call's serialized
// request; a short last record takes what is left). One input is one session against a
// fresh world, so a crash reproduces from its input alone.
#ifndef KVCM_FUZZ_FUZZ_INPUT_H_
#define KVCM_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"
#include "google/protobuf/stubs/logging.h"

namespace kvcm::fuzz {

class Records {
 public:
  Records(const uint8_t* data, size_t size) : rest_(reinterpret_cast<const char*>(data), size) {}

  // The next record; false when the input is used up.
  bool Next(uint8_t* tag, std::string_view* body) {
    if (rest_.size() < 3) return false;
    *tag = static_cast<uint8_t>(rest_[0]);
    const size_t n =
        static_cast<uint8_t>(rest_[1]) | static_cast<size_t>(static_cast<uint8_t>(rest_[2])) << 8;
    rest_.remove_prefix(3);
    *body = rest_.substr(0, n);
    rest_.remove_prefix(body->size());
    return true;
  }

 private:
  std::string_view rest_;
};

// Hostile inputs make protobuf log every invalid UTF-8 string; the harnesses do not need it.
inline const bool kQuietProtobuf = (google::protobuf::SetLogHandler(nullptr), true);

// Parses `body` as gRPC would before calling a handler; false when gRPC would refuse it.
inline bool Parse(std::string_view body, google::protobuf::MessageLite* message) {
  return message->ParseFromArray(body.data(), static_cast<int>(body.size()));
}

// Appends one record (for the seed generator and the regression tests).
inline void AppendRecord(std::string* out, uint8_t tag, std::string_view body) {
  out->push_back(static_cast<char>(tag));
  out->push_back(static_cast<char>(body.size() & 0xFF));
  out->push_back(static_cast<char>(body.size() >> 8 & 0xFF));
  out->append(body.substr(0, 0xFFFF));
}
inline void AppendRecord(std::string* out, uint8_t tag, const google::protobuf::MessageLite& m) {
  AppendRecord(out, tag, m.SerializeAsString());
}

// With KVCM_FUZZ_VERBOSE set, a multi-call harness prints each call's answer: running a
// harness on one input file then shows what that session did.
inline void Report(uint8_t call, const absl::Status& status) {
  static const bool verbose = std::getenv("KVCM_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "call %d: %s\n", call, status.ToString().c_str());
}

// A harness's own invariant broke: abort, so libFuzzer records the input as a crash.
inline void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_FUZZ_INPUT_H_
