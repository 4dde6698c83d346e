// kvcmctl: command-line client of the kvcm-manager, for operators and demos.
//
//   kvcmctl [--manager_address=127.0.0.1:50051] [--deadline_ms=N] [--json]
//           [--tls_ca_file=ca.pem [--tls_cert_file=c.pem --tls_key_file=c.key] | --insecure]
//           [--token_file=path] <command> [flags]
//
// The manager address defaults to $KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051. Connections
// are TLS (--tls_ca_file verifies the manager and the agents, --tls_cert_file/--tls_key_file
// is the client certificate mutual TLS requires) unless --insecure; the bearer token comes
// from --token_file, --token (visible in ps) or $KVCM_TOKEN, and goes with every call, the
// agents' included. --json prints each result as one JSON object (one per line for watch).
// Exit status: 0 on success; 1 when the manager answered an error or could not be reached
// (the message names the gRPC code); 2 for a usage error (unknown command or flag, bad value).
//
// 'models' lists the built-in model catalogue and needs no manager.
//
// This file: the namespace and operator commands, and the dispatch. The commands about a
// prompt are in kvcmctl_prompt.cc, those about agents and pools in kvcmctl_agent.cc.
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/cli_args.h"
#include "client/cli_inputs.h"
#include "client/client.h"
#include "client/kvcmctl_agent.h"
#include "client/kvcmctl_command.h"
#include "client/kvcmctl_print.h"
#include "client/kvcmctl_prompt.h"
#include "common/build_info.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/page_hash.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

using cli::Invocation;
using cli::kExitFailed;
using cli::kExitOk;
using cli::kExitUsage;
using cli::PrintJson;

constexpr int kDefaultManagerPort = 50051;

// --- stats --------------------------------------------------------------------------------

void DefineStats(cli::FlagSet&) {}

