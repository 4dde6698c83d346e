# One precompiled header for every GoogleTest executable (GCC builds): gtest, gmock, gRPC,
# protobuf and the kvcm protocol's generated headers, which are most of each test file's
# ~290,000 preprocessed lines. Measured on the 2-core machine: a test file compiles in about
# 30 % less CPU time (fetch_test.cc 15.9 -> 11.4 s, tenant_attack_test.cc 18.4 -> 12.9 s). The
# libraries do not use it: their files include less, and loading the 380 MB header costs a
# small file more than it saves (page_hash.cc 1.4 -> 2.4 s).
#
# kvcm_use_test_pch() at the end of the top-level CMakeLists.txt gives it to every executable
# that links GoogleTest, whichever folder defines it; a new test needs nothing.
option(KVCM_TEST_PCH "Precompile the test executables' common headers (GCC)" ON)

function(kvcm_use_test_pch)
  if(NOT KVCM_BUILD_TESTS OR NOT KVCM_TEST_PCH OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    return()
  endif()
  add_library(kvcm_test_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/kvcm_test_pch.cc)
  target_link_libraries(kvcm_test_pch PRIVATE kvcm_proto GTest::gtest GTest::gmock)
  target_precompile_headers(kvcm_test_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/kvcm_test_pch.h)
  _kvcm_test_pch_in(${PROJECT_SOURCE_DIR})
endfunction()

function(_kvcm_test_pch_in dir)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    get_target_property(libraries ${target} LINK_LIBRARIES)
    get_target_property(sources ${target} SOURCES)
    if(type STREQUAL "EXECUTABLE" AND libraries MATCHES "GTest::" AND NOT sources MATCHES "\\.cu(;|$)")
      target_precompile_headers(${target} REUSE_FROM kvcm_test_pch)
      # GCC uses a precompiled header only where every macro it was built with is defined the
      # same way (a test may define more): the header's -pthread (_REENTRANT, from gRPC's
      # usage requirements) must be the test's too, even a test that links no gRPC.
      target_compile_options(${target} PRIVATE -pthread)
    endif()
  endforeach()
  get_property(subdirectories DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(subdirectory IN LISTS subdirectories)
    _kvcm_test_pch_in(${subdirectory})
  endforeach()
endfunction()
