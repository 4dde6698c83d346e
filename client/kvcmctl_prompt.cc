// kvcmctl's commands about one prompt: match, route, insert (through the agent that holds
// the pages when it serves BlockAgent) and fetch (an agent pulls the pages it lacks).
//
// A separate process has no namespace hash key, so match and insert send tokens and the
// manager hashes them; the library's local hashing is for long-lived clients. fetch needs
// page hashes (BlockAgent.Fetch takes no tokens): it re-registers the namespace with the
// spec the manager reports, which is idempotent and gives it the key.
#include "client/kvcmctl_prompt.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/agent_blocks.h"
#include "client/cli_inputs.h"
#include "client/client.h"
#include "client/fetch_plan.h"
#include "client/kvcmctl_print.h"
#include "client/tls_hint.h"
#include "common/credentials.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.pb.h"

namespace kvcm::cli {
namespace {

// --tenant/--model and the prompt's tokens: what every command about a prompt takes.
struct PromptFlags {
  NamespaceId ns;
  std::vector<int32_t> tokens;
};

absl::StatusOr<PromptFlags> PromptFlagsFrom(const FlagSet& flags) {
  absl::StatusOr<NamespaceId> ns = NamespaceFrom(flags);
  if (!ns.ok()) {
    return ns.status();
  }
  absl::StatusOr<std::vector<int32_t>> tokens = TokensFrom(flags);
  if (!tokens.ok()) {
    return tokens.status();
  }
  return PromptFlags{*std::move(ns), *std::move(tokens)};
}

}  // namespace

// --- match --------------------------------------------------------------------------------

namespace {

void PrintMatch(const MatchReply& m) {
  absl::PrintF("prompt_pages: %u\n", m.prompt_pages);
  absl::PrintF("matched_pages: %u\n", m.matched_pages);
  absl::PrintF("matched_tokens: %u\n", m.matched_tokens);
  absl::PrintF("local_pages: %u\n", m.local_pages);
  for (const MatchReply::Segment& s : m.segments) {
    absl::PrintF("segment pages [%u, %u):\n", s.first_page, s.first_page + s.num_pages);
    for (const MatchReply::Replica& r : s.replicas) {
      absl::PrintF("  %s blocks %s\n", r.pool.ToString(), absl::StrJoin(r.block_ids, ","));
    }
  }
  // Only a pin has an id: "pin_id: 0" would read as a pin numbered 0.
  if (m.pin_id != 0) {
    absl::PrintF("pin_id: %d\n", m.pin_id);
    absl::PrintF("lease_expiry: %s\n", FormatExpiry(m.lease_expiry));
  }
}

}  // namespace

void DefineMatch(FlagSet& f) {
  DefineNamespace(f);
  DefineTokens(f);
  f.AddString("agent", "", "requester agent id: its replicas are listed first");
  f.AddBool("pin", "pin the matched pages (release later with 'release --pin_id')");
  f.AddUint("lease_ttl_ms", 0, "lease of the pin; 0 = the manager's default");
  f.AddBool("probe", "look only: no recency update, no pin, no counters");
}

int RunMatch(const Invocation& in) {
  absl::StatusOr<PromptFlags> prompt = PromptFlagsFrom(in.flags);
  if (!prompt.ok()) {
    return in.Usage(prompt.status().message());
  }
  const NamespaceId& ns = prompt->ns;
  const std::vector<int32_t>& tokens = prompt->tokens;
  if (in.flags.GetUint("lease_ttl_ms") > UINT32_MAX) {
    return in.Usage("--lease_ttl_ms: too large");
  }
  MatchParams params;
  params.requester_agent_id = in.flags.GetString("agent");
  params.pin = in.flags.GetBool("pin");
  params.lease_ttl_ms = static_cast<uint32_t>(in.flags.GetUint("lease_ttl_ms"));
  params.probe = in.flags.GetBool("probe");
  v1::MatchResponse reply;
  absl::StatusOr<MatchReply> m = in.client->Match(ns, tokens, params, in.Call(reply));
  if (!m.ok()) {
    return in.Failed(m.status());
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("prompt_tokens: %d\n", tokens.size());
  PrintMatch(*m);
  return kExitOk;
}

// --- route --------------------------------------------------------------------------------

void DefineRoute(FlagSet& f) {
  DefineNamespace(f);
  DefineTokens(f);
  f.AddString("candidates", "",
              "comma-separated agent ids to choose from; empty: every live agent");
  f.AddString("loads", "",
              "comma-separated load of each candidate (same order), e.g. running requests");
  f.AddString("policy", "prefill-saved",
              "prefill-saved, round-robin, hash-of-first-page or least-loaded");
  f.AddUint("prefill_tokens_per_s", 0, "prefill throughput of one GPU; 0 = the manager's default");
  f.AddBool("pin", "pin the matched pages for the chosen agent (release with 'release --pin_id')");
  f.AddUint("lease_ttl_ms", 0, "lease of the pin; 0 = the manager's default");
  f.AddBool("probe", "look only: no recency update, no pin, no counters");
}

int RunRoute(const Invocation& in) {
  absl::StatusOr<PromptFlags> prompt = PromptFlagsFrom(in.flags);
  if (!prompt.ok()) {
    return in.Usage(prompt.status().message());
  }
  const NamespaceId& ns = prompt->ns;
  const std::vector<int32_t>& tokens = prompt->tokens;
  absl::StatusOr<RouteParams::Policy> policy = ParseRouteParamsPolicy(in.flags.GetString("policy"));
  if (!policy.ok()) {
    return in.Usage(absl::StrCat("--policy: ", policy.status().message()));
  }
  if (in.flags.GetUint("lease_ttl_ms") > UINT32_MAX) {
    return in.Usage("--lease_ttl_ms: too large");
  }
  RouteParams params;
  params.policy = *policy;
  params.prefill_tokens_per_s = static_cast<double>(in.flags.GetUint("prefill_tokens_per_s"));
  params.pin = in.flags.GetBool("pin");
  params.probe = in.flags.GetBool("probe");
  params.lease_ttl_ms = static_cast<uint32_t>(in.flags.GetUint("lease_ttl_ms"));
  const std::vector<std::string> ids =
      absl::StrSplit(in.flags.GetString("candidates"), ',', absl::SkipEmpty());
  const std::vector<std::string> loads =
      absl::StrSplit(in.flags.GetString("loads"), ',', absl::SkipEmpty());
  if (!loads.empty() && loads.size() != ids.size()) {
    return in.Usage(
        absl::StrCat("--loads: ", loads.size(), " values for ", ids.size(), " candidates"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    RouteParams::Candidate& c = params.candidates.emplace_back();
    c.agent_id = ids[i];
    if (!loads.empty() && !absl::SimpleAtoi(loads[i], &c.load)) {
      return in.Usage(absl::StrCat("--loads: \"", loads[i], "\" is not a number"));
    }
  }
  v1::RouteResponse reply;
  absl::StatusOr<RouteReply> r = in.client->Route(ns, tokens, params, in.Call(reply));
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("prompt_tokens: %d\n", tokens.size());
  for (size_t i = 0; i < r->ranked.size(); ++i) {
    const RouteReply::Ranked& a = r->ranked[i];
    absl::PrintF(
        "rank %d: %s cached_pages=%u fetch_pages=%u recompute_pages=%u saved_prefill_ms=%.3f "
        "transfer_ms=%.3f queue_ms=%.3f link_gbps=%.1f load=%d\n",
        i + 1, a.agent_id, a.cached_pages, a.fetch_pages, a.recompute_pages, a.saved_prefill_ms,
        a.transfer_ms, a.queue_ms, a.link_gbps, a.load);
  }
  if (!r->ranked.empty()) {
    absl::PrintF("chosen_agent: %s\n", r->ranked[0].agent_id);
  }
  PrintMatch(r->match);
  return kExitOk;
}

// --- insert -------------------------------------------------------------------------------

void DefineInsert(FlagSet& f) {
  DefineNamespace(f);
  DefineTokens(f);
  f.AddString("agent", "", "agent that holds the pages (required)");
  f.AddString("tier", "gpu", "tier of the pool: gpu|host|disk");
  f.AddString("block_ids", "", "block id of each whole page, comma separated");
  f.AddUint("first_block", 0,
            "blocks first_block, first_block+1, ... (an index-only pool); without --block_ids "
            "or --first_block the blocks are allocated on the agent");
}

namespace {

// Which blocks hold each page after `reply`: the index's for the pages already there, ours
// for the rest.
std::vector<BlockId> HeldBlocks(const InsertReply& reply, const std::vector<BlockId>& ours) {
  std::vector<BlockId> held = reply.existing_block_ids;
  held.insert(held.end(), ours.begin() + held.size(), ours.end());
  return held;
}

void PrintInsert(const PoolRef& pool, const InsertReply& r) {
  absl::PrintF("pool: %s\n", pool.ToString());
  absl::PrintF("new_pages: %u\n", r.new_pages);
  absl::PrintF("replicated_pages: %u\n", r.replicated_pages);
  absl::PrintF("already_present_pages: %u\n", r.already_present_pages);
  if (!r.existing_block_ids.empty()) {
    absl::PrintF("existing_block_ids: %s\n", absl::StrJoin(r.existing_block_ids, ","));
  }
  absl::PrintF("evicted_bytes: %d\n", r.evicted_bytes);
}

// Insert into the pool of a running agent, as a worker does: allocate blocks for the
// namespace on the agent, insert them (the agent commits them), and free the ones the
// manager did not keep.
int InsertThroughAgent(const Invocation& in, const NamespaceId& ns, std::span<const int32_t> tokens,
                       const PoolRef& pool, size_t pages, const std::string& address) {
  absl::StatusOr<AgentBlocks> blocks =
      AgentBlocks::Allocate(in.client->channels(), address, ns, pages);
  if (!blocks.ok()) {
    return in.Failed(blocks.status());
  }
  // A worker writes its KV before the insert; kvcmctl has none, so its blocks hold zeros.
  if (absl::Status s = blocks->Fill(std::byte{0}); !s.ok()) {
    (void)blocks->Free(blocks->ids());
    return in.Failed(s);
  }
  v1::InsertResponse reply;
  absl::StatusOr<InsertReply> r =
      in.client->Insert(ns, tokens, pool, blocks->ids(),
                        InsertParams{.agent_epoch = blocks->epoch()}, in.Call(reply));
  if (!r.ok()) {
    (void)blocks->Free(blocks->ids());  // nothing was committed: they are ours again
    return in.Failed(r.status());
  }
  std::vector<BlockId> spare;
  for (size_t i = 0; i < r->existing_block_ids.size(); ++i) {
    if (r->existing_block_ids[i] != blocks->ids()[i]) spare.push_back(blocks->ids()[i]);
  }
  if (absl::Status s = blocks->Free(spare); !s.ok()) {
    absl::FPrintF(stderr, "kvcmctl insert: freeing %d spare blocks: %s\n", spare.size(),
                  s.ToString());
  }
  if (in.json) return PrintJson(reply);
  PrintInsert(pool, *r);
  absl::PrintF("agent_epoch: %d\n", blocks->epoch());
  absl::PrintF("block_ids: %s\n", absl::StrJoin(HeldBlocks(*r, blocks->ids()), ","));
  return kExitOk;
}

}  // namespace

int RunInsert(const Invocation& in) {
  absl::StatusOr<PromptFlags> prompt = PromptFlagsFrom(in.flags);
  if (!prompt.ok()) {
    return in.Usage(prompt.status().message());
  }
  const NamespaceId& ns = prompt->ns;
  const std::vector<int32_t>& tokens = prompt->tokens;
  if (in.flags.GetString("agent").empty()) {
    return in.Usage("--agent is required");
  }
  absl::StatusOr<Tier> tier = ParseTier(in.flags.GetString("tier"), "--tier");
  if (!tier.ok()) {
    return in.Usage(tier.status().message());
  }
  const PoolRef pool{in.flags.GetString("agent"), *tier};

  std::vector<BlockId> block_ids;
  if (in.flags.IsSet("block_ids")) {
    if (in.flags.IsSet("first_block")) {
      return in.Usage("give --block_ids or --first_block, not both");
    }
    absl::StatusOr<std::vector<uint32_t>> ids = ParseUint32List(in.flags.GetString("block_ids"));
    if (!ids.ok()) {
      return in.Usage(absl::StrCat("--block_ids: ", ids.status().message()));
    }
    block_ids = *std::move(ids);
  } else {
    // One block per whole page: the page size is the namespace's, which Stats reports, as
    // it reports where the pool's agent serves BlockAgent.
    absl::StatusOr<ManagerStats> stats = in.client->Stats();
    if (!stats.ok()) {
      return in.Failed(stats.status());
    }
    uint32_t page_size = 0;
    for (const ManagerStats::Namespace& n : stats->namespaces) {
      if (n.ns == ns) {
        page_size = n.spec.page_size_tokens;
      }
    }
    if (page_size == 0) {
      return in.Failed(absl::NotFoundError(
          absl::StrCat("namespace ", ns.ToString(), " is not registered (see register-model)")));
    }
    const size_t pages = tokens.size() / page_size;
    if (!in.flags.IsSet("first_block") && pages > 0) {
      for (const ManagerStats::Agent& a : stats->agents) {
        if (a.agent_id == pool.agent_id && !a.block_agent_address.empty()) {
          return InsertThroughAgent(in, ns, tokens, pool, pages, a.block_agent_address);
        }
      }
    }
    if (!in.flags.IsSet("first_block") && pages > 0) {
      absl::FPrintF(stderr,
                    "kvcmctl insert: agent %s is not registered: inserting index-only blocks "
                    "(no agent holds them; --first_block says so explicitly)\n",
                    pool.agent_id);
    }
    const uint64_t first = in.flags.GetUint("first_block");
    if (first + pages > uint64_t{UINT32_MAX} + 1) {
      return in.Usage("--first_block: too large");
    }
    for (size_t i = 0; i < pages; ++i) {
      block_ids.push_back(static_cast<BlockId>(first + i));
    }
  }

  v1::InsertResponse reply;
  absl::StatusOr<InsertReply> r = in.client->Insert(ns, tokens, pool, block_ids, in.Call(reply));
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  if (in.json) return PrintJson(reply);
  PrintInsert(pool, *r);
  return kExitOk;
}

// --- fetch --------------------------------------------------------------------------------

void DefineFetch(FlagSet& f) {
  DefineNamespace(f);
  DefineTokens(f);
  f.AddString("agent", "", "agent that pulls the pages it lacks into its own pool (required)");
  f.AddString("from", "", "agent to pull from; default: each page's first replica elsewhere");
  f.AddUint("timeout_ms", 60000, "deadline of each BlockAgent.Fetch");
}

namespace {

const ManagerStats::Agent* FindAgent(const ManagerStats& stats, absl::string_view id) {
  for (const ManagerStats::Agent& a : stats.agents) {
    if (a.agent_id == id) return &a;
  }
  return nullptr;
}

}  // namespace

// What a worker does before serving a prompt on --agent: find the pages it lacks where other
// agents hold them (a probe Match with it as requester), and have it pull them
// (BlockAgent.Fetch, one call per source run); the manager indexes the new replica.
int RunFetch(const Invocation& in) {
  absl::StatusOr<PromptFlags> prompt = PromptFlagsFrom(in.flags);
  if (!prompt.ok()) {
    return in.Usage(prompt.status().message());
  }
  const NamespaceId& ns = prompt->ns;
  const std::vector<int32_t>& tokens = prompt->tokens;
  const std::string& dest_id = in.flags.GetString("agent");
  if (dest_id.empty()) {
    return in.Usage("--agent is required");
  }
  std::optional<std::string> from;
  if (!in.flags.GetString("from").empty()) {
    from = in.flags.GetString("from");
    if (*from == dest_id) {
      return in.Usage("--from must name another agent than --agent");
    }
  }
  if (in.flags.GetUint("timeout_ms") == 0) {
    return in.Usage("--timeout_ms: must be > 0");
  }

  absl::StatusOr<ManagerStats> stats = in.client->Stats();
  if (!stats.ok()) {
    return in.Failed(stats.status());
  }
  const ManagerStats::Agent* dest = FindAgent(*stats, dest_id);
  if (dest == nullptr || dest->block_agent_address.empty()) {
    return in.Failed(absl::NotFoundError(absl::StrCat(
        "agent ", dest_id, dest == nullptr ? " is not registered" : " serves no BlockAgent",
        " (see stats)")));
  }
  if (from.has_value() && FindAgent(*stats, *from) == nullptr) {
    return in.Failed(
        absl::NotFoundError(absl::StrCat("agent ", *from, " is not registered (see stats)")));
  }
  const ManagerStats::Namespace* spec = nullptr;
  for (const ManagerStats::Namespace& n : stats->namespaces) {
    if (n.ns == ns) spec = &n;
  }
  if (spec == nullptr) {
    return in.Failed(absl::NotFoundError(
        absl::StrCat("namespace ", ns.ToString(), " is not registered (see register-model)")));
  }
  absl::StatusOr<RegisterModelReply> key = in.client->RegisterModel(ns, spec->spec);
  if (!key.ok()) {
    return in.Failed(key.status());
  }
  absl::StatusOr<MatchReply> match =
      in.client->Match(ns, tokens, {.requester_agent_id = dest_id, .probe = true});
  if (!match.ok()) {
    return in.Failed(match.status());
  }
  absl::StatusOr<FetchPlan> plan = PlanFetch(*match, PoolRef{dest_id, dest->tier}, from);
  if (!plan.ok()) {
    return in.Failed(plan.status());
  }
  absl::StatusOr<std::vector<PageHash>> pages = in.client->HashPrompt(ns, tokens);
  if (!pages.ok()) {
    return in.Failed(pages.status());
  }
  auto stub = v1::BlockAgent::NewStub(in.client->channels().Open(dest->block_agent_address));
  absl::StatusOr<FetchedPages> fetched =
      FetchPlanned(*stub, ns,
                   HashedPrompt{.pages = *std::move(pages),
                                .page_size_tokens = key->spec.page_size_tokens,
                                .key_fingerprint = key->key_fingerprint},
                   *plan, absl::Milliseconds(in.flags.GetUint("timeout_ms")));
  if (!fetched.ok()) {
    return in.Failed(
        WithTlsMismatchHint(fetched.status(), in.client->options().insecure, "the agent"));
  }
  if (in.json) {
    // Several BlockAgent.Fetch calls: their sum, in the text output's field names.
    absl::PrintF(
        "{\"agent\":\"%s\",\"local_pages\":%u,\"fetched_pages\":%u,\"bytes\":\"%d\","
        "\"block_ids\":[%s]}\n",
        dest_id, plan->local_blocks.size(), fetched->fetched_pages, fetched->bytes,
        absl::StrJoin(fetched->block_ids, ","));
    return kExitOk;
  }
  absl::PrintF("agent: %s\n", dest_id);
  absl::PrintF("local_pages: %u\n", plan->local_blocks.size());
  for (const FetchRun& run : plan->runs) {
    absl::PrintF("from %s pages [%u, %u) blocks %s\n", run.source.ToString(), run.first_page,
                 run.first_page + run.source_blocks.size(), absl::StrJoin(run.source_blocks, ","));
  }
  absl::PrintF("fetched_pages: %u\n", fetched->fetched_pages);
  absl::PrintF("bytes: %d (%s)\n", fetched->bytes, HumanBytes(fetched->bytes));
  absl::PrintF("block_ids: %s\n", absl::StrJoin(fetched->block_ids, ","));
  return kExitOk;
}

}  // namespace kvcm::cli
