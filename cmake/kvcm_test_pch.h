// The headers most test files include (cmake/KvcmTestPch.cmake precompiles them once).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
// Where GCC cannot use the precompiled header (-Winvalid-pch says why) it reads this file
// instead, in a test that may not have the generated headers' folder on its include path.
#if __has_include("kvcm/v1/agent.grpc.pb.h")
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#endif
