// Every RPC is driven by a fuzz harness (fuzz/calls.h): a method added to CacheManager,
// AgentControl or BlockAgent fails here until a harness's kRpcOf names it.
#include <set>
#include <string>
#include <string_view>

#include "fuzz/calls.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.pb.h"

namespace kvcm::fuzz {
namespace {

TEST(FuzzCallsTest, EveryMethodIsFuzzed) {
  std::set<std::string> fuzzed;
  for (std::string_view rpc : cache_manager_calls::kRpcOf) fuzzed.emplace(rpc);
  for (std::string_view rpc : agent_control_calls::kRpcOf) fuzzed.emplace(rpc);
  for (std::string_view rpc : block_agent_calls::kRpcOf) fuzzed.emplace(rpc);
  fuzzed.erase("");

  std::set<std::string> described;
  for (const google::protobuf::FileDescriptor* file :
       {v1::MatchRequest::descriptor()->file(), v1::HeartbeatRequest::descriptor()->file()}) {
    for (int s = 0; s < file->service_count(); ++s) {
      for (int m = 0; m < file->service(s)->method_count(); ++m) {
        described.emplace(file->service(s)->method(m)->full_name());
      }
    }
  }
  // Both ways: a harness naming a method that does not exist has a typo or a stale entry.
  EXPECT_EQ(fuzzed, described);
}

}  // namespace
}  // namespace kvcm::fuzz
