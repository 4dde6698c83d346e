// What a binary was built from: the version, the git revision and the build type, stamped at
// build time (cmake/build_info.cmake), for --version and the build_info metric.
#ifndef KVCM_COMMON_BUILD_INFO_H_
#define KVCM_COMMON_BUILD_INFO_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvcm {

struct BuildInfo {
  absl::string_view version;       // The project's version, "0.1.0".
  absl::string_view git_revision;  // 12 hex digits, "-dirty" with uncommitted changes; "unknown".
  absl::string_view build_type;    // CMAKE_BUILD_TYPE, "RelWithDebInfo".
};

const BuildInfo& GetBuildInfo();

// "<program> <version> (git <revision>, <build type>)", what every binary's --version prints.
std::string VersionLine(absl::string_view program);

}  // namespace kvcm

#endif  // KVCM_COMMON_BUILD_INFO_H_
