// kvcm-bench: replays request traces through the real kvcm::CacheIndex and reports hit
// rates per (workload, policy, capacity, cluster mode). See kUsage below and --help.
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/replay/crossval.h"
#include "bench/replay/explain.h"
#include "bench/replay/generators.h"
#include "bench/replay/replayer.h"
#include "bench/replay/report.h"
#include "bench/replay/trace.h"
#include "bench/workload.h"
#include "common/enum_names.h"
#include "common/model_catalog.h"
#include "common/model_spec.h"
#include "common/program_flags.h"
#include "server/core/policies/registry.h"

ABSL_FLAG(std::string, workloads, "chat,few-shot,multi-turn,random,gsp,agent,rag,scan,mooncake",
          "Workloads to replay, comma-separated: chat, few-shot, multi-turn, random, gsp, agent, "
          "rag, scan (generated), mooncake (--mooncake_trace).");
ABSL_FLAG(std::string, mooncake_trace, "",
          "Mooncake JSON-lines trace for the mooncake workload (512-token blocks); default: "
          "tests/data/mooncake_conversation_trace.jsonl of the source tree kvcm-bench was "
          "built from, else of the working directory.");
ABSL_FLAG(std::string, mooncake_partial, "drop",
          "A Mooncake prompt's partial last block: drop (never cached, as kvcm does) or block "
          "(count it as a whole block, as the trace's published hit rates do).");
ABSL_FLAG(int64_t, mooncake_max_requests, 0, "Read at most this many Mooncake requests (0: all).");
ABSL_FLAG(std::string, token_traces, "",
          "Extra token-level JSON-lines traces, comma-separated; each replays as workload "
          "tokens:<file name>, hashed into --page_size-token pages.");
ABSL_FLAG(std::string, write_traces_dir, "",
          "If set, write every generated workload there as <name>.jsonl (token-level format).");

ABSL_FLAG(int32_t, page_size, 16,
          "Page size in tokens of generated and token-level workloads (Mooncake: always 512). "
          "16, not the FlashMLA 64: the proposal workloads share 100-500-token parts and add "
          "30-50-token messages, which 64-token pages would mostly round away.");
ABSL_FLAG(std::string, model, "deepseek-v3",
          "Catalogue model (server/core/model_catalog.h; `kvcmctl models` lists them) whose KV "
          "bytes per page the pools are charged.");
ABSL_FLAG(std::string, kv_dtype, "bf16", "KV element type: bf16, fp16, fp8 or int8.");

ABSL_FLAG(std::string, policies, "lru,lru-mha,cost,opt",
          absl::StrCat("Eviction policies, comma-separated, of: ",
                       kvcm::PolicyNames(/*with_clairvoyant=*/true), "."));
ABSL_FLAG(std::string, capacities, "0.01,0.05,0.2,1.0",
          "Total cache capacity as fractions of the workload's distinct pages x bytes per page "
          "(real MLA bytes, for every policy), comma-separated.");
ABSL_FLAG(int32_t, gpus, 1, "GPUs (pools); the total capacity is split evenly over them.");
ABSL_FLAG(std::string, modes, "global,local",
          "Cluster modes, comma-separated: global (one index over every GPU, transfers) and "
          "local (one independent index per GPU). With --gpus=1 they are the same and only "
          "global runs.");
ABSL_FLAG(std::string, route, "round-robin",
          "Request routing, by the core's router (the manager's Route RPC): round-robin, "
          "hash-of-first-page, least-loaded (fewest running) or prefill-saved (most expected "
          "prefill saved: cached pages, and fetched ones where moving beats recomputing; "
          "global mode only).");
ABSL_FLAG(double, prefill_tokens_per_s, 10000,
          "Prefill throughput of one GPU (tokens/s): the cost of an uncached token.");
ABSL_FLAG(double, decode_ms_per_token, 20, "Decode time per output token (ms).");
ABSL_FLAG(double, link_gbps, 400, "GPU-to-GPU transfer bandwidth (Gbit/s), global mode.");
ABSL_FLAG(double, host_capacity, 0,
          "HOST-tier pool per GPU agent, as a fraction of the distinct pages like "
          "--capacities (0: none). Only demoting policies (all but lru, lru-mha and opt) use it.");
ABSL_FLAG(double, reuse_credit_s, 40,
          "cost policy: seconds of recency one reuse of a page is worth (CacheIndexOptions::"
          "reuse_credit).");
ABSL_FLAG(int32_t, density_reuse_classes, kvcm::DensityParams{}.reuse_classes,
          "density policy: reuse classes per tenant, 1, 2 or 4 (DensityParams).");
ABSL_FLAG(bool, density_lru_guard, kvcm::DensityParams{}.lru_guard,
          "density policy: let LRU decide while its victims come back less often "
          "(DensityParams).");
ABSL_FLAG(double, conversation_shift, kvcm::ConversationParams{}.shift,
          "conversation policy: recency one unit of log-odds of a continuation is worth, in "
          "typical times to the next turn (ConversationParams).");
