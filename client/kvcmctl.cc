// kvcmctl: command-line client of the kvcm-manager, for operators and demos.
//
//   kvcmctl [--addr=127.0.0.1:50051] [--deadline_ms=N] [--ca=ca.pem [--cert=c.pem --key=c.key]
//           | --insecure] [--token_file=path] <command> [flags]
//
// Connections are TLS (--ca verifies the manager and the agents, --cert/--key is the client
// certificate mutual TLS requires) unless --insecure; the bearer token comes from
// --token_file, --token (visible in ps) or $KVCM_TOKEN, and goes with every call, the
// agents' included.
// Exit status: 0 on success; 1 when the manager answered an error or could not be reached
// (the message names the gRPC code); 2 for a usage error (unknown command or flag, bad value).
//
// 'models' lists the built-in model catalogue and needs no manager.
//
// A separate process has no namespace hash key, so match and insert send tokens and the
// manager hashes them; the library's local hashing is for long-lived clients. fetch needs
// page hashes (BlockAgent.Fetch takes no tokens): it re-registers the namespace with the
// spec the manager reports, which is idempotent and gives it the key.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/agent_blocks.h"
#include "client/cli_args.h"
#include "client/cli_inputs.h"
#include "client/client.h"
#include "client/fetch_plan.h"
#include "client/kvcmctl_print.h"
#include "common/credentials.h"
#include "common/model_catalog.h"

namespace kvcm {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// One run of one command: its name (for messages), its parsed flags and the client.
struct Invocation {
  absl::string_view command;
  const cli::FlagSet& flags;
  Client* client;  // null for a command that needs no manager

  int Usage(absl::string_view message) const {
    absl::FPrintF(stderr, "kvcmctl %s: %s\nRun 'kvcmctl %s --help' for its flags.\n", command,
                  message, command);
    return kExitUsage;
  }
  int Failed(const absl::Status& status) const {
    absl::FPrintF(stderr, "kvcmctl %s: %s: %s\n", command, absl::StatusCodeToString(status.code()),
                  status.message());
    return kExitFailed;
  }
};

// --tenant/--model and the prompt's tokens: what every command about a prompt takes.
struct PromptFlags {
  NamespaceId ns;
  std::vector<int32_t> tokens;
};

absl::StatusOr<PromptFlags> PromptFlagsFrom(const cli::FlagSet& flags) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(flags);
  if (!ns.ok()) {
    return ns.status();
  }
  absl::StatusOr<std::vector<int32_t>> tokens = cli::TokensFrom(flags);
  if (!tokens.ok()) {
    return tokens.status();
  }
  return PromptFlags{*std::move(ns), *std::move(tokens)};
}

// --- stats --------------------------------------------------------------------------------

void DefineStats(cli::FlagSet&) {}

int RunStats(const Invocation& in) {
  absl::StatusOr<ManagerStats> stats = in.client->Stats();
  if (!stats.ok()) {
    return in.Failed(stats.status());
  }
  cli::PrintStats(in.client->options().address, *stats);
  return kExitOk;
}

// --- register-model -----------------------------------------------------------------------

void DefineRegisterModel(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  cli::DefineModelSpec(f);
  f.AddUint("max_page_age_s", 0,
            "retention: seconds a cached page may stay after it was committed (0: the manager's "
            "default; only shortens an existing namespace's limit)");
}

int RunRegisterModel(const Invocation& in) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
  if (!ns.ok()) {
    return in.Usage(ns.status().message());
  }
  absl::StatusOr<ModelSpec> spec = cli::ModelSpecFrom(in.flags);
  if (!spec.ok()) {
    return in.Usage(spec.status().message());
  }
  const uint64_t max_page_age_s = in.flags.GetUint("max_page_age_s");
  if (max_page_age_s > UINT32_MAX) {
    return in.Usage(absl::StrCat("--max_page_age_s=", max_page_age_s, " does not fit 32 bits"));
  }
  absl::StatusOr<RegisterModelReply> reply = in.client->RegisterModel(
      *ns, *spec, {.max_page_age_s = static_cast<uint32_t>(max_page_age_s)});
  if (!reply.ok()) {
    return in.Failed(reply.status());
  }
  absl::PrintF("namespace: %s (%s)\n", ns->ToString(),
               reply->created ? "created" : "already registered");
  absl::PrintF("spec: %s\n", reply->spec.DebugString());
  absl::PrintF("page_size_tokens: %u\n", reply->spec.page_size_tokens);
  absl::PrintF("bytes_per_token: %d\n", reply->bytes_per_token);
  absl::PrintF("bytes_per_page: %d (%s)\n", reply->bytes_per_page,
               cli::HumanBytes(reply->bytes_per_page));
  absl::PrintF("key_fingerprint: %016x\n", reply->key_fingerprint);
  if (reply->max_page_age_s == 0) {
    absl::PrintF("max_page_age_s: none\n");
  } else {
    absl::PrintF("max_page_age_s: %u\n", reply->max_page_age_s);
  }
  return kExitOk;
}

