#include "common/program_flags.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/build_info.h"

namespace kvcm {
namespace {

// The source tree's path as the compiler saw it, from this file's own path.
absl::string_view SourceRoot() {
  absl::string_view self = __FILE__;
  constexpr absl::string_view kSelf = "common/program_flags.cc";
  if (absl::EndsWith(self, kSelf)) self.remove_suffix(kSelf.size());
  return self;
}

}  // namespace

std::string VersionLine(absl::string_view program) {
  const BuildInfo& build = GetBuildInfo();
  return absl::StrCat(program, " ", build.version, " (git ", build.git_revision, ", ",
                      build.build_type, ")");
}

std::vector<char*> ParseProgramFlags(int argc, char** argv, const ProgramInfo& info) {
  absl::SetProgramUsageMessage(info.usage);
  std::vector<std::string> files(info.flag_files.begin(), info.flag_files.end());
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [files](absl::string_view file) {
    for (const std::string& suffix : files) {
      if (absl::EndsWith(file, suffix)) return true;
    }
    return false;
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view file) {
    absl::ConsumePrefix(&file, SourceRoot());
    return std::string(file);
  };
  std::string program(info.name);
  usage.version_string = [program] { return VersionLine(program) + "\n"; };
  absl::SetFlagsUsageConfig(usage);

  // Abseil exits 1 after --help; help asked for is not an error, so handle it here.
  std::vector<char*> positional = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  switch (absl::flags_internal::GetFlagsHelpMode()) {
    case absl::flags_internal::HelpMode::kNone:
      return positional;
    case absl::flags_internal::HelpMode::kVersion:
      std::cout << VersionLine(info.name) << std::endl;
      std::exit(0);
    default:
      absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage());
      std::cout.flush();
      std::exit(0);
  }
}

void HandleHelpAndVersion(int argc, char** argv, absl::string_view name, absl::string_view usage) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") return;
    if (arg == "--version") {
      std::cout << VersionLine(name) << std::endl;
      std::exit(0);
    }
    if (!usage.empty() && (arg == "--help" || arg == "-h")) {
      std::cout << usage << std::endl;
      std::exit(0);
    }
  }
}

bool FlagGiven(absl::string_view name) {
  return absl::flags_internal::WasPresentOnCommandLine(name);
}

const char* GetEnvWithDeprecated(absl::string_view program, const char* name,
                                 const char* old_name) {
  if (const char* value = std::getenv(name); value != nullptr) return value;
  const char* value = std::getenv(old_name);
  if (value != nullptr) {
    program_internal::WarnDeprecated(program, absl::StrCat("$", old_name), absl::StrCat("$", name));
  }
  return value;
}

namespace program_internal {

void WarnDeprecated(absl::string_view program, absl::string_view old_name,
                    absl::string_view new_name) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* warned = new absl::flat_hash_set<std::string>();
  {
    absl::MutexLock lock(&mu);
    if (!warned->insert(std::string(old_name)).second) return;
  }
  std::fprintf(stderr, "%.*s: %.*s is deprecated; use %.*s\n", static_cast<int>(program.size()),
               program.data(), static_cast<int>(old_name.size()), old_name.data(),
               static_cast<int>(new_name.size()), new_name.data());
}

}  // namespace program_internal
}  // namespace kvcm