ABSL_FLAG(uint32_t, select_shadow_pages, kvcm::SelectParams{}.shadow_pages,
          "select policy: most pages of one candidate's miniature cache of one pool; sets each "
          "pool's sample rate (SelectParams).");
ABSL_FLAG(double, select_margin_points, kvcm::SelectParams{}.margin_points,
          "select policy: hysteresis, points of token hit rate a candidate's miniature caches "
          "must gain over the current choice's to move to it (SelectParams).");
ABSL_FLAG(double, select_window_capacities, kvcm::SelectParams{}.window_capacities,
          "select policy: half-life of its window, in pool capacities of pages looked up "
          "(SelectParams).");
ABSL_FLAG(double, select_dwell_capacities, kvcm::SelectParams{}.dwell_capacities,
          "select policy: least lookups between two moves, and before the first, in pool "
          "capacities of pages (SelectParams).");
ABSL_FLAG(std::string, select_initial, kvcm::SelectParams{}.initial,
          "select policy: the candidate it starts on (SelectParams).");
ABSL_FLAG(double, adaptive_initial_credit, kvcm::AdaptiveParams{}.initial_credit,
          "adaptive policy: credit of one reuse at start, in mean reuse intervals "
          "(AdaptiveParams).");
ABSL_FLAG(double, adaptive_max_credit, kvcm::AdaptiveParams{}.max_credit,
          "adaptive policy: largest credit, in mean reuse intervals (AdaptiveParams).");
ABSL_FLAG(double, adaptive_step, kvcm::AdaptiveParams{}.step,
          "adaptive policy: credit change per adaptation step, in mean reuse intervals "
          "(AdaptiveParams).");
ABSL_FLAG(bool, crossval, false,
          "Cross-validated evaluation (bench/replay/crossval.h): lru, cost, adaptive, density, "
          "conversation and opt at --crossval_capacities over a train and a test part; the "
          "learning policies' parameters are chosen on the train half of the real trace only. "
          "Ignores --workloads, --policies, --capacities, --gpus, --model and the generator "
          "flags.");
ABSL_FLAG(bool, explain, false,
          "Explain opt against lru on the Mooncake trace (--mooncake_trace; bench/replay/"
          "explain.h): which pages opt hits that lru misses, by depth, reuse, time since last "
          "use, fan-out and turn, at --explain_capacities, as Markdown tables.");
ABSL_FLAG(std::string, explain_capacities, "0.01,0.05,0.2",
          "--explain: capacities, as fractions like --capacities.");
ABSL_FLAG(std::string, explain_half, "",
          "--explain: \"first\" or \"second\" to explain one time half of the trace (as "
          "--crossval splits it); empty for the whole trace.");
ABSL_FLAG(std::string, crossval_capacities, "0.01,0.02,0.05,0.1,0.2",
          "--crossval: capacities, as fractions like --capacities.");
ABSL_FLAG(std::string, crossval_gqa_train, "llama-3-8b",
          "--crossval: catalogue model of the second tenant of the train mix.");
ABSL_FLAG(std::string, crossval_gqa_test, "llama-3-70b",
          "--crossval: catalogue model of the second tenant of the test mixes.");
ABSL_FLAG(bool, crossval_train_only, false,
          "--crossval: run the train part only (to develop a policy without seeing the test "
          "part).");
ABSL_FLAG(bool, crossval_fixed_params, false,
          "--crossval: use the --adaptive_*, --density_* and --conversation_* flags instead of "
          "choosing from the grids (for development on the train part).");
ABSL_FLAG(std::string, crossval_extra_traces, "",
          "--crossval: extra Mooncake-format traces for the test part, comma-separated.");
ABSL_FLAG(std::string, backing, "index",
          "What backs each agent pool: index (the index alone; Insert evicts the shortfall), "
          "agent (a real agent BlockLedger per GPU and HOST pool, in process, and the worker's "
          "Allocate -> EvictForAllocation when short -> Commit -> Insert path; issue 33) or both "
          "(each cell both ways, and a table of their token hit rates).");
ABSL_FLAG(int32_t, agent_full_check_every, 1,
          "--backing=agent: a full ledger-against-index check every this many requests (and "
          "after the last; 0: after the last only); the others check counts and the request's "
          "own blocks.");
ABSL_FLAG(double, regret_window_s, 300,
          "An eviction is regretted when its page is asked for again within this many "
          "simulated seconds.");

ABSL_FLAG(double, request_rate, 4, "Generated workloads: Poisson arrival rate (requests/s).");
ABSL_FLAG(int64_t, seed, 1, "Generated workloads: seed of token ids, arrivals and shuffles.");
ABSL_FLAG(int32_t, output_tokens, 128,
          "Output tokens per request of chat, few-shot, multi-turn, random, agent, rag and scan.");