int RunStats(const Invocation& in) {
  v1::StatsResponse reply;
  absl::StatusOr<ManagerStats> stats = in.client->Stats(in.Call(reply));
  if (!stats.ok()) {
    return in.Failed(stats.status());
  }
  if (in.json) return PrintJson(reply);
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
  v1::RegisterModelResponse response;
  absl::StatusOr<RegisterModelReply> reply = in.client->RegisterModel(
      *ns, *spec, {.max_page_age_s = static_cast<uint32_t>(max_page_age_s)}, in.Call(response));
  if (!reply.ok()) {
    return in.Failed(reply.status());
  }
  if (in.json) {
    response.clear_hash_key();  // the namespace's secret: never printed
    return PrintJson(response);
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
  v1::ReleaseResponse reply;
  if (absl::Status s = in.client->Release(*ns, pin_id, in.Call(reply)); !s.ok()) {
    return in.Failed(s);
  }
  if (in.json) return PrintJson(reply);
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
  v1::RenewLeaseResponse reply;
  absl::StatusOr<absl::Time> expiry = in.client->RenewLease(
      *ns, in.flags.GetUint("pin_id"), static_cast<uint32_t>(in.flags.GetUint("lease_ttl_ms")),
      in.Call(reply));
  if (!expiry.ok()) {
    return in.Failed(expiry.status());
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("lease_expiry: %s\n", cli::FormatExpiry(*expiry));
  return kExitOk;
}

// --- forget-agent -------------------------------------------------------------------------

void DefineForgetAgent(cli::FlagSet& f) {
  f.AddString("agent_id", "", "the agent to forget (required)");
  f.AddBool("force", "forget it even when it is alive (it registers again)");
}

int RunForgetAgent(const Invocation& in) {
  const std::string& id = in.flags.GetString("agent_id");
  if (id.empty()) return in.Usage("--agent_id is required");
  v1::ForgetAgentResponse reply;
  absl::StatusOr<ForgetAgentReply> r =
      in.client->ForgetAgent(id, {.force = in.flags.GetBool("force")}, in.Call(reply));
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("epoch: %d\n", r->epoch);
  absl::PrintF("was_alive: %s\n", r->was_alive ? "true" : "false");
  absl::PrintF("dropped_pages: %d\n", r->dropped_pages);
  return kExitOk;
}

// --- delete-namespace ---------------------------------------------------------------------

void DefineDeleteNamespace(cli::FlagSet& f) { cli::DefineNamespace(f); }

int RunDeleteNamespace(const Invocation& in) {
  absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
  if (!ns.ok()) {
    return in.Usage(ns.status().message());
  }
  v1::DeleteNamespaceResponse reply;
  absl::StatusOr<DeleteNamespaceReply> r = in.client->DeleteNamespace(*ns, in.Call(reply));
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  if (in.json) return PrintJson(reply);
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
  v1::EvictResponse reply;
  absl::StatusOr<EvictReply> r;
  if (by_pool) {
    absl::StatusOr<Tier> tier = ParseTier(in.flags.GetString("tier"), "--tier");
    if (!tier.ok()) {
      return in.Usage(tier.status().message());
    }
    r = in.client->EvictFromPool(PoolRef{in.flags.GetString("agent"), *tier},
                                 in.flags.GetUint("bytes"), in.Call(reply));
  } else {
    absl::StatusOr<NamespaceId> ns = cli::NamespaceFrom(in.flags);
    if (!ns.ok()) {
      return in.Usage(ns.status().message());
    }
    r = in.client->EvictFromNamespace(*ns, in.flags.GetUint("bytes"), in.Call(reply));
  }
  if (!r.ok()) {
    return in.Failed(r.status());
  }
  if (in.json) return PrintJson(reply);
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

// The event as the manager sent it (kvcm.v1.CacheEvent), for --json. WatchedEvent's enums
// number their values as kvcm.v1's do:
static_assert(static_cast<int>(WatchedEvent::Kind::kCleared) == v1::CacheEvent::KIND_CLEARED &&
              static_cast<int>(WatchedEvent::Kind::kRemoved) == v1::CacheEvent::KIND_REMOVED &&
              static_cast<int>(WatchedEvent::Kind::kStored) == v1::CacheEvent::KIND_STORED);
static_assert(static_cast<int>(WatchedEvent::Reason::kEvicted) == v1::CacheEvent::REASON_EVICTED &&
              static_cast<int>(WatchedEvent::Reason::kExpired) == v1::CacheEvent::REASON_EXPIRED);
v1::CacheEvent EventToProto(const WatchedEvent& e) {
  v1::CacheEvent out;
  out.set_kind(static_cast<v1::CacheEvent::Kind>(e.kind));
  out.set_reason(static_cast<v1::CacheEvent::Reason>(e.reason));
  NamespaceToProto(e.ns, out.mutable_namespace_());
  PoolToProto(e.pool, out.mutable_pool());
  out.set_page_hashes(EncodePageHashes(e.pages));
  out.set_sequence(e.sequence);
  return out;
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
    if (in.json) {
      PrintJson(EventToProto(e));
    } else {
      cli::PrintEvent(e);
    }
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
  f.AddString("kv_dtype", "bf16", "KV element type: bf16|fp16|fp8|int8, or all for a row of each");
  f.AddUint("page_size_tokens", kDefaultPageSizeTokens, "tokens per page, for BYTES/PAGE");
  f.AddDeprecatedAlias("dtype", "kv_dtype");
  f.AddDeprecatedAlias("page_size", "page_size_tokens");
}

// Prints the catalogue with what each model's KV costs. Needs no manager.
int RunModels(const Invocation& in) {
  std::vector<KvDtype> dtypes;
  const std::string& dtype_flag = in.flags.GetString("kv_dtype");
  if (dtype_flag == "all") {
    dtypes = {KvDtype::kBf16, KvDtype::kFp16, KvDtype::kFp8, KvDtype::kInt8};
  } else {
    absl::StatusOr<KvDtype> dtype = ParseDtype(dtype_flag, "--kv_dtype");
    if (!dtype.ok()) {
      return in.Usage(
          absl::StrCat("--kv_dtype: expected bf16|fp16|fp8|int8|all, got '", dtype_flag, "'"));
    }
    dtypes = {*dtype};
  }
  // The page size's range is ModelSpec's: check it on any catalogue spec.
  const uint64_t page_size = in.flags.GetUint("page_size_tokens");
  ModelSpec probe = Catalog().front().spec;
  probe.page_size_tokens = static_cast<uint32_t>(std::min<uint64_t>(page_size, UINT32_MAX));
  if (page_size > UINT32_MAX) {
    return in.Usage("--page_size_tokens: too large");
  }
  if (absl::Status s = probe.Validate(); !s.ok()) {
    return in.Usage(absl::StrCat("--page_size_tokens: ", s.message()));
  }
  if (absl::Status s = in.json ? cli::PrintModelsJson(dtypes, probe.page_size_tokens)
                               : cli::PrintModels(dtypes, probe.page_size_tokens);
      !s.ok()) {
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
    {"match", "longest cached prefix of a prompt, optionally pinned", cli::DefineMatch,
     cli::RunMatch},
    {"route", "rank agents by the prefill each would save on a prompt", cli::DefineRoute,
     cli::RunRoute},
    {"insert", "record that an agent's pool holds a prompt's pages", cli::DefineInsert,
     cli::RunInsert},
    {"fetch", "pull a prompt's cached pages into an agent from the agents that hold them",
     cli::DefineFetch, cli::RunFetch},
    {"release", "drop a pin taken by 'match --pin'", DefineRelease, RunRelease},
    {"renew", "extend a pin's lease", DefineRenew, RunRenew},
    {"evict", "evict bytes from one pool or one namespace (operator)", DefineEvict, RunEvict},
    {"reserve", "hold free headroom in a pool for admitted work, evicting the shortfall",
     cli::DefineReserve, cli::RunReserve},
    {"unreserve", "give back headroom taken by 'reserve'", cli::DefineUnreserve, cli::RunUnreserve},
    {"delete-namespace", "remove a namespace with its pages and pins (operator)",
     DefineDeleteNamespace, RunDeleteNamespace},
    {"forget-agent", "forget a gone agent now, not after gone_agent_memory_s (operator)",
     DefineForgetAgent, RunForgetAgent},
    {"watch", "print index change events as they happen", DefineWatch, RunWatch},
    {"agent-stats", "an agent's own pool, epoch and limits (BlockAgent.Stats)",
     cli::DefineAgentStats, cli::RunAgentStats},
    {"lookup-agent", "where a live agent serves its blocks (AgentControl.LookupAgent)",
     cli::DefineLookupAgent, cli::RunLookupAgent},
    {"models", "known models and the bytes their KV cache costs (offline)", DefineModels, RunModels,
     /*needs_manager=*/false},
};

void DefineGlobal(cli::FlagSet& f) {
  f.AddString("manager_address", "",
              "kvcm-manager host:port (default: $KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051)");
  f.AddDeprecatedAlias("addr", "manager_address");
  f.AddInt("deadline_ms", 5000, "deadline of each call, retries included");
  f.AddInt("max_attempts", 5, "attempts per call while the manager is unavailable");
  cli::DefineSecurity(f);
  f.AddBool("json", "print each result as one JSON object (one per line for watch)");
  f.AddBool("version", "print the version and exit");
  f.AddBool("help", "show this help");
}

void PrintMainHelp(const cli::FlagSet& global) {
  absl::PrintF("Usage: kvcmctl [global flags] <command> [flags]\n\nCommands:\n");
  for (const Command& c : kCommands) {
    absl::PrintF("  %-16s %s\n", c.name, c.summary);
  }
  absl::PrintF("\nGlobal flags:\n%s", global.Help());
  absl::PrintF(
      "\nNot commands: the agents' own RPCs (Register, Heartbeat, ReportInventory, Commands,\n"
      "NcclBootstrap; BlockAgent Allocate, Free, WriteBlocks, ReadBlocks, RunAttention) and\n"
      "PublishEngineEvents, whose sessions and sequences only a long-lived bridge keeps\n"
      "(kvcm-bridge); one-shot events from a shell would empty the engine's pools.\n");
  absl::PrintF(
      "\nExamples:\n"
      "  kvcmctl register-model --tenant=acme --model=deepseek-v3 --attention=mla \\\n"
      "      --num_layers=61 --num_heads=128 --kv_lora_rank=512 --rope_dim=64 --kv_dtype=bf16 \\\n"
      "      --page_size_tokens=64\n"
      "  kvcmctl register-model --tenant=acme --model=llama3 --preset=llama-3-70b "
      "--kv_dtype=fp8\n"
      "  kvcmctl models --kv_dtype=all\n"
      "  kvcmctl insert --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--agent=gpu-0\n"
      "  kvcmctl match --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 --pin"
      "   # pin_id: N\n"
      "  kvcmctl route --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--candidates=gpu-0,gpu-1\n"
      "  kvcmctl fetch --tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7 "
      "--agent=gpu-1\n"
      "  pin=$(kvcmctl --json match --tenant=acme --model=deepseek-v3 --random_tokens=300 "
      "--seed=7 --pin \\\n"
      "      | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"pin_id\"])')\n"
      "  kvcmctl release --tenant=acme --model=deepseek-v3 --pin_id=$pin\n"
      "  kvcmctl reserve --agent=gpu-0 --bytes=1073741824\n"
      "  kvcmctl agent-stats --agent_id=gpu-0\n"
      "  kvcmctl --manager_address=kvcm:50051 --tls_ca_file=ca.pem --tls_cert_file=me.pem \\\n"
      "      --tls_key_file=me.key stats\n"
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
  // Each deprecated name once, however often it was given; warnings go before any result.
  auto warn = [](const cli::FlagSet& f) {
    for (const std::string& w : f.DeprecationWarnings()) {
      absl::FPrintF(stderr, "kvcmctl: %s\n", w);
    }
  };
  warn(global);
  if (global.GetBool("help")) {
    PrintMainHelp(global);
    return kExitOk;
  }
  if (global.GetBool("version")) {
    absl::PrintF("%s\n", VersionLine("kvcmctl"));
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
  flags.AddBool("json", "print the result as JSON (as the global --json)");
  flags.AddBool("help", "show this help");
  const std::span<const absl::string_view> rest(args.data() + *consumed + 1,
                                                args.size() - *consumed - 1);
  if (absl::Status s = flags.ParseAll(rest); !s.ok()) {
    absl::FPrintF(stderr, "kvcmctl %s: %s\nRun 'kvcmctl %s --help' for its flags.\n", name,
                  s.message(), name);
    return kExitUsage;
  }
  warn(flags);
  if (flags.GetBool("help")) {
    absl::PrintF("Usage: kvcmctl [global flags] %s [flags]\n%s\n\nFlags:\n%s", name,
                 command->summary, flags.Help());
    return kExitOk;
  }

  const bool json = global.GetBool("json") || flags.GetBool("json");
  if (!command->needs_manager) {
    return command->run(Invocation{name, flags, nullptr, json});
  }
  // The flag, else $KVCM_MANAGER_ADDRESS, else the local default.
  std::string address = global.GetString("manager_address");
  absl::string_view address_source = "manager_address";
  if (!global.IsSet("manager_address")) {
    const char* env = std::getenv("KVCM_MANAGER_ADDRESS");
    if (env != nullptr && env[0] != '\0') {
      address = env;
      address_source = "KVCM_MANAGER_ADDRESS";
    } else {
      address = absl::StrCat("127.0.0.1:", kDefaultManagerPort);
    }
  }
  if (absl::Status s =
          cli::CheckHostPort(address_source, address, "the manager", kDefaultManagerPort);
      !s.ok()) {
    std::string message(s.message());
    if (address_source == "KVCM_MANAGER_ADDRESS") {
      message = message.substr(2);  // an environment variable, not a flag: no "--"
    }
    absl::FPrintF(stderr, "kvcmctl: %s\nRun 'kvcmctl --help' for usage.\n", message);
    return kExitUsage;
  }
  absl::StatusOr<cli::Security> security = cli::SecurityFrom(global, std::getenv("KVCM_TOKEN"));
  if (!security.ok()) {
    absl::FPrintF(stderr, "kvcmctl: %s\nRun 'kvcmctl --help' for usage.\n",
                  security.status().message());
    return kExitUsage;
  }
  if (global.IsSet("token")) {
    absl::FPrintF(stderr,
                  "kvcmctl: --token is visible to every user in ps; prefer --token_file or "
                  "$KVCM_TOKEN\n");
  }
  ClientOptions options;
  options.address = address;
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
  return command->run(Invocation{name, flags, client->get(), json});
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
