// bf16 latent cache instantiation of mla_decode.cuh, and the dtype dispatch.
#include "gpu/kernels/mla_decode.cuh"

namespace kvcm::gpu {

cudaError_t LaunchMlaDecodeBf16(const MlaDecodeParams& p, cudaStream_t stream) {
  return LaunchMlaDecodeKernel<Bf16Latents>(p, stream);
}

cudaError_t LaunchMlaDecode(const MlaDecodeParams& p, cudaStream_t stream) {
  return p.dtype == LatentDtype::kFp8E4m3 ? LaunchMlaDecodeFp8(p, stream)
                                          : LaunchMlaDecodeBf16(p, stream);
}

}  // namespace kvcm::gpu
