// FP8 latent quantisation on the CPU (FlashMLA's 656 B layout, fp8_latent.h). Bit-identical
// to the CUDA kernels in fp8_latent.cu: both use the same software e4m3 conversion.
// Thread-safe: stateless.
#ifndef KVCM_GPU_KERNELS_FP8_LATENT_CPU_H_
#define KVCM_GPU_KERNELS_FP8_LATENT_CPU_H_

#include <stdint.h>

namespace kvcm::gpu {

// in:  [num_tokens, 576] bf16 bits (512 latents + 64 rope), contiguous
// out: [num_tokens, 656] bytes
void QuantizeLatentsFp8Cpu(const uint16_t* in, int64_t num_tokens, uint8_t* out);

// in:  [num_tokens, 656] bytes
// out: [num_tokens, 576] bf16 bits (latents rounded to nearest bf16; rope copied)
void DequantizeLatentsFp8Cpu(const uint8_t* in, int64_t num_tokens, uint16_t* out);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_FP8_LATENT_CPU_H_
