// A GPU engine's KV memory on the agent's host, opened from CUDA IPC handles (LocalHello's
// cuda_ipc; docs/AGENTS.md "GPU engines (CUDA IPC)"). Built only when KVCM_CUDA_ENABLED.
//
// The region opens each distinct allocation once (cudaIpcOpenMemHandle with
// cudaIpcMemLazyEnablePeerAccess, on the device named by its PCI bus id), keeps it open for
// the session and closes it when destroyed (cudaIpcCloseMemHandle). Copies are
// cudaMemcpyAsync (cudaMemcpyDefault: device-device, device-host and host-device under
// unified addressing) on a non-blocking stream of its own; Finish synchronizes that stream.
#ifndef KVCM_GPU_AGENT_LOCAL_CUDA_IPC_REGION_H_
#define KVCM_GPU_AGENT_LOCAL_CUDA_IPC_REGION_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "gpu/agent/local/engine_region.h"
#include "kvcm/v1/local.pb.h"

namespace kvcm {

// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// Opens `ipc`'s allocations. `segment_ends[s]`: how far past its allocation's base segment s
// of the last engine block ends; each must lie within the allocation (whose size the driver
// reports: cuMemGetAddressRange), or INVALID_ARGUMENT naming "segment_offsets[s]".
// FAILED_PRECONDITION "no CUDA device", no device at ipc.pci_bus_id, or a handle
// cudaIpcOpenMemHandle refuses (naming "cuda_ipc.segment_handles[s]" and the CUDA error);
// INTERNAL for another CUDA error. Nothing stays open on an error.
// REQUIRES: ipc.segment_handles_size() == segment_ends.size() >= 1, every handle
// kCudaIpcHandleBytes long, ipc.pci_bus_id() not empty (LocalSession checks).
absl::StatusOr<std::unique_ptr<EngineRegion>> OpenCudaIpcRegion(
    const v1::CudaIpcRegion& ipc, std::span<const uint64_t> segment_ends);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_LOCAL_CUDA_IPC_REGION_H_
