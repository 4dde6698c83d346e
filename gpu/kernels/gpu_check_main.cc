// kvcm-gpu-check: runs every CUDA kernel against its CPU twin (max abs / rel error) and
// measures achieved bandwidth against the device's peak (memory clock x bus width x 2, DDR).
// With no usable CUDA device it says so and exits 0.
//   kvcm-gpu-check [--smoke]   (--smoke: small shapes, correctness only)
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/program_flags.h"
#include "gpu/kernels/cuda_runner.h"
#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/fp8_latent_cpu.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_decode_reference.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {
namespace {

struct Row {
  std::string kernel;
  std::string shape;
  double max_abs = 0;
  double max_rel = 0;  // max_abs / max |cpu|
  double us = 0;
  double bytes = 0;  // bytes the kernel must move per launch (unique cache bytes for decode)
};

void Print(const std::vector<Row>& rows, double peak_gbs) {
  absl::PrintF("%-18s %-34s %10s %10s %10s %9s %7s\n", "kernel", "shape", "max_abs", "max_rel",
               "us/launch", "GB/s", "%peak");
  for (const Row& r : rows) {
    const double gbs = r.us > 0 ? r.bytes / (r.us * 1e3) : 0;
    absl::PrintF("%-18s %-34s %10.3g %10.3g %10.1f %9.1f %6.1f%%\n", r.kernel, r.shape, r.max_abs,
                 r.max_rel, r.us, gbs, 100.0 * gbs / peak_gbs);
  }
}

absl::Status CheckDecode(int heads, int batch, int seq_len, LatentDtype dtype, int iterations,
                         std::vector<Row>* rows) {
  MlaTestProblem prob = MakeMlaTestProblem(heads, std::vector<int>(batch, seq_len), 64, dtype, 42,
                                           /*with_reference=*/false);
  std::vector<uint16_t> out;
  std::vector<float> lse;
  Row row;
  row.kernel = dtype == LatentDtype::kFp8E4m3 ? "mla_decode_fp8" : "mla_decode_bf16";
  row.shape = absl::StrFormat("h%d b%d s%d page64", heads, batch, seq_len);
  if (absl::Status s = RunMlaDecodeCuda(prob, iterations, &out, &lse, &row.us); !s.ok()) return s;
  if (absl::Status s = MlaDecodeCpu(prob.params); !s.ok()) return s;
  double max_ref = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    max_ref = std::max<double>(max_ref, fabsf(Bf16ToFloat(prob.out[i])));
    row.max_abs =
        std::max<double>(row.max_abs, fabsf(Bf16ToFloat(prob.out[i]) - Bf16ToFloat(out[i])));
  }
  row.max_rel = max_ref > 0 ? row.max_abs / max_ref : row.max_abs;
  row.bytes = static_cast<double>(MlaTokenBytes(prob.params)) * batch * seq_len;
  rows->push_back(row);
  return absl::OkStatus();
}

absl::Status CheckFp8(int64_t tokens, int iterations, std::vector<Row>* rows) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 1);
  std::vector<uint16_t> in(tokens * kMlaHeadDim);
  for (uint16_t& x : in) x = FloatToBf16(g(rng));
  std::vector<uint8_t> cpu_q(tokens * kFp8TokenBytes), cuda_q;
  std::vector<uint16_t> cpu_d(tokens * kMlaHeadDim), cuda_d;
  QuantizeLatentsFp8Cpu(in.data(), tokens, cpu_q.data());
  DequantizeLatentsFp8Cpu(cpu_q.data(), tokens, cpu_d.data());
  Row q{"fp8_quantize", absl::StrFormat("%d tokens", tokens)};
  Row d{"fp8_dequantize", q.shape};
  if (absl::Status s = RunQuantizeLatentsFp8Cuda(in, tokens, iterations, &cuda_q, &q.us); !s.ok()) {
    return s;
  }
  if (absl::Status s = RunDequantizeLatentsFp8Cuda(cpu_q, tokens, iterations, &cuda_d, &d.us);
      !s.ok()) {
    return s;
  }
  for (size_t i = 0; i < cpu_q.size(); ++i) q.max_abs += cpu_q[i] != cuda_q[i];  // bytes differing
  for (size_t i = 0; i < cpu_d.size(); ++i) {
    d.max_abs = std::max<double>(d.max_abs, fabsf(Bf16ToFloat(cpu_d[i]) - Bf16ToFloat(cuda_d[i])));
  }
  q.shape += " (max_abs: bytes differing)";
  q.bytes = d.bytes = static_cast<double>(tokens) * (kBf16TokenBytes + kFp8TokenBytes);
  rows->push_back(q);
  rows->push_back(d);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm-gpu-check",
                       "kvcm-gpu-check [--smoke]: runs the CUDA kernels on this machine's GPU "
                       "against their CPU twins");
  const bool smoke = argc > 1 && strcmp(argv[1], "--smoke") == 0;
  if (absl::Status s = CudaDeviceStatus(); !s.ok()) {
    absl::PrintF("kvcm-gpu-check: no CUDA device (%s); nothing to check\n", s.message());
    return 0;
  }
  int dev = 0, clock_khz = 0, bus_bits = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
    absl::PrintF("kvcm-gpu-check: cannot query device %d\n", dev);
    return 1;
  }
  const double peak_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  absl::PrintF("kvcm-gpu-check: %s (sm_%d%d), memory clock %d kHz x %d bit -> peak %.0f GB/s\n",
               prop.name, prop.major, prop.minor, clock_khz, bus_bits, peak_gbs);

  std::vector<Row> rows;
  const int iters = smoke ? 2 : 20;
  absl::Status s = CheckFp8(smoke ? 1000 : 1 << 20, iters, &rows);
  struct Shape {
    int heads, batch, seq_len;
  };
  const std::vector<Shape> shapes =
      smoke ? std::vector<Shape>{{16, 2, 300}, {128, 2, 300}}
            : std::vector<Shape>{{128, 64, 4096}, {128, 132, 2048}, {16, 128, 4096}};
  for (const Shape& sh : shapes) {
    for (LatentDtype dt : {LatentDtype::kBf16, LatentDtype::kFp8E4m3}) {
      if (s.ok()) s = CheckDecode(sh.heads, sh.batch, sh.seq_len, dt, iters, &rows);
    }
  }
  Print(rows, peak_gbs);
  if (!s.ok()) {
    absl::PrintF("kvcm-gpu-check: %s\n", s.ToString());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::gpu

int main(int argc, char** argv) { return kvcm::gpu::Main(argc, argv); }
