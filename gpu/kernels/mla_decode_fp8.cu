// FP8 (FlashMLA 656 B layout) latent cache instantiation of mla_decode.cuh.
#include "gpu/kernels/mla_decode.cuh"

namespace kvcm::gpu {

cudaError_t LaunchMlaDecodeFp8(const MlaDecodeParams& p, cudaStream_t stream) {
  return LaunchMlaDecodeKernel<Fp8Latents>(p, stream);
}

}  // namespace kvcm::gpu
