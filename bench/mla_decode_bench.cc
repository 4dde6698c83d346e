// MLA decode on the CPU (gpu/kernels/mla_decode_cpu.h): bytes of latent cache read per
// second, next to a memcpy of the same bytes in the same run, for DeepSeek-V3 (128 heads)
// and DeepSeek-V2-Lite (16 heads) shapes, bf16 and fp8 latents, page size 64.
//   kvcm_mla_decode_bench [--smoke] [google-benchmark flags]
// --smoke (or KVCM_BENCH_SMOKE in the environment) runs tiny shapes briefly (ctest).
// The CPU twin is single-threaded and reads each token once per sequence for all heads;
// its cost is 2 * heads * (576 + 512) flops per token, so it is compute-bound and the ratio
// to memcpy says how far the CPU path is from the memory system, not what a GPU does.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/smoke_flag.h"
#include "benchmark/benchmark.h"
#include "common/program_flags.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_decode_reference.h"

namespace kvcm::bench {
namespace {

using gpu::LatentDtype;
using gpu::MlaTestProblem;

struct Shape {
  const char* model;
  int heads;
  int batch;
  int seq_len;
};

MlaTestProblem& Problem(const Shape& s, LatentDtype dtype) {
  static auto* cache =
      new std::map<std::tuple<int, int, int, int>, std::unique_ptr<MlaTestProblem>>;
  auto& slot = (*cache)[{s.heads, s.batch, s.seq_len, static_cast<int>(dtype)}];
  if (slot == nullptr) {
    slot = std::make_unique<MlaTestProblem>(gpu::MakeMlaTestProblem(
        s.heads, std::vector<int>(s.batch, s.seq_len), 64, dtype, 1, /*with_reference=*/false));
  }
  return *slot;
}

int64_t CacheBytesRead(const MlaTestProblem& p) {
  return gpu::MlaTokenBytes(p.params) * p.params.batch * p.seq_lens[0];
}

void BM_MlaDecodeCpu(benchmark::State& state, Shape shape, LatentDtype dtype) {
  MlaTestProblem& p = Problem(shape, dtype);
  for (auto _ : state) {
    gpu::MlaDecodeCpuUnchecked(p.params);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * CacheBytesRead(p));
}

// The same number of bytes, copied from the same pool (a contiguous prefix of it).
void BM_Memcpy(benchmark::State& state, Shape shape, LatentDtype dtype) {
  MlaTestProblem& p = Problem(shape, dtype);
  const int64_t bytes = CacheBytesRead(p);
  std::vector<uint8_t> dst(bytes);
  const void* src = p.params.kv_cache;
  for (auto _ : state) {
    memcpy(dst.data(), src, bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

int Main(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm_mla_decode_bench", "");
  std::vector<char*> args;
  const bool smoke = bench::TakeSmokeFlag(argc, argv, &args);
  static char min_time[] = "--benchmark_min_time=0.01";
  if (smoke) args.push_back(min_time);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  const std::vector<Shape> shapes =
      smoke ? std::vector<Shape>{{"V3", 128, 1, 64}, {"V2-Lite", 16, 2, 100}}
            : std::vector<Shape>{{"V3", 128, 1, 1024},
                                 {"V3", 128, 4, 512},
                                 {"V2-Lite", 16, 1, 4096},
                                 {"V2-Lite", 16, 8, 2048}};
  for (const Shape& s : shapes) {
    for (LatentDtype dt : {LatentDtype::kBf16, LatentDtype::kFp8E4m3}) {
      const std::string name =
          absl::StrFormat("%s/h%d/b%d/s%d/%s", s.model, s.heads, s.batch, s.seq_len,
                          dt == LatentDtype::kBf16 ? "bf16" : "fp8");
      benchmark::RegisterBenchmark(("MlaDecodeCpu/" + name).c_str(), BM_MlaDecodeCpu, s, dt)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("Memcpy/" + name).c_str(), BM_Memcpy, s, dt)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
