# System packages kvcm builds against (Debian 12; see scripts/install-deps.sh).
find_package(Threads REQUIRED)
# TLS: PEM checks of the credentials factory and the agents' TLS data port (libssl-dev).
find_package(OpenSSL REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_program(KVCM_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

if(KVCM_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
endif()
if(KVCM_BUILD_BENCH)
  find_package(benchmark CONFIG REQUIRED)
endif()