ABSL_FLAG(int32_t, chat_requests, 1000, "chat: requests.");
ABSL_FLAG(int32_t, chat_system_prompts, 3, "chat: system prompts, used round-robin.");
ABSL_FLAG(int32_t, chat_system_tokens, 200, "chat: tokens per system prompt.");
ABSL_FLAG(int32_t, chat_message_tokens, 50, "chat: tokens of each unique user message.");
ABSL_FLAG(int32_t, fewshot_requests, 1000, "few-shot: requests.");
ABSL_FLAG(int32_t, fewshot_prefix_tokens, 500, "few-shot: tokens of the shared examples.");
ABSL_FLAG(int32_t, fewshot_query_tokens, 30, "few-shot: tokens of each unique query.");
ABSL_FLAG(int32_t, multiturn_conversations, 100, "multi-turn: conversations.");
ABSL_FLAG(int32_t, multiturn_turns, 5, "multi-turn: turns per conversation.");
ABSL_FLAG(int32_t, multiturn_system_tokens, 100, "multi-turn: tokens of the system part.");
ABSL_FLAG(int32_t, multiturn_turn_tokens, 40, "multi-turn: tokens each turn adds.");
ABSL_FLAG(int32_t, multiturn_system_prompts, 1,
          "multi-turn: distinct system parts, round-robin over conversations.");
ABSL_FLAG(int32_t, random_prompts, 1000, "random: prompts.");
ABSL_FLAG(int32_t, random_prompt_tokens, 100, "random: tokens per prompt.");
ABSL_FLAG(int32_t, random_id_range, 100000, "random: token ids are uniform in [0, this).");
ABSL_FLAG(int32_t, gsp_groups, 64, "gsp: groups (distinct system prompts).");
ABSL_FLAG(int32_t, gsp_prompts_per_group, 16, "gsp: prompts per group.");
ABSL_FLAG(int32_t, gsp_system_tokens, 2048, "gsp: tokens per system prompt.");
ABSL_FLAG(int32_t, gsp_question_tokens, 128, "gsp: tokens per question.");
ABSL_FLAG(int32_t, gsp_output_tokens, 256, "gsp: output tokens per request.");
ABSL_FLAG(int32_t, agent_sessions, kvcm::bench::AgentOptions{}.sessions, "agent: sessions.");
ABSL_FLAG(int32_t, agent_concurrent, kvcm::bench::AgentOptions{}.concurrent,
          "agent: sessions live at a time; each request advances one chosen at random.");
ABSL_FLAG(int32_t, agent_steps, kvcm::bench::AgentOptions{}.steps, "agent: steps per session.");
ABSL_FLAG(int32_t, agent_system_tokens, kvcm::bench::AgentOptions{}.system_tokens,
          "agent: tokens of an app's system/tool-schema prompt.");
ABSL_FLAG(int32_t, agent_task_tokens, kvcm::bench::AgentOptions{}.task_tokens,
          "agent: tokens of each session's unique task.");
ABSL_FLAG(int32_t, agent_call_tokens, kvcm::bench::AgentOptions{}.call_tokens,
          "agent: tokens of each step's tool call.");
ABSL_FLAG(int32_t, agent_result_tokens, kvcm::bench::AgentOptions{}.result_tokens,
          "agent: mean tokens of a tool result (uniform in [1/2, 3/2] of it).");
ABSL_FLAG(int32_t, agent_system_prompts, kvcm::bench::AgentOptions{}.system_prompts,
          "agent: apps (distinct system prompts), round-robin over sessions.");
ABSL_FLAG(int32_t, rag_requests, kvcm::bench::RagOptions{}.requests, "rag: requests.");
ABSL_FLAG(int32_t, rag_documents, kvcm::bench::RagOptions{}.documents,
          "rag: documents in the corpus.");
ABSL_FLAG(int32_t, rag_document_tokens, kvcm::bench::RagOptions{}.document_tokens,
          "rag: tokens per document.");
ABSL_FLAG(int32_t, rag_docs_per_request, kvcm::bench::RagOptions{}.docs_per_request,
          "rag: distinct documents retrieved per request.");
ABSL_FLAG(double, rag_zipf_s, kvcm::bench::RagOptions{}.zipf_s,
          "rag: Zipf exponent of document popularity.");
ABSL_FLAG(int32_t, rag_system_tokens, kvcm::bench::RagOptions{}.system_tokens,
          "rag: tokens of the shared instruction prompt.");
ABSL_FLAG(int32_t, rag_question_tokens, kvcm::bench::RagOptions{}.question_tokens,
          "rag: tokens of each unique question.");
ABSL_FLAG(int32_t, scan_requests, kvcm::bench::ScanOptions{}.requests,
          "scan: hot requests (the scans come on top).");
ABSL_FLAG(int32_t, scan_hot_prompts, kvcm::bench::ScanOptions{}.hot_prompts,
          "scan: distinct hot prompts.");