// --- match --------------------------------------------------------------------------------

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
  absl::PrintF("pin_id: %d\n", m.pin_id);
  if (m.pin_id != 0) {
    absl::PrintF("lease_expiry: %s\n", cli::FormatExpiry(m.lease_expiry));
  }
}

void DefineMatch(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  cli::DefineTokens(f);
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
  absl::StatusOr<MatchReply> m = in.client->Match(ns, tokens, params);
  if (!m.ok()) {
    return in.Failed(m.status());
  }
  absl::PrintF("prompt_tokens: %d\n", tokens.size());
  PrintMatch(*m);
  return kExitOk;
}

// --- route --------------------------------------------------------------------------------

void DefineRoute(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  cli::DefineTokens(f);
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
  absl::StatusOr<RouteReply> r = in.client->Route(ns, tokens, params);
  if (!r.ok()) {
    return in.Failed(r.status());
  }
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

void DefineInsert(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  cli::DefineTokens(f);
  f.AddString("agent", "", "agent that holds the pages (required)");
  f.AddString("tier", "gpu", "tier of the pool: gpu|host|disk");
  f.AddString("block_ids", "", "block id of each whole page, comma separated");
  f.AddUint("first_block", 0,
            "blocks first_block, first_block+1, ... (an index-only pool); without --block_ids "
            "or --first_block the blocks are allocated on the agent");
}

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
  absl::StatusOr<InsertReply> r = in.client->Insert(ns, tokens, pool, blocks->ids(),
                                                    InsertParams{.agent_epoch = blocks->epoch()});
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
  PrintInsert(pool, *r);
  absl::PrintF("agent_epoch: %d\n", blocks->epoch());
  absl::PrintF("block_ids: %s\n", absl::StrJoin(HeldBlocks(*r, blocks->ids()), ","));
  return kExitOk;
}

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
    absl::StatusOr<std::vector<uint32_t>> ids =
        cli::ParseUint32List(in.flags.GetString("block_ids"));
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

  absl::StatusOr<InsertReply> r = in.client->Insert(ns, tokens, pool, block_ids);
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  PrintInsert(pool, *r);
  return kExitOk;
}

// --- fetch --------------------------------------------------------------------------------

void DefineFetch(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  cli::DefineTokens(f);
  f.AddString("agent", "", "agent that pulls the pages it lacks into its own pool (required)");
  f.AddString("from", "", "agent to pull from; default: each page's first replica elsewhere");
  f.AddUint("timeout_ms", 60000, "deadline of each BlockAgent.Fetch");
}

const ManagerStats::Agent* FindAgent(const ManagerStats& stats, absl::string_view id) {
  for (const ManagerStats::Agent& a : stats.agents) {
    if (a.agent_id == id) return &a;
  }
  return nullptr;
}

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
    return in.Failed(fetched.status());
  }
  absl::PrintF("agent: %s\n", dest_id);
  absl::PrintF("local_pages: %u\n", plan->local_blocks.size());
  for (const FetchRun& run : plan->runs) {
    absl::PrintF("from %s pages [%u, %u) blocks %s\n", run.source.ToString(), run.first_page,
                 run.first_page + run.source_blocks.size(), absl::StrJoin(run.source_blocks, ","));
  }
  absl::PrintF("fetched_pages: %u\n", fetched->fetched_pages);
  absl::PrintF("bytes: %d (%s)\n", fetched->bytes, cli::HumanBytes(fetched->bytes));
  absl::PrintF("block_ids: %s\n", absl::StrJoin(fetched->block_ids, ","));
  return kExitOk;
}

// --- release / renew ----------------------------------------------------------------------

void DefineRelease(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  f.AddUint("pin_id", 0, "pin to drop, as printed by 'match --pin' (required)");
}

int RunRelease(const Invocation& in) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
  if (!ns.ok()) {
    return in.Usage(ns.status().message());
  }
  if (!in.flags.IsSet("pin_id")) {
    return in.Usage("--pin_id is required");
  }
  const uint64_t pin_id = in.flags.GetUint("pin_id");
  if (absl::Status s = in.client->Release(*ns, pin_id); !s.ok()) {
    return in.Failed(s);
  }
  absl::PrintF("released pin %d\n", pin_id);
  return kExitOk;
}

