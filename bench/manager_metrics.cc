#include "bench/manager_metrics.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvcm::bench {

std::pair<double, double> MatchHandlerSeconds(ManagerServer& server) {
  std::pair<double, double> sum_count{0, 0};
  for (absl::string_view line : absl::StrSplit(server.metrics().RenderText(), '\n')) {
    const bool sum = absl::ConsumePrefix(&line, "kvcm_rpc_duration_seconds_sum{rpc=\"Match\"}");
    if (!sum && !absl::ConsumePrefix(&line, "kvcm_rpc_duration_seconds_count{rpc=\"Match\"}")) {
      continue;
    }
    double v = 0;
    if (absl::SimpleAtod(absl::StripAsciiWhitespace(line), &v)) {
      (sum ? sum_count.first : sum_count.second) = v;
    }
  }
  return sum_count;
}

}  // namespace kvcm::bench
