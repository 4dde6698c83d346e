# Writes OUTPUT (a C++ source defining kvcm::BuildInfo) from the git revision of SOURCE_DIR,
# VERSION and BUILD_TYPE. Run at build time (see common/CMakeLists.txt); configure_file
# rewrites the file only when its text changes, so an unchanged revision rebuilds nothing.
execute_process(
  COMMAND git -C "${SOURCE_DIR}" rev-parse --short=12 HEAD
  OUTPUT_VARIABLE KVCM_GIT_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE git_result ERROR_QUIET)
if(NOT git_result EQUAL 0 OR KVCM_GIT_REVISION STREQUAL "")
  # A source tree without git (a tarball, a Docker build context without .git).
  set(KVCM_GIT_REVISION "unknown")
else()
  execute_process(
    COMMAND git -C "${SOURCE_DIR}" status --porcelain --untracked-files=no
    OUTPUT_VARIABLE git_changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT git_changes STREQUAL "")
    string(APPEND KVCM_GIT_REVISION "-dirty")
  endif()
endif()
if(BUILD_TYPE STREQUAL "")
  set(BUILD_TYPE "unspecified")
endif()
set(KVCM_VERSION "${VERSION}")
set(KVCM_BUILD_TYPE "${BUILD_TYPE}")
configure_file("${TEMPLATE}" "${OUTPUT}" @ONLY)
