// The calls of each multi-call harness, by record tag (fuzz_input.h): what the harnesses
// dispatch on and what make_seeds writes. A record's tag is taken modulo kNumCalls.
//
// Each harness's kRpcOf names the RPC each call drives (by the method's full name; "" for
// what is not an RPC). tests/fuzz_calls_test.cc checks them against the services'
// descriptors, so a new RPC fails there until a harness drives it.
#ifndef KVCM_FUZZ_CALLS_H_
#define KVCM_FUZZ_CALLS_H_

#include <array>
#include <cstdint>
#include <string_view>

namespace kvcm::fuzz {

// cache_manager_fuzzer.
namespace cache_manager_calls {
enum Call : uint8_t {
  kRegisterModel,
  kMatch,
  kInsert,
  kRelease,
  kRenewLease,
  kEvict,
  kReserve,
  kUnreserve,
  kRoute,
  kStats,
  kWatchEvents,
  kAdvanceClock,  // not an RPC: time passes (body[0] seconds), so leases and sessions expire
  kPublishEngineEvents,
  kDeleteNamespace,
  kForgetAgent,
  kNumCalls
};
inline constexpr std::array<std::string_view, kNumCalls> kRpcOf = {
    "kvcm.v1.CacheManager.RegisterModel",
    "kvcm.v1.CacheManager.Match",
    "kvcm.v1.CacheManager.Insert",
    "kvcm.v1.CacheManager.Release",
    "kvcm.v1.CacheManager.RenewLease",
    "kvcm.v1.CacheManager.Evict",
    "kvcm.v1.CacheManager.Reserve",
    "kvcm.v1.CacheManager.Unreserve",
    "kvcm.v1.CacheManager.Route",
    "kvcm.v1.CacheManager.Stats",
    "kvcm.v1.CacheManager.WatchEvents",
    "",
    "kvcm.v1.CacheManager.PublishEngineEvents",
    "kvcm.v1.CacheManager.DeleteNamespace",
    "kvcm.v1.CacheManager.ForgetAgent",
};
}  // namespace cache_manager_calls

// agent_control_fuzzer.
namespace agent_control_calls {
enum Call : uint8_t {
  kRegister,         // RegisterAgentRequest
  kHeartbeat,        // HeartbeatRequest
  kInventoryChunk,   // InventoryChunk of the open ReportInventory call (one opens)
  kInventoryClose,   // the agent closes ReportInventory: restore
  kCommandsMessage,  // AgentCommandAck on the open Commands stream (the first is the hello)
  kCommandsClose,    // the agent closes its Commands stream
  kNcclBootstrap,    // NcclBootstrapRequest
  kInsert,           // CacheManager InsertRequest (into an agent's pool: a CommitBlocks)
  kAdvanceClock,     // body[0] seconds pass (agents go stale after 10)
  kLookupAgent,      // LookupAgentRequest
  kMakeRoom,         // MakeRoomRequest
  kNumCalls
};
inline constexpr std::array<std::string_view, kNumCalls> kRpcOf = {
    "kvcm.v1.AgentControl.Register",
    "kvcm.v1.AgentControl.Heartbeat",
    "kvcm.v1.AgentControl.ReportInventory",
    "kvcm.v1.AgentControl.ReportInventory",
    "kvcm.v1.AgentControl.Commands",
    "kvcm.v1.AgentControl.Commands",
    "kvcm.v1.AgentControl.NcclBootstrap",
    "kvcm.v1.CacheManager.Insert",
    "",
    "kvcm.v1.AgentControl.LookupAgent",
    "kvcm.v1.AgentControl.MakeRoom",
};
}  // namespace agent_control_calls

// block_agent_fuzzer.
namespace block_agent_calls {
enum Call : uint8_t {
  kAllocate,      // AllocateBlocksRequest
  kFree,          // FreeBlocksRequest
  kWriteMessage,  // WriteBlocksRequest of the open WriteBlocks call (one opens)
  kWriteClose,    // the client half-closes WriteBlocks: apply
  kReadBlocks,    // ReadBlocksRequest
  kRunAttention,  // RunAttentionRequest
  kFetch,         // FetchRequest
  kStats,         // BlockAgentStatsRequest
  kNumCalls
};
inline constexpr std::array<std::string_view, kNumCalls> kRpcOf = {
    "kvcm.v1.BlockAgent.Allocate",    "kvcm.v1.BlockAgent.Free",
    "kvcm.v1.BlockAgent.WriteBlocks", "kvcm.v1.BlockAgent.WriteBlocks",
    "kvcm.v1.BlockAgent.ReadBlocks",  "kvcm.v1.BlockAgent.RunAttention",
    "kvcm.v1.BlockAgent.Fetch",       "kvcm.v1.BlockAgent.Stats",
};
}  // namespace block_agent_calls

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_CALLS_H_