ABSL_FLAG(int32_t, scan_hot_prefixes, kvcm::bench::ScanOptions{}.hot_prefixes,
          "scan: shared prefixes of the hot prompts, round-robin over them.");
ABSL_FLAG(int32_t, scan_hot_prefix_tokens, kvcm::bench::ScanOptions{}.hot_prefix_tokens,
          "scan: tokens per shared prefix.");
ABSL_FLAG(int32_t, scan_hot_body_tokens, kvcm::bench::ScanOptions{}.hot_body_tokens,
          "scan: tokens of each hot prompt's own body.");
ABSL_FLAG(double, scan_zipf_s, kvcm::bench::ScanOptions{}.zipf_s,
          "scan: Zipf exponent of hot prompt popularity.");
ABSL_FLAG(int32_t, scan_every, kvcm::bench::ScanOptions{}.scan_every,
          "scan: a scan burst before every this many hot requests (0: none).");
ABSL_FLAG(int32_t, scan_length, kvcm::bench::ScanOptions{}.scan_length,
          "scan: one-time prompts per burst.");
ABSL_FLAG(int32_t, scan_tokens, kvcm::bench::ScanOptions{}.scan_tokens,
          "scan: tokens per one-time prompt.");

ABSL_FLAG(std::string, json, "", "Write the results as JSON to this path.");
ABSL_FLAG(std::string, csv, "", "Write the results as CSV to this path.");
ABSL_FLAG(bool, smoke, false,
          "Tiny run (well under 2 s) of every workload, policy and mode: small generated "
          "workloads, 300 Mooncake requests, capacities 0.2 and 1.0, 2 GPUs.");

namespace kvcm::bench {
namespace {

// --mooncake_trace, else the bundled trace: the source tree's copy, else the one under the
// working directory (a build moved to another machine).
std::string MooncakeTracePath() {
  std::string path = absl::GetFlag(FLAGS_mooncake_trace);
  if (!path.empty()) return path;
  constexpr const char* kBundled = "tests/data/mooncake_conversation_trace.jsonl";
  if (std::filesystem::exists(KVCM_DEFAULT_MOONCAKE_TRACE)) return KVCM_DEFAULT_MOONCAKE_TRACE;
  return kBundled;
}

constexpr char kUsage[] = R"(trace-replay simulator over the real kvcm::CacheIndex.

  kvcm-bench [--workloads=chat,...,mooncake] [--policies=lru,lru-mha,cost,opt]
             [--capacities=0.01,0.05,0.2,1.0] [--gpus=8 --modes=global,local]
             [--json=out.json] [--csv=out.csv] [--smoke]

Each request: Match(pin) on the GPU it is routed to, Insert of its whole pages there, the
pin held for prefill (uncached tokens / --prefill_tokens_per_s) + decode (output tokens x
--decode_ms_per_token), then Release. Arrivals follow the trace's timestamps on a simulated
clock. In global mode a prefix cached on another GPU is transferred when bytes / --link_gbps
beats recomputing it, and then counts as a hit.

Inputs: Mooncake JSON lines ({"timestamp", "input_length", "output_length", "hash_ids"}; one
id per 512-token block; the partial last block is never cached) and token-level JSON lines
({"timestamp": ms, "tokens": [...], "output_length": n}), plus eight generators (ARCHITECTURE
section 11). Generated and token workloads use --page_size (default 16) tokens per page.

Output per (workload, policy, capacity, mode): token hit rate (hit tokens / whole-page prompt
tokens), request hit rate (requests with >= 1 page hit), prefill tokens saved, pages
evicted, eviction regret, failed inserts (RESOURCE_EXHAUSTED), and page-ops/s: (prompt pages
looked up by Match + pages passed to Insert + pages evicted) / wall time inside the core
calls, as kvcm_core_bench counts them. A table on stdout; --json and --csv write files;
scripts/plot_hit_rate.py draws the CSV (needs `pip install matplotlib`).

With --backing=agent the pools are backed by the agent's real block ledger (in process) and
each request stores its pages as a worker does: Allocate the blocks its GPU's pool lacks;
when the agent is short, the manager's EvictForAllocation evicts the shortfall and the
victims' blocks are freed; Commit; Insert. --backing=both runs every cell both ways.

  kvcm-bench --crossval [--csv=out.csv]

runs lru, cost, adaptive, density, conversation and opt at 1-20 % over a train part and a
held-out test part (bench/replay/crossval.h), chooses the learning policies' parameters on
the train half of the real trace only, and prints Markdown tables of hit rates and of the
share of the lru->opt gap each policy closes.