void DefineRenew(cli::FlagSet& f) {
  cli::DefineNamespace(f);
  f.AddUint("pin_id", 0, "pin whose lease to extend (required)");
  f.AddUint("lease_ttl_ms", 0, "new lease from now; 0 = the manager's default");
}

int RunRenew(const Invocation& in) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
  if (!ns.ok()) {
    return in.Usage(ns.status().message());
  }
  if (!in.flags.IsSet("pin_id")) {
    return in.Usage("--pin_id is required");
  }
  if (in.flags.GetUint("lease_ttl_ms") > UINT32_MAX) {
    return in.Usage("--lease_ttl_ms: too large");
  }
  absl::StatusOr<absl::Time> expiry = in.client->RenewLease(
      *ns, in.flags.GetUint("pin_id"), static_cast<uint32_t>(in.flags.GetUint("lease_ttl_ms")));
  if (!expiry.ok()) {
    return in.Failed(expiry.status());
  }
  absl::PrintF("lease_expiry: %s\n", cli::FormatExpiry(*expiry));
  return kExitOk;
}

// --- delete-namespace ---------------------------------------------------------------------

void DefineDeleteNamespace(cli::FlagSet& f) { cli::DefineNamespace(f); }

int RunDeleteNamespace(const Invocation& in) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
  if (!ns.ok()) {
    return in.Usage(ns.status().message());
  }
  absl::StatusOr<DeleteNamespaceReply> r = in.client->DeleteNamespace(*ns);
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  absl::PrintF("removed_pages: %d\n", r->removed_pages);
  absl::PrintF("dropped_pins: %d\n", r->dropped_pins);
  return kExitOk;
}

// --- evict --------------------------------------------------------------------------------

void DefineEvict(cli::FlagSet& f) {
  f.AddString("agent", "", "evict from this agent's pool (with --tier), or...");
  f.AddString("tier", "gpu", "tier of the pool: gpu|host|disk");
  cli::DefineNamespace(f);
  f.AddUint("bytes", 0, "bytes to free (required); all or nothing");
}

int RunEvict(const Invocation& in) {
  if (!in.flags.IsSet("bytes")) {
    return in.Usage("--bytes is required");
  }
  const bool by_pool = !in.flags.GetString("agent").empty();
  const bool by_ns = in.flags.IsSet("tenant") || in.flags.IsSet("model");
  if (by_pool == by_ns) {
    return in.Usage("give either --agent [--tier] or --tenant and --model");
  }
  absl::StatusOr<EvictReply> r;
  if (by_pool) {
    absl::StatusOr<Tier> tier = ParseTier(in.flags.GetString("tier"), "--tier");
    if (!tier.ok()) {
      return in.Usage(tier.status().message());
    }
    r = in.client->EvictFromPool(PoolRef{in.flags.GetString("agent"), *tier},
                                 in.flags.GetUint("bytes"));
  } else {
    absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
    if (!ns.ok()) {
      return in.Usage(ns.status().message());
    }
    r = in.client->EvictFromNamespace(*ns, in.flags.GetUint("bytes"));
  }
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  absl::PrintF("evicted_bytes: %d\n", r->evicted_bytes);
  absl::PrintF("evicted_pages: %d\n", r->evicted_pages);
  return kExitOk;
}

// --- watch --------------------------------------------------------------------------------

void DefineWatch(cli::FlagSet& f) {
  f.AddString("tenant", "", "only this namespace's events (with --model); default all");
  f.AddString("model", "", "see --tenant");
  f.AddUint("count", 0, "exit after this many events; 0 = no limit");
  f.AddUint("duration_ms", 0, "exit after this long; 0 = no limit");
}

