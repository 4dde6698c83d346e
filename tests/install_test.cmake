# install_test: `cmake --install BUILD_DIR --prefix TMP` installs kvcm-manager, kvcm-agent and
# kvcmctl into TMP/bin, and each answers --version from there.
#   cmake -DBUILD_DIR=build -P tests/install_test.cmake
string(RANDOM LENGTH 8 suffix)
set(prefix "${BUILD_DIR}/install-test-${suffix}")
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc}): ${out}${err}")
endif()
foreach(program kvcm-manager kvcm-agent kvcmctl)
  set(path "${prefix}/bin/${program}")
  if(NOT EXISTS "${path}")
    file(REMOVE_RECURSE "${prefix}")
    message(FATAL_ERROR "${program} was not installed into ${prefix}/bin")
  endif()
  execute_process(COMMAND "${path}" --version RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "${program}")
    file(REMOVE_RECURSE "${prefix}")
    message(FATAL_ERROR "installed ${program} --version: exit ${rc}: ${out}${err}")
  endif()
endforeach()
file(REMOVE_RECURSE "${prefix}")
message(STATUS "installed and ran: kvcm-manager, kvcm-agent, kvcmctl")
