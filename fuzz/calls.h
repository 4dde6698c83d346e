// The calls of each multi-call harness, by record tag (fuzz_input.h): what the harnesses
// dispatch on and what make_seeds writes. A record's tag is taken modulo kNumCalls.
#ifndef KVCM_FUZZ_CALLS_H_
#define KVCM_FUZZ_CALLS_H_

#include <cstdint>

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
  kNumCalls
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
  kNumCalls
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
}  // namespace block_agent_calls

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_CALLS_H_