int RunWatch(const Invocation& in) {
  std::optional<NamespaceId> filter;
  if (in.flags.IsSet("tenant") || in.flags.IsSet("model")) {
    absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
    if (!ns.ok()) {
      return in.Usage(ns.status().message());
    }
    filter = *std::move(ns);
  }
  const uint64_t count = in.flags.GetUint("count");
  const uint64_t duration_ms = in.flags.GetUint("duration_ms");
  absl::Mutex mu;
  uint64_t seen = 0;
  absl::Notification enough;
  std::unique_ptr<EventWatch> watch = in.client->WatchEvents(filter, [&](const WatchedEvent& e) {
    cli::PrintEvent(e);
    std::fflush(stdout);
    absl::MutexLock lock(&mu);
    if (++seen == count) {
      enough.Notify();
    }
  });
  // Stop on --count, --duration_ms, or when the stream ends by itself.
  std::thread waiter([&] {
    (void)watch->Wait();
    if (!enough.HasBeenNotified()) {
      enough.Notify();
    }
  });
  if (duration_ms > 0) {
    enough.WaitForNotificationWithTimeout(absl::Milliseconds(duration_ms));
  } else {
    enough.WaitForNotification();
  }
  watch->Cancel();
  waiter.join();
  const absl::Status status = watch->Wait();
  if (!status.ok() && status.code() != absl::StatusCode::kCancelled) {
    return in.Failed(status);
  }
  return kExitOk;
}

// --- models -------------------------------------------------------------------------------

void DefineModels(cli::FlagSet& f) {
  f.AddString("dtype", "bf16", "KV element type: bf16|fp16|fp8|int8, or all for a row of each");
  f.AddUint("page_size", kDefaultPageSizeTokens, "tokens per page, for BYTES/PAGE");
}

// Prints the catalogue with what each model's KV costs. Needs no manager.
int RunModels(const Invocation& in) {
  std::vector<KvDtype> dtypes;
  const std::string& dtype_flag = in.flags.GetString("dtype");
  if (dtype_flag == "all") {
    dtypes = {KvDtype::kBf16, KvDtype::kFp16, KvDtype::kFp8, KvDtype::kInt8};
  } else {
    absl::StatusOr<KvDtype> dtype = ParseDtype(dtype_flag, "--dtype");
    if (!dtype.ok()) {
      return in.Usage(
          absl::StrCat("--dtype: expected bf16|fp16|fp8|int8|all, got '", dtype_flag, "'"));
    }
    dtypes = {*dtype};
  }
  // The page size's range is ModelSpec's: check it on any catalogue spec.
  const uint64_t page_size = in.flags.GetUint("page_size");
  ModelSpec probe = Catalog().front().spec;
  probe.page_size_tokens = static_cast<uint32_t>(std::min<uint64_t>(page_size, UINT32_MAX));
  if (page_size > UINT32_MAX) {
    return in.Usage("--page_size: too large");
  }
  if (absl::Status s = probe.Validate(); !s.ok()) {
    return in.Usage(absl::StrCat("--page_size: ", s.message()));
  }

  if (absl::Status s = cli::PrintModels(dtypes, probe.page_size_tokens); !s.ok()) {
    return in.Failed(s);
  }
  return kExitOk;
}

// --- dispatch -----------------------------------------------------------------------------

struct Command {
  absl::string_view name;
  absl::string_view summary;
  void (*define)(cli::FlagSet&);
  int (*run)(const Invocation&);
  bool needs_manager = true;
};

constexpr Command kCommands[] = {
    {"stats", "pools, namespaces and counters of the manager", DefineStats, RunStats},
    {"register-model", "create or confirm a (tenant, model) namespace; prints bytes per token",
     DefineRegisterModel, RunRegisterModel},
    {"match", "longest cached prefix of a prompt, optionally pinned", DefineMatch, RunMatch},
    {"route", "rank agents by the prefill each would save on a prompt", DefineRoute, RunRoute},
    {"insert", "record that an agent's pool holds a prompt's pages", DefineInsert, RunInsert},
    {"fetch", "pull a prompt's cached pages into an agent from the agents that hold them",
     DefineFetch, RunFetch},
    {"release", "drop a pin taken by 'match --pin'", DefineRelease, RunRelease},
    {"renew", "extend a pin's lease", DefineRenew, RunRenew},
    {"evict", "evict bytes from one pool or one namespace (operator)", DefineEvict, RunEvict},
    {"delete-namespace", "remove a namespace with its pages and pins (operator)",
     DefineDeleteNamespace, RunDeleteNamespace},
    {"watch", "print index change events as they happen", DefineWatch, RunWatch},
    {"models", "known models and the bytes their KV cache costs (offline)", DefineModels, RunModels,
     /*needs_manager=*/false},
};

void DefineGlobal(cli::FlagSet& f) {
  f.AddString("addr", "127.0.0.1:50051", "kvcm-manager address");
  f.AddInt("deadline_ms", 5000, "deadline of each call, retries included");
  f.AddInt("max_attempts", 5, "attempts per call while the manager is unavailable");
  cli::DefineSecurity(f);
  f.AddBool("help", "show this help");
}