  kvcm-bench --explain [--explain_capacities=0.01,0.05,0.2] [--explain_half=first]

replays lru and opt on the Mooncake trace and classes every page opt hits and lru misses
(bench/replay/explain.h): by depth, earlier uses, time since last use, fan-out, and whether
the request is the next turn of the page's last user.
)";

absl::StatusOr<std::vector<std::string>> SplitList(const std::string& flag,
                                                   const std::string& text) {
  std::vector<std::string> items;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    items.emplace_back(absl::StripAsciiWhitespace(item));
  }
  if (items.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return items;
}

absl::StatusOr<std::vector<double>> ParseFractions(const std::string& text) {
  absl::StatusOr<std::vector<std::string>> items = SplitList("capacities", text);
  if (!items.ok()) return items.status();
  std::vector<double> out;
  for (const std::string& item : *items) {
    double v = 0;
    if (!absl::SimpleAtod(item, &v) || !(v > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--capacities: \"", item, "\" is not a positive number"));
    }
    out.push_back(v);
  }
  return out;
}

// --backing: index, agent, or both (index first).
absl::StatusOr<std::vector<PoolBacking>> BackingsFromFlag() {
  const std::string name = absl::GetFlag(FLAGS_backing);
  if (name == "both") return std::vector<PoolBacking>{PoolBacking::kIndexOnly, PoolBacking::kAgent};
  absl::StatusOr<PoolBacking> backing = ParsePoolBacking(name);
  if (!backing.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--backing: \"", name, "\" is none of index, agent, both"));
  }
  return std::vector<PoolBacking>{*backing};
}

// The catalogue model --model in --kv_dtype; its page size is set per workload.
absl::StatusOr<ModelSpec> ModelFromFlags() {
  absl::StatusOr<KvDtype> dtype = ParseDtype(absl::GetFlag(FLAGS_kv_dtype), "--kv_dtype");
  if (!dtype.ok()) return dtype.status();
  return FindModel(absl::GetFlag(FLAGS_model), *dtype);
}

GeneratorOptions GeneratorsFromFlags(bool smoke) {
  GeneratorOptions g;
  g.arrival.request_rate_per_s = absl::GetFlag(FLAGS_request_rate);
  g.arrival.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  const uint32_t out = absl::GetFlag(FLAGS_output_tokens);
  g.chat = {.requests = static_cast<uint32_t>(absl::GetFlag(FLAGS_chat_requests)),
            .system_prompts = static_cast<uint32_t>(absl::GetFlag(FLAGS_chat_system_prompts)),
            .system_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_chat_system_tokens)),
            .message_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_chat_message_tokens)),
            .output_tokens = out};
  g.few_shot = {.requests = static_cast<uint32_t>(absl::GetFlag(FLAGS_fewshot_requests)),
                .prefix_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_fewshot_prefix_tokens)),
                .query_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_fewshot_query_tokens)),
                .output_tokens = out};
  g.multi_turn = {
      .conversations = static_cast<uint32_t>(absl::GetFlag(FLAGS_multiturn_conversations)),
      .turns = static_cast<uint32_t>(absl::GetFlag(FLAGS_multiturn_turns)),
      .system_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_multiturn_system_tokens)),
      .turn_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_multiturn_turn_tokens)),
      .system_prompts = static_cast<uint32_t>(absl::GetFlag(FLAGS_multiturn_system_prompts)),
      .output_tokens = out};
  g.random = {.prompts = static_cast<uint32_t>(absl::GetFlag(FLAGS_random_prompts)),
              .prompt_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_random_prompt_tokens)),
              .id_range = static_cast<uint32_t>(absl::GetFlag(FLAGS_random_id_range)),
              .output_tokens = out};
  g.shared_prefix = {
      .groups = static_cast<uint32_t>(absl::GetFlag(FLAGS_gsp_groups)),
      .prompts_per_group = static_cast<uint32_t>(absl::GetFlag(FLAGS_gsp_prompts_per_group)),
      .system_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_gsp_system_tokens)),
      .question_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_gsp_question_tokens)),
      .output_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_gsp_output_tokens))};
  g.agent = {.sessions = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_sessions)),
             .concurrent = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_concurrent)),
             .steps = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_steps)),
             .system_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_system_tokens)),
             .task_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_task_tokens)),
             .call_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_call_tokens)),
             .result_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_result_tokens)),
             .system_prompts = static_cast<uint32_t>(absl::GetFlag(FLAGS_agent_system_prompts)),
             .output_tokens = out};
  g.rag = {.requests = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_requests)),
           .documents = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_documents)),
           .document_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_document_tokens)),
           .docs_per_request = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_docs_per_request)),
           .zipf_s = absl::GetFlag(FLAGS_rag_zipf_s),
           .system_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_system_tokens)),
           .question_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_rag_question_tokens)),
           .output_tokens = out};
  g.scan = {.requests = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_requests)),
            .hot_prompts = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_hot_prompts)),
            .hot_prefixes = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_hot_prefixes)),
            .hot_prefix_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_hot_prefix_tokens)),
            .hot_body_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_hot_body_tokens)),
            .zipf_s = absl::GetFlag(FLAGS_scan_zipf_s),
            .scan_every = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_every)),
            .scan_length = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_length)),
            .scan_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_scan_tokens)),
            .output_tokens = out};
  if (smoke) g.ShrinkForSmoke();
  return g;
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

