// Command-line parsing for kvcmctl: per-subcommand flag sets and token-list input.
// Hand-written because absl flags are process-global, which does not fit subcommands that
// each take their own flags.
#ifndef KVCM_CLIENT_CLI_ARGS_H_
#define KVCM_CLIENT_CLI_ARGS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm::cli {

// The flags one command accepts. Accepted forms: "--name=value", "--name value", and for
// booleans "--name", "--name=true|false". Every flag must be declared; an unknown or
// malformed one is INVALID_ARGUMENT naming it.
//
// Not thread-safe; a plain value used by one thread.
class FlagSet {
 public:
  void AddString(std::string name, std::string default_value, std::string help);
  void AddInt(std::string name, int64_t default_value, std::string help);
  void AddUint(std::string name, uint64_t default_value, std::string help);
  void AddBool(std::string name, std::string help);
  // `old_name` keeps working as `new_name` (declared before) for one release: parsing it
  // sets `new_name` and records one warning per alias used (see DeprecationWarnings).
  void AddDeprecatedAlias(std::string old_name, std::string new_name);

  // Parses flags from the front of `args` and stops at the first argument that is not a
  // flag, or after "--". Returns how many arguments were consumed.
  absl::StatusOr<size_t> ParsePrefix(std::span<const absl::string_view> args);
  // Parses all of `args`; a positional argument is INVALID_ARGUMENT.
  absl::Status ParseAll(std::span<const absl::string_view> args);

  // REQUIRES: the flag was declared with the matching Add*.
  const std::string& GetString(absl::string_view name) const;
  int64_t GetInt(absl::string_view name) const;
  uint64_t GetUint(absl::string_view name) const;
  bool GetBool(absl::string_view name) const;
  // Whether the flag was given on the command line (rather than defaulted).
  bool IsSet(absl::string_view name) const;

  // One line per flag, "  --name=<type>   help (default: value)", in declaration order,
  // then a line naming the deprecated aliases, if any.
  std::string Help() const;

  // "--old is deprecated; use --new", once per alias the parsed arguments used, in the
  // order they were first used.
  const std::vector<std::string>& DeprecationWarnings() const { return warnings_; }

 private:
  enum class Kind : uint8_t { kString, kInt, kUint, kBool };
  struct Flag {
    Kind kind = Kind::kString;
    std::string help;
    std::string default_text;
    std::string string_value;
    int64_t int_value = 0;
    uint64_t uint_value = 0;
    bool bool_value = false;
    bool set = false;
  };

  static Flag NewFlag(Kind kind, std::string help, std::string default_text);
  void Add(std::string name, Flag flag);
  const Flag& Get(absl::string_view name, Kind kind) const;
  absl::Status Assign(absl::string_view name, Flag& flag, absl::string_view value);

  std::map<std::string, Flag, std::less<>> flags_;
  std::vector<std::string> order_;
  std::map<std::string, std::string, std::less<>> aliases_;  // old name -> new name
  std::vector<std::string> alias_order_;
  std::vector<std::string> warnings_;
};

// Checks that `address`, the value of --`flag`, is "host:port" (IPv6 as "[::1]:port") with
// a port in 1..65535, or a gRPC target with a scheme ("dns:///h:p", "unix:/path"), which is
// passed through. INVALID_ARGUMENT naming the flag and the fix: "--manager_address
// 'localhost' has no port; the manager listens on 50051 by default: localhost:50051", where
// `server` ("the manager") listens on `default_port`. gRPC would dial :443 instead.
absl::Status CheckHostPort(absl::string_view flag, absl::string_view address,
                           absl::string_view server, int default_port);

// Token ids separated by commas and/or whitespace ("1,2,3", "1 2\n3"). Each must fit int32
// and be >= 0. An empty list is allowed.
absl::StatusOr<std::vector<int32_t>> ParseTokenList(absl::string_view text);
// Reads ParseTokenList from a file; errors name the path.
absl::StatusOr<std::vector<int32_t>> ReadTokenFile(const std::string& path);
// `count` pseudo-random ids in [0, vocab) from `seed`, identical on every platform and run
// (SplitMix64), so two processes given the same seed build the same prompt.
// REQUIRES: 0 < vocab <= 2^31.
std::vector<int32_t> RandomTokens(size_t count, uint64_t seed, uint32_t vocab);
// Unsigned 32-bit ids separated by commas and/or whitespace.
absl::StatusOr<std::vector<uint32_t>> ParseUint32List(absl::string_view text);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_CLI_ARGS_H_
