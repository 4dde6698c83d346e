// The kvcm-bench trace readers: the input is a trace file, read as a Mooncake trace (both
// ways of counting a partial last block, and with a request limit) and as a token trace
// (then hashed into pages), and its first line parsed by JsonObject::Parse with every
// accessor asked for the fields a trace uses. A token trace read back must write and read
// back to the same requests.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "bench/replay/json_line.h"
#include "bench/replay/trace.h"
#include "fuzz/fuzz_input.h"

namespace kvcm::fuzz {
namespace {

// One scratch file per fuzzing process (libFuzzer's -fork/-jobs run several).
const std::string& ScratchPath(absl::string_view what) {
  static const std::string* base = new std::string(absl::StrCat(
      access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", "/kvcm_trace_fuzzer.", getpid()));
  static std::string path;
  path = absl::StrCat(*base, ".", what);
  return path;
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  Require(f != nullptr, "scratch file");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

void ParseLine(absl::string_view line) {
  absl::StatusOr<bench::JsonObject> o = bench::JsonObject::Parse(line);
  if (!o.ok()) return;
  for (const char* name : {"timestamp", "input_length", "output_length", "hash_ids", "tokens"}) {
    (void)o->Has(name);
    (void)o->Integer(name, 0, 1 << 20);
    (void)o->IntegerOr(name, -5, 5, 0);
    (void)o->Number(name, -1e9, 1e9);
    (void)o->IntArray(name, INT64_MIN, INT64_MAX);
  }
}

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::fuzz;
  namespace bench = kvcm::bench;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  ParseLine(text.substr(0, text.find('\n')));

  const std::string path = ScratchPath("jsonl");
  WriteFile(path, text);
  for (bench::PartialBlock partial :
       {bench::PartialBlock::kDrop, bench::PartialBlock::kKeepAsBlock}) {
    absl::StatusOr<bench::Trace> trace =
        bench::ReadMooncakeTrace(path, {.partial_last_block = partial});
    if (trace.ok()) (void)trace->DistinctPages();
  }
  (void)bench::ReadMooncakeTrace(path, {.max_requests = 1});

  absl::StatusOr<std::vector<bench::TokenRequest>> tokens = bench::ReadTokenTrace(path);
  if (tokens.ok()) {
    const bench::Trace trace = bench::HashTokenTrace("fuzz", *tokens, kvcm::HashKey{1, 2}, 4);
    Require(trace.requests.size() == tokens->size(), "one hashed request per token request");
    const std::string again = ScratchPath("rewritten.jsonl");
    Require(bench::WriteTokenTrace(again, *tokens).ok(), "write token trace");
    absl::StatusOr<std::vector<bench::TokenRequest>> reread = bench::ReadTokenTrace(again);
    Require(reread.ok() && reread->size() == tokens->size(), "token trace round trip");
    for (size_t i = 0; i < tokens->size(); ++i) {
      Require((*reread)[i].tokens == (*tokens)[i].tokens &&
                  (*reread)[i].arrival_ms == (*tokens)[i].arrival_ms &&
                  (*reread)[i].output_tokens == (*tokens)[i].output_tokens,
              "token trace round trip: same requests");
    }
  }
  return 0;
}