void PrintMainHelp(const cli::FlagSet& global) {
  absl::PrintF("Usage: kvcmctl [global flags] <command> [flags]\n\nCommands:\n");
  for (const Command& c : kCommands) {
    absl::PrintF("  %-16s %s\n", c.name, c.summary);
  }
  absl::PrintF("\nGlobal flags:\n%s", global.Help());
  absl::PrintF(
      "\nExamples:\n"
      "  kvcmctl register-model --tenant=acme --model=deepseek-v3 --attention=mla --layers=61 \\\n"
      "      --heads=128 --kv_lora_rank=512 --rope_dim=64 --dtype=bf16 --page_size=64\n"
      "  kvcmctl register-model --tenant=acme --model=llama3 --preset=llama-3-70b --dtype=fp8\n"
      "  kvcmctl models --dtype=all\n"
      "  kvcmctl insert --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--agent=gpu-0\n"
      "  kvcmctl match --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 --pin"
      "   # pin_id: N\n"
      "  kvcmctl route --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--candidates=gpu-0,gpu-1\n"
      "  kvcmctl fetch --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--agent=gpu-1\n"
      "  kvcmctl release --tenant=acme --model=deepseek-v3 --pin_id=N   # N: what match --pin "
      "printed\n"
      "  kvcmctl --addr=kvcm:50051 --ca=ca.pem --cert=me.pem --key=me.key stats\n"
      "  kvcmctl --insecure stats          # a manager started with --insecure\n"
      "\nRun 'kvcmctl <command> --help' for a command's flags.\n");
}

int Main(int argc, char** argv) {
  std::vector<absl::string_view> args(argv + 1, argv + argc);
  cli::FlagSet global;
  DefineGlobal(global);
  absl::StatusOr<size_t> consumed = global.ParsePrefix(args);
  if (!consumed.ok()) {
    absl::FPrintF(stderr, "kvcmctl: %s\nRun 'kvcmctl --help' for usage.\n",
                  consumed.status().message());
    return kExitUsage;
  }
  if (global.GetBool("help")) {
    PrintMainHelp(global);
    return kExitOk;
  }
  if (*consumed == args.size()) {
    absl::FPrintF(stderr, "kvcmctl: no command given\nRun 'kvcmctl --help' for usage.\n");
    return kExitUsage;
  }
  const absl::string_view name = args[*consumed];
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (c.name == name) {
      command = &c;
    }
  }
  if (command == nullptr) {
    absl::FPrintF(stderr, "kvcmctl: unknown command '%s'\nRun 'kvcmctl --help' for usage.\n", name);
    return kExitUsage;
  }

  cli::FlagSet flags;
  command->define(flags);
  flags.AddBool("help", "show this help");
  const std::span<const absl::string_view> rest(args.data() + *consumed + 1,
                                                args.size() - *consumed - 1);
  if (absl::Status s = flags.ParseAll(rest); !s.ok()) {
    absl::FPrintF(stderr, "kvcmctl %s: %s\nRun 'kvcmctl %s --help' for its flags.\n", name,
                  s.message(), name);
    return kExitUsage;
  }
  if (flags.GetBool("help")) {
    absl::PrintF("Usage: kvcmctl [global flags] %s [flags]\n%s\n\nFlags:\n%s", name,
                 command->summary, flags.Help());
    return kExitOk;
  }

  if (!command->needs_manager) {
    return command->run(Invocation{name, flags, nullptr});
  }
  absl::StatusOr<cli::Security> security = cli::SecurityFrom(global, std::getenv("KVCM_TOKEN"));
  if (!security.ok()) {
    absl::FPrintF(stderr, "kvcmctl: %s\nRun 'kvcmctl --help' for usage.\n",
                  security.status().message());
    return kExitUsage;
  }
  ClientOptions options;
  options.address = global.GetString("addr");
  options.insecure = security->tls.insecure;
  options.ca_file = security->tls.ca_file;
  options.cert_file = security->tls.cert_file;
  options.key_file = security->tls.key_file;
  options.token = std::move(security->token);
  options.default_deadline_ms = global.GetInt("deadline_ms");
  // Out-of-range values are clamped just outside 1..100 so that Validate reports them.
  options.max_attempts =
      static_cast<int>(std::clamp<int64_t>(global.GetInt("max_attempts"), 0, 101));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) {
    absl::FPrintF(stderr, "kvcmctl: %s\n", client.status().message());
    return kExitUsage;
  }
  return command->run(Invocation{name, flags, client->get()});
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