absl::StatusOr<std::vector<Trace>> LoadWorkloads(bool smoke) {
  absl::StatusOr<std::vector<std::string>> names =
      SplitList("workloads", absl::GetFlag(FLAGS_workloads));
  if (!names.ok()) return names.status();
  const int32_t page_size = absl::GetFlag(FLAGS_page_size);
  if (page_size < 1) return absl::InvalidArgumentError("--page_size must be at least 1");
  const GeneratorOptions generators = GeneratorsFromFlags(smoke);
  const std::string traces_dir = absl::GetFlag(FLAGS_write_traces_dir);
  // Any fixed key: the pages only have to be equal exactly when the tokens are.
  const HashKey key{0x6b76636d2d62656eULL, 0x63682d7265706c61ULL};
  std::vector<Trace> traces;
  for (const std::string& name : *names) {
    if (name == "mooncake") {
      const std::string partial = absl::GetFlag(FLAGS_mooncake_partial);
      if (partial != "drop" && partial != "block") {
        return absl::InvalidArgumentError("--mooncake_partial must be drop or block");
      }
      MooncakeReadOptions options{
          .partial_last_block =
              partial == "block" ? PartialBlock::kKeepAsBlock : PartialBlock::kDrop,
          .max_requests =
              smoke ? 300 : static_cast<size_t>(absl::GetFlag(FLAGS_mooncake_max_requests))};
      absl::StatusOr<Trace> trace = ReadMooncakeTrace(MooncakeTracePath(), options);
      if (!trace.ok()) return trace.status();
      traces.push_back(std::move(*trace));
      continue;
    }
    absl::StatusOr<std::vector<TokenRequest>> requests = GenerateByName(name, generators);
    if (!requests.ok()) return requests.status();
    if (!traces_dir.empty()) {
      absl::Status s = WriteTokenTrace(absl::StrCat(traces_dir, "/", name, ".jsonl"), *requests);
      if (!s.ok()) return s;
    }
    traces.push_back(HashTokenTrace(name, *requests, key, page_size));
  }
  const std::string token_traces = absl::GetFlag(FLAGS_token_traces);
  for (absl::string_view path : absl::StrSplit(token_traces, ',', absl::SkipWhitespace())) {
    absl::StatusOr<std::vector<TokenRequest>> requests = ReadTokenTrace(std::string(path));
    if (!requests.ok()) return requests.status();
    traces.push_back(HashTokenTrace(absl::StrCat("tokens:", BaseName(std::string(path))), *requests,
                                    key, page_size));
  }
  return traces;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "kvcm-bench: %s\n", status.ToString().c_str());
  return 2;
}

