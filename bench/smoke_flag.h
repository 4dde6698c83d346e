// The flag every bench takes: `--smoke` (or KVCM_BENCH_SMOKE in the environment) runs small
// shapes and few rounds, so that CI keeps each bench's code path alive (bench/CMakeLists.txt
// registers the smoke tests); the numbers it prints then mean nothing. Header-only.
#ifndef KVCM_BENCH_SMOKE_FLAG_H_
#define KVCM_BENCH_SMOKE_FLAG_H_

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/or_die.h"
#include "common/model_catalog.h"

namespace kvcm::bench {

// Whether smoke mode is on; `rest` gets argv without any --smoke (argv[0] first), for the
// bench's own flags or Google Benchmark's.
inline bool TakeSmokeFlag(int argc, char** argv, std::vector<char*>* rest) {
  bool smoke = std::getenv("KVCM_BENCH_SMOKE") != nullptr;
  rest->clear();
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else {
      rest->push_back(argv[i]);
    }
  }
  return smoke;
}

// For a bench whose only flag is --smoke: any other argument prints `usage` and exits 2.
inline bool SmokeFlagOnly(int argc, char** argv, const char* usage) {
  std::vector<char*> rest;
  const bool smoke = TakeSmokeFlag(argc, argv, &rest);
  if (rest.size() > 1) {
    std::fprintf(stderr, "usage: %s\n", usage);
    std::exit(2);
  }
  return smoke;
}

// The blocks a pool bench runs on: deepseek-v3's (bf16, 64-token pages: 4.3 MiB), or in
// smoke mode a 2-layer GQA model's (16-token pages: 32 KiB).
inline ModelSpec DeepSeekV3OrSmokeSpec(bool smoke) {
  if (!smoke) return OrDie(FindModel("deepseek-v3"), "deepseek-v3");
  ModelSpec spec;
  spec.attention = AttentionKind::kGqa;
  spec.num_layers = 2;
  spec.num_heads = 8;
  spec.num_kv_heads = 4;
  spec.head_dim = 64;
  spec.dtype = KvDtype::kBf16;
  spec.page_size_tokens = 16;
  return spec;
}

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_SMOKE_FLAG_H_
