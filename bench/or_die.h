// Exits a benchmark with a message when a setup step fails: a bench measures only a working
// path, and a half-set-up run would print numbers for something else.
#ifndef KVCM_BENCH_OR_DIE_H_
#define KVCM_BENCH_OR_DIE_H_

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm::bench {

template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}

inline void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_OR_DIE_H_