int Main(int argc, char** argv) {
  ParseProgramFlags(
      argc, argv,
      {.name = "kvcm-bench", .usage = kUsage, .flag_files = {"bench/replay/kvcm_bench_main.cc"}});
  // As kvcm-manager does: Debian's Abseil otherwise runs its deadlock detector on every lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const bool smoke = absl::GetFlag(FLAGS_smoke);

  absl::StatusOr<ModelSpec> spec = ModelFromFlags();
  if (!spec.ok()) return Fail(spec.status());
  absl::StatusOr<std::vector<std::string>> policies =
      SplitList("policies", absl::GetFlag(FLAGS_policies));
  if (!policies.ok()) return Fail(policies.status());
  absl::StatusOr<std::vector<double>> capacities =
      ParseFractions(smoke ? "0.2,1.0" : absl::GetFlag(FLAGS_capacities));
  if (!capacities.ok()) return Fail(capacities.status());
  absl::StatusOr<std::vector<std::string>> mode_names =
      SplitList("modes", absl::GetFlag(FLAGS_modes));
  if (!mode_names.ok()) return Fail(mode_names.status());
  absl::StatusOr<RoutePolicy> route = ParseRoutePolicy(absl::GetFlag(FLAGS_route));
  if (!route.ok()) return Fail(route.status());
  const int32_t gpus = smoke ? 2 : absl::GetFlag(FLAGS_gpus);
  if (gpus < 1) return Fail(absl::InvalidArgumentError("--gpus must be at least 1"));
  std::vector<ClusterMode> modes;
  for (const std::string& name : *mode_names) {
    absl::StatusOr<ClusterMode> mode = ParseClusterMode(name);
    if (!mode.ok()) return Fail(mode.status());
    // One GPU: the local index is the global one, so only global runs.
    if (gpus == 1 && *mode == ClusterMode::kLocal) continue;
    modes.push_back(*mode);
  }
  if (modes.empty()) modes.push_back(ClusterMode::kGlobal);
  absl::StatusOr<std::vector<PoolBacking>> backings = BackingsFromFlag();
  if (!backings.ok()) return Fail(backings.status());
  const int32_t full_check_every = absl::GetFlag(FLAGS_agent_full_check_every);
  if (full_check_every < 0) {
    return Fail(absl::InvalidArgumentError("--agent_full_check_every must not be negative"));
  }

  absl::StatusOr<std::vector<Trace>> traces = LoadWorkloads(smoke);
  if (!traces.ok()) return Fail(traces.status());

  ReplayOptions base;
  base.gpus = static_cast<uint32_t>(gpus);
  base.route = *route;
  base.prefill_tokens_per_s = absl::GetFlag(FLAGS_prefill_tokens_per_s);
  base.decode_ms_per_token = absl::GetFlag(FLAGS_decode_ms_per_token);
  base.link_gbps = absl::GetFlag(FLAGS_link_gbps);
  base.regret_window = absl::Seconds(absl::GetFlag(FLAGS_regret_window_s));
  base.reuse_credit = absl::Seconds(absl::GetFlag(FLAGS_reuse_credit_s));
  base.host_capacity_fraction = absl::GetFlag(FLAGS_host_capacity);
  base.agent_full_check_every = static_cast<uint32_t>(full_check_every);
  base.density = DensityParams{
      .reuse_classes = static_cast<uint32_t>(absl::GetFlag(FLAGS_density_reuse_classes)),
      .lru_guard = absl::GetFlag(FLAGS_density_lru_guard)};
  base.conversation = ConversationParams{.shift = absl::GetFlag(FLAGS_conversation_shift)};
  base.select.shadow_pages = absl::GetFlag(FLAGS_select_shadow_pages);
  base.select.margin_points = absl::GetFlag(FLAGS_select_margin_points);
  base.select.window_capacities = absl::GetFlag(FLAGS_select_window_capacities);
  base.select.initial = absl::GetFlag(FLAGS_select_initial);
  base.select.dwell_capacities = absl::GetFlag(FLAGS_select_dwell_capacities);
  base.adaptive = AdaptiveParams{.initial_credit = absl::GetFlag(FLAGS_adaptive_initial_credit),
                                 .max_credit = absl::GetFlag(FLAGS_adaptive_max_credit),
                                 .step = absl::GetFlag(FLAGS_adaptive_step)};

  if (absl::GetFlag(FLAGS_explain)) {
    absl::StatusOr<Trace> trace = ReadMooncakeTrace(
        MooncakeTracePath(), MooncakeReadOptions{.max_requests = smoke ? 600u : 0u});
    if (!trace.ok()) return Fail(trace.status());
    const std::string half = absl::GetFlag(FLAGS_explain_half);
    if (!half.empty() && !trace->requests.empty()) {
      if (half != "first" && half != "second") {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("--explain_half: \"", half, "\" is neither first nor second")));
      }
      const double mid =
          (trace->requests.front().arrival_ms + trace->requests.back().arrival_ms) / 2;
      std::erase_if(trace->requests, [&](const TraceRequest& r) {
        return (r.arrival_ms < mid) != (half == "first");
      });
      trace->name = absl::StrCat("mooncake-", half == "first" ? "1st" : "2nd", "-half");
    }
    absl::StatusOr<std::vector<double>> caps =
        ParseFractions(smoke ? "0.05" : absl::GetFlag(FLAGS_explain_capacities));
    if (!caps.ok()) return Fail(caps.status());
    ExplainOptions eo{.capacities = *caps, .base = base};
    eo.base.spec = *spec;
    eo.base.spec.page_size_tokens = trace->page_size_tokens;
    if (absl::Status s = RunExplain(*trace, eo); !s.ok()) return Fail(s);
    return 0;
  }

  if (absl::GetFlag(FLAGS_crossval)) {
    CrossvalOptions cv{.mooncake_trace = MooncakeTracePath(),
                       .mla = *spec,
                       .base = base,
                       .smoke = smoke,
                       .train_only = absl::GetFlag(FLAGS_crossval_train_only),
                       .csv = absl::GetFlag(FLAGS_csv)};
    cv.base.gpus = 1;
    if (absl::GetFlag(FLAGS_crossval_fixed_params)) {
      cv.only_params = base.adaptive;
      cv.only_density = base.density;
      cv.only_conversation = base.conversation;
      cv.only_select = base.select;
    }
    for (absl::string_view path :
         absl::StrSplit(absl::GetFlag(FLAGS_crossval_extra_traces), ',', absl::SkipWhitespace())) {
      cv.extra_test_traces.emplace_back(path);
    }
    absl::StatusOr<KvDtype> dtype = ParseDtype(absl::GetFlag(FLAGS_kv_dtype), "--kv_dtype");
    if (!dtype.ok()) return Fail(dtype.status());
    absl::StatusOr<ModelSpec> gqa_train =
        FindModel(absl::GetFlag(FLAGS_crossval_gqa_train), *dtype);
    if (!gqa_train.ok()) return Fail(gqa_train.status());
    absl::StatusOr<ModelSpec> gqa_test = FindModel(absl::GetFlag(FLAGS_crossval_gqa_test), *dtype);
    if (!gqa_test.ok()) return Fail(gqa_test.status());
    cv.gqa_train = *gqa_train;
    cv.gqa_test = *gqa_test;
    cv.mla_name = absl::GetFlag(FLAGS_model);
    cv.gqa_train_name = absl::GetFlag(FLAGS_crossval_gqa_train);
    cv.gqa_test_name = absl::GetFlag(FLAGS_crossval_gqa_test);
    absl::StatusOr<std::vector<double>> cv_caps =
        ParseFractions(smoke ? "0.05,0.2" : absl::GetFlag(FLAGS_crossval_capacities));
    if (!cv_caps.ok()) return Fail(cv_caps.status());
    cv.capacities = *cv_caps;
    std::printf("kvcm-bench --crossval%s: %s\n", smoke ? " --smoke" : "", MachineSummary().c_str());
    if (absl::Status s = RunCrossval(cv); !s.ok()) return Fail(s);
    return 0;
  }

  std::printf("kvcm-bench%s: %s\n", smoke ? " --smoke" : "", MachineSummary().c_str());
  absl::PrintF(
      "model %s (%s), %d GPU(s), route %s, prefill %.0f tokens/s, decode %.1f ms/token, "
      "link %.0f Gbit/s\n",
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_kv_dtype), gpus, RoutePolicyName(*route),
      base.prefill_tokens_per_s, base.decode_ms_per_token, base.link_gbps);
  for (const Trace& t : *traces) {
    std::printf("workload %-16s %6zu requests, %9llu pages (%llu distinct) of %u tokens\n",
                t.name.c_str(), t.requests.size(), static_cast<unsigned long long>(t.TotalPages()),
                static_cast<unsigned long long>(t.DistinctPages()), t.page_size_tokens);
  }
  std::fflush(stdout);

  std::vector<ResultRow> rows;
  ProgressBar progress(traces->size() * modes.size() * policies->size() * capacities->size() *
                       backings->size());
  for (const Trace& trace : *traces) {
    for (ClusterMode mode : modes) {
      for (const std::string& policy : *policies) {
        for (double capacity : *capacities) {
          for (PoolBacking backing : *backings) {
            ReplayOptions options = base;
            options.spec = *spec;
            options.spec.page_size_tokens = trace.page_size_tokens;
            options.policy = policy;
            options.capacity_fraction = capacity;
            options.mode = mode;
            options.backing = backing;
            const size_t run = rows.size();
            const std::string label =
                absl::StrCat(trace.name, " ", policy, " ", capacity, " ", ClusterModeName(mode),
                             " ", PoolBackingName(backing));
            options.progress = [&](size_t done, size_t total) {
              progress.Update(run, label, done, total);
            };
            absl::StatusOr<ReplayResult> result = Replay(trace, options);
            if (!result.ok()) {
              return Fail(absl::Status(result.status().code(),
                                       absl::StrCat(label, ": ", result.status().message())));
            }
            rows.push_back(ResultRow{.workload = trace.name,
                                     .policy = policy,
                                     .capacity_fraction = capacity,
                                     .mode = std::string(ClusterModeName(mode)),
                                     .gpus = base.gpus,
                                     .route = std::string(RoutePolicyName(*route)),
                                     .backing = std::string(PoolBackingName(backing)),
                                     .result = *result});
          }
        }
      }
    }
  }
  progress.Finish();

  std::fputs(FormatTable(rows).c_str(), stdout);
  if (backings->size() == 2) std::fputs(FormatBackingComparison(rows).c_str(), stdout);
  const std::pair<std::string, std::string> config[] = {
      {"model", absl::GetFlag(FLAGS_model)},
      {"kv_dtype", absl::GetFlag(FLAGS_kv_dtype)},
      {"gpus", absl::StrCat(gpus)},
      {"route", std::string(RoutePolicyName(*route))},
      {"prefill_tokens_per_s", absl::StrCat(base.prefill_tokens_per_s)},
      {"decode_ms_per_token", absl::StrCat(base.decode_ms_per_token)},
      {"link_gbps", absl::StrCat(base.link_gbps)},
      {"page_size", absl::StrCat(absl::GetFlag(FLAGS_page_size))},
      {"mooncake_partial", absl::GetFlag(FLAGS_mooncake_partial)},
      {"request_rate", absl::StrCat(absl::GetFlag(FLAGS_request_rate))},
      {"seed", absl::StrCat(absl::GetFlag(FLAGS_seed))},
      {"backing", absl::GetFlag(FLAGS_backing)},
      {"agent_full_check_every", absl::StrCat(full_check_every)},
      {"smoke", smoke ? "true" : "false"},
      {"machine", MachineSummary()},
  };
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (absl::Status s = WriteJson(path, config, rows); !s.ok()) return Fail(s);
  }
  if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
    if (absl::Status s = WriteCsv(path, rows); !s.ok()) return Fail(s);
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
