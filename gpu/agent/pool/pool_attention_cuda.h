// The device half of RunMlaDecodeOnPool (pool_attention.h): runs MlaDecodeCuda over a paged
// latent cache that already lives in device memory. Built only when KVCM_CUDA_ENABLED; this
// header has no CUDA includes so pool_attention.cc can call it under that macro.
// Thread-safe (stateless); each call uses its own stream and buffers.
#ifndef KVCM_GPU_AGENT_POOL_POOL_ATTENTION_CUDA_H_
#define KVCM_GPU_AGENT_POOL_POOL_ATTENTION_CUDA_H_

#include "absl/status/status.h"
#include "gpu/kernels/mla_decode_params.h"

namespace kvcm {

// `p` as gpu::MlaDecodeCpu takes it, except that p.kv_cache is device memory (a CUDA
// backend's arena at the layer): block_table [batch, block_table_stride], seq_lens [batch]
// and q [batch, q_batch_stride] are host arrays, and out [batch, out_batch_stride] and lse
// [batch, num_heads] are host arrays that receive the results. Copies the host inputs to
// the device of p.kv_cache, runs MlaDecodeCuda, waits for it and copies the results back.
// Allocates device memory on every call: RunAttention is a validation RPC, not the decode
// hot path. INVALID_ARGUMENT as MlaDecodeCuda; FAILED_PRECONDITION when p.kv_cache is not
// device memory; a CUDA error as KVCM_CUDA_RETURN_IF_ERROR converts it (UNAVAILABLE
// without a usable device).
absl::Status MlaDecodeOverDeviceCache(const gpu::MlaDecodeParams& p);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_POOL_ATTENTION_CUDA_H_
