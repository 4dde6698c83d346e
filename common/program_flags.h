// Command-line parsing shared by every binary that uses Abseil flags: --help lists the
// binary's own flags and exits 0, --version prints the build and exits 0, deprecated flag
// spellings keep working for one release with one warning.
#ifndef KVCM_COMMON_PROGRAM_FLAGS_H_
#define KVCM_COMMON_PROGRAM_FLAGS_H_

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcm {

struct ProgramInfo {
  absl::string_view name;   // "kvcm-manager": --version's first word.
  absl::string_view usage;  // The first line of --help.
  // Source files (path suffixes, "server/main.cc") whose flags are this binary's: --help
  // lists those; --helpfull lists every flag linked in (gRPC's and Abseil's included).
  std::initializer_list<absl::string_view> flag_files;
};

// Parses argv like absl::ParseCommandLine and returns the positional arguments (argv[0]
// first). --help, --helpshort and --helpfull print to stdout and exit 0, --version prints
// VersionLine(info.name) and exits 0; an unknown or malformed flag exits 1 with Abseil's
// message naming it. Flag help names files relative to the source tree.
std::vector<char*> ParseProgramFlags(int argc, char** argv, const ProgramInfo& info);

// For mains that parse their own arguments, before they do: --version prints
// VersionLine(name) and exits 0; --help and -h print `usage` and exit 0, unless `usage` is
// empty (the caller's parser has its own help, as Google Benchmark's does).
void HandleHelpAndVersion(int argc, char** argv, absl::string_view name, absl::string_view usage);

// Whether the flag `name` was given on the command line.
bool FlagGiven(absl::string_view name);

// If the deprecated flag `old_name` was given, warns once on stderr
// ("<program>: --old is deprecated; use --new") and, unless `new_flag` was given too, copies
// its value into `new_flag`. Call after ParseProgramFlags, before reading `new_flag`.
template <typename T>
void ApplyDeprecatedFlag(absl::string_view program, absl::Flag<T>& old_flag,
                         absl::string_view old_name, absl::Flag<T>& new_flag,
                         absl::string_view new_name);

// The environment variable `name`, else the deprecated `old_name` (warning once, naming
// both); nullptr when neither is set.
const char* GetEnvWithDeprecated(absl::string_view program, const char* name, const char* old_name);

namespace program_internal {
void WarnDeprecated(absl::string_view program, absl::string_view old_name,
                    absl::string_view new_name);
}  // namespace program_internal

template <typename T>
void ApplyDeprecatedFlag(absl::string_view program, absl::Flag<T>& old_flag,
                         absl::string_view old_name, absl::Flag<T>& new_flag,
                         absl::string_view new_name) {
  if (!FlagGiven(old_name)) return;
  program_internal::WarnDeprecated(program, absl::StrCat("--", old_name),
                                   absl::StrCat("--", new_name));
  if (!FlagGiven(new_name)) absl::SetFlag(&new_flag, absl::GetFlag(old_flag));
}

}  // namespace kvcm

#endif  // KVCM_COMMON_PROGRAM_FLAGS_H_
