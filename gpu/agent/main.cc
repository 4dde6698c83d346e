// kvcm-agent: one per GPU. Owns the GPU's KV block pool (host DRAM when there is no GPU),
// registers it with kvcm-manager, heartbeats its usage and serves BlockAgent.
//
//   kvcm-agent --agent_id=gpu0 --manager_address=127.0.0.1:50051 [--model=deepseek-v3 ...]
//
// Every kvcm::AgentOptions field is a flag (but the token: --token_file, or $KVCM_TOKEN);
// --model= (empty) takes the geometry from the explicit --attention/--num_layers/... flags
// instead of the catalogue. Transport security is required: --tls_cert_file, --tls_key_file
// and --tls_ca_file (mutual TLS), or --insecure for plaintext in development. SIGINT / SIGTERM
// shut the agent down cleanly (exit status 0).
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/enum_names.h"
#include "common/log.h"
#include "common/program_flags.h"
#include "common/server_flags.h"
#include "common/transports.h"
#include "gpu/agent/server/agent.h"

namespace {
const kvcm::AgentOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, agent_id, kDefaults.agent_id, "Id of this agent (its pool's agent_id).");
ABSL_FLAG(std::string, manager_address, kDefaults.manager_address,
          "kvcm-manager gRPC address host:port.");
ABSL_FLAG(std::string, listen_address, kDefaults.listen_address,
          "BlockAgent gRPC address host:port (port 0 picks a free one).");
ABSL_FLAG(std::string, data_listen_address, kDefaults.data_listen_address,
          "where peers pull this agent's blocks (TCP), a.b.c.d:port; port 0 picks one");
ABSL_FLAG(uint32_t, transfer_io_timeout_ms, kDefaults.transfer_io_timeout_ms,
          "a peer silent this long fails a transfer");
ABSL_FLAG(std::string, transport, kDefaults.transport,
          absl::StrCat("How block bytes move between agents: ", kvcm::TransportHelp(), "."));
ABSL_FLAG(uint64_t, nccl_staging_bytes, kDefaults.nccl_staging_bytes,
          "NCCL: bytes of each link's device staging buffer (the largest chunk of a pull).");
ABSL_FLAG(uint32_t, nccl_max_links, kDefaults.nccl_max_links,
          "NCCL: most links held at once, of each kind (pulling, served).");
ABSL_FLAG(uint32_t, nccl_connect_timeout_ms, kDefaults.nccl_connect_timeout_ms,
          "NCCL: how long making a link (relay, ncclCommInitRank, warm-up) may take.");
ABSL_FLAG(int, device_index, kDefaults.device_index, "CUDA device of the pool.");
ABSL_FLAG(bool, use_device, kDefaults.use_device,
          "Use the GPU when present; false forces host DRAM.");
ABSL_FLAG(std::string, tier, "gpu",
          "Tier the pool is registered as: gpu, host or disk. The pool's role, not its memory: "
          "gpu (the engines' pool, demoting into the host pool) also for a pool in host memory.");
ABSL_FLAG(std::string, model, kDefaults.model,
          "Model preset from the catalogue (e.g. deepseek-v3, llama-3-70b); empty uses the "
          "explicit geometry flags (--num_layers ...), which a preset refuses.");
ABSL_FLAG(std::string, kv_dtype, "bf16", "KV element type: bf16, fp16, fp8 or int8.");
ABSL_FLAG(uint32_t, page_size_tokens, kDefaults.page_size_tokens, "Tokens per page (block).");
ABSL_FLAG(std::string, attention, "mla", "Explicit geometry: mha, mqa, gqa or mla.");
ABSL_FLAG(uint32_t, num_layers, 0, "Explicit geometry: layers.");
ABSL_FLAG(uint32_t, num_heads, 0, "Explicit geometry: query heads.");
ABSL_FLAG(uint32_t, num_kv_heads, 0, "Explicit geometry: K/V heads.");
ABSL_FLAG(uint32_t, head_dim, 0, "Explicit geometry: elements per K/V head.");
ABSL_FLAG(uint32_t, kv_lora_rank, 0, "Explicit geometry (MLA): latent width.");
ABSL_FLAG(uint32_t, rope_dim, 0, "Explicit geometry (MLA): RoPE key width.");
ABSL_FLAG(uint64_t, capacity_bytes, kDefaults.capacity_bytes,
          "Bytes of the block pool (rounded down to whole blocks).");
ABSL_FLAG(uint64_t, host_capacity_bytes, kDefaults.host_capacity_bytes,
          "Bytes of a host-DRAM pool the manager demotes GPU pages into (0: none; tier gpu "
          "only).");
ABSL_FLAG(uint32_t, heartbeat_interval_ms, kDefaults.heartbeat_interval_ms,
          "Period of heartbeats to the manager, in milliseconds.");
ABSL_FLAG(uint32_t, allocate_wait_ms, kDefaults.allocate_wait_ms,
          "How long an allocation for the cache may wait while the manager evicts to make room "
          "in a full pool, ms (0: answer RESOURCE_EXHAUSTED at once).");
ABSL_FLAG(uint32_t, allocation_ttl_ms, kDefaults.allocation_ttl_ms,
          "Cache blocks allocated but neither committed nor freed within this are freed "
          "(a worker died mid-store), ms; 0: never.");
ABSL_FLAG(bool, verify_block_digests, kDefaults.verify_block_digests,
          "Digest every block's bytes at its commit and check the digest at every read "
          "(ReadBlocks, local LOAD, a peer's pull): a block whose bytes changed since is not "
          "served (DATA_LOSS). Costs one hash of the block per commit and per read.");
ABSL_FLAG(std::string, metrics_address, kDefaults.metrics_address,
          "Prometheus /metrics address host:port; empty disables it.");
ABSL_FLAG(uint32_t, max_blocks_per_call, kDefaults.max_blocks_per_call,
          "Most blocks one WriteBlocks / ReadBlocks call may name.");
ABSL_FLAG(uint64_t, max_message_bytes, kDefaults.max_message_bytes,
          "Largest BlockAgent request message, in bytes.");
ABSL_FLAG(uint64_t, read_chunk_bytes, kDefaults.read_chunk_bytes,
          "Bytes per ReadBlocks response message.");
ABSL_FLAG(uint32_t, max_streams_per_principal, kDefaults.max_streams_per_principal,
          "Most WriteBlocks + ReadBlocks streams one principal may have open at once.");
ABSL_FLAG(std::string, token_file, kDefaults.token_file,
          "File holding this agent's bearer token for the manager; default: $KVCM_TOKEN (or the "
          "deprecated $KVCM_AGENT_TOKEN) "
          "(no token flag: a command line is visible in ps).");
ABSL_FLAG(std::string, advertise_host, kDefaults.advertise_host,
          "Host registered for the BlockAgent and data addresses (what peers dial and verify "
          "the certificate against, e.g. <pod>.kvcm-agent.kvcm.svc); default: each listen "
          "address's host.");
ABSL_FLAG(std::string, agent_identity_dns_suffix, kDefaults.agent_identity_dns_suffix,
          "Peer agents identified by their client certificate on the BlockAgent port: a caller "
          "sending no token whose certificate names N + this suffix is agent N and N-gpu<K> "
          "(docs/SECURITY.md, Agent identity). Needs --tokens_file and mutual TLS.");
ABSL_FLAG(std::string, tokens_file, kDefaults.tokens_file,
          "Tokens file (SHA-256 hashes and grants) of the callers BlockAgent accepts; re-read "
          "when it changes. Empty: every caller may do everything (dev mode only).");
ABSL_FLAG(uint32_t, data_max_connections, kDefaults.data_max_connections,
          "Connections the data port serves at once, counted once their handshake completed; "
          "one more is then closed.");
ABSL_FLAG(uint32_t, data_max_connections_per_peer, kDefaults.data_max_connections_per_peer,
          "Connections the data port serves at once from one IP address.");
ABSL_FLAG(uint32_t, data_max_handshakes, kDefaults.data_max_handshakes,
          "Data connections still in their handshake (TLS; plaintext: the request) at once, "
          "apart from the served ones; when full, a connection from a lighter address takes "
          "the place of the oldest one of the address holding the most.");
ABSL_FLAG(uint32_t, data_max_handshakes_per_peer, kDefaults.data_max_handshakes_per_peer,
          "Data connections in their handshake at once from one IP address; one more is "
          "closed as it is accepted.");
ABSL_FLAG(uint32_t, data_handshake_timeout_ms, kDefaults.data_handshake_timeout_ms,
          "A data connection whose handshake has not completed within this is closed (ms).");
ABSL_FLAG(std::string, local_socket, kDefaults.local_socket,
          "Unix socket (SOCK_SEQPACKET, mode 0600; 0660 with --local_socket_group) of the local "
          "data path, where engines on this host register their KV memory and the agent copies "
          "blocks into and out of it; empty: off.");
ABSL_FLAG(uint32_t, local_max_sessions, kDefaults.local_max_sessions,
          "Sessions the local socket serves at once; one more connection is closed.");
ABSL_FLAG(std::vector<std::string>, local_allowed_uids, {},
          "Peer uids (SO_PEERCRED) admitted on the local socket, comma-separated; with "
          "--local_allowed_gids empty too: the agent's own uid only.");
ABSL_FLAG(std::vector<std::string>, local_allowed_gids, {},
          "Peer primary gids (SO_PEERCRED) admitted on the local socket, comma-separated.");
ABSL_FLAG(std::string, local_socket_group, kDefaults.local_socket_group,
          "Group (name or number) of the local socket file, which is then mode 0660; empty: "
          "mode 0600.");
ABSL_FLAG(uint32_t, local_max_sessions_per_uid, kDefaults.local_max_sessions_per_uid,
          "Connections one peer uid may hold on the local socket at once.");
ABSL_FLAG(uint32_t, local_hello_timeout_ms, kDefaults.local_hello_timeout_ms,
          "A local connection whose hello has not registered a region within this is closed (ms).");
ABSL_FLAG(std::string, local_principal_uids, kDefaults.local_principal_uids,
          "Tokens bound to peer uids on the local socket: principal=uid[:uid...],... (a listed "
          "principal's token is refused from other uids).");
ABSL_FLAG(uint64_t, local_copy_chunk_bytes, kDefaults.local_copy_chunk_bytes,
          "Most bytes a local LOAD or STORE copies per hold of the pool's lock.");
ABSL_FLAG(uint32_t, data_request_timeout_ms, kDefaults.data_request_timeout_ms,
          "A data connection must finish its TLS handshake and send its request within this (ms).");

namespace {

[[noreturn]] void Fail(absl::string_view message) {
  kvcm::LogError(message);
  std::exit(1);
}

// The enum flag's value, or exits naming the flag.
template <typename E>
E OrFail(absl::StatusOr<E> value) {
  if (!value.ok()) Fail(value.status().message());
  return *value;
}

// Numeric ids (uids, gids) of a list flag, or exits naming the flag.
std::vector<uint32_t> Ids(const std::vector<std::string>& values, absl::string_view flag) {
  std::vector<uint32_t> ids;
  for (const std::string& v : values) {
    uint32_t id = 0;
    if (!absl::SimpleAtoi(v, &id)) Fail(absl::StrCat(flag, ": \"", v, "\" is not a number"));
    ids.push_back(id);
  }
  return ids;
}

kvcm::AgentOptions OptionsFromFlags() {
  kvcm::AgentOptions o;
  o.agent_id = absl::GetFlag(FLAGS_agent_id);
  o.manager_address = absl::GetFlag(FLAGS_manager_address);
  o.listen_address = absl::GetFlag(FLAGS_listen_address);
  o.data_listen_address = absl::GetFlag(FLAGS_data_listen_address);
  o.transfer_io_timeout_ms = absl::GetFlag(FLAGS_transfer_io_timeout_ms);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.nccl_staging_bytes = absl::GetFlag(FLAGS_nccl_staging_bytes);
  o.nccl_max_links = absl::GetFlag(FLAGS_nccl_max_links);
  o.nccl_connect_timeout_ms = absl::GetFlag(FLAGS_nccl_connect_timeout_ms);
  o.device_index = absl::GetFlag(FLAGS_device_index);
  o.use_device = absl::GetFlag(FLAGS_use_device);
  o.tier = OrFail(kvcm::ParseTier(absl::GetFlag(FLAGS_tier), "--tier"));
  o.model = absl::GetFlag(FLAGS_model);
  o.dtype = OrFail(kvcm::ParseDtype(absl::GetFlag(FLAGS_kv_dtype), "--kv_dtype"));
  o.page_size_tokens = absl::GetFlag(FLAGS_page_size_tokens);
  o.spec.attention = OrFail(kvcm::ParseAttention(absl::GetFlag(FLAGS_attention), "--attention"));
  o.spec.num_layers = absl::GetFlag(FLAGS_num_layers);
  o.spec.num_heads = absl::GetFlag(FLAGS_num_heads);
  o.spec.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  o.spec.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.spec.kv_lora_rank = absl::GetFlag(FLAGS_kv_lora_rank);
  o.spec.rope_dim = absl::GetFlag(FLAGS_rope_dim);
  o.spec.dtype = o.dtype;
  o.spec.page_size_tokens = o.page_size_tokens;
  o.capacity_bytes = absl::GetFlag(FLAGS_capacity_bytes);
  o.host_capacity_bytes = absl::GetFlag(FLAGS_host_capacity_bytes);
  o.heartbeat_interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  o.max_blocks_per_call = absl::GetFlag(FLAGS_max_blocks_per_call);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.read_chunk_bytes = absl::GetFlag(FLAGS_read_chunk_bytes);
  o.max_streams_per_principal = absl::GetFlag(FLAGS_max_streams_per_principal);
  kvcm::ReadServerFlags(&o.limits, &o.tls);
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.agent_identity_dns_suffix = absl::GetFlag(FLAGS_agent_identity_dns_suffix);
  o.data_max_connections = absl::GetFlag(FLAGS_data_max_connections);
  o.data_max_connections_per_peer = absl::GetFlag(FLAGS_data_max_connections_per_peer);
  o.data_max_handshakes = absl::GetFlag(FLAGS_data_max_handshakes);
  o.data_max_handshakes_per_peer = absl::GetFlag(FLAGS_data_max_handshakes_per_peer);
  o.data_handshake_timeout_ms = absl::GetFlag(FLAGS_data_handshake_timeout_ms);
  o.data_request_timeout_ms = absl::GetFlag(FLAGS_data_request_timeout_ms);
  o.local_socket = absl::GetFlag(FLAGS_local_socket);
  o.local_max_sessions = absl::GetFlag(FLAGS_local_max_sessions);
  o.local_allowed_uids = Ids(absl::GetFlag(FLAGS_local_allowed_uids), "--local_allowed_uids");
  o.local_allowed_gids = Ids(absl::GetFlag(FLAGS_local_allowed_gids), "--local_allowed_gids");
  o.local_socket_group = absl::GetFlag(FLAGS_local_socket_group);
  o.local_max_sessions_per_uid = absl::GetFlag(FLAGS_local_max_sessions_per_uid);
  o.local_hello_timeout_ms = absl::GetFlag(FLAGS_local_hello_timeout_ms);
  o.local_principal_uids = absl::GetFlag(FLAGS_local_principal_uids);
  o.local_copy_chunk_bytes = absl::GetFlag(FLAGS_local_copy_chunk_bytes);
  o.allocate_wait_ms = absl::GetFlag(FLAGS_allocate_wait_ms);
  o.allocation_ttl_ms = absl::GetFlag(FLAGS_allocation_ttl_ms);
  o.verify_block_digests = absl::GetFlag(FLAGS_verify_block_digests);
  const char* token = kvcm::GetEnvWithDeprecated("kvcm-agent", "KVCM_TOKEN", "KVCM_AGENT_TOKEN");
  if (o.token_file.empty() && token != nullptr) {
    o.token = token;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  // Not dumpable, before anything is read or mapped: /proc/<pid>/mem, ptrace and the
  // /proc/<pid>/fd of this process then need CAP_SYS_PTRACE, even for a process of the same
  // uid (an engine on the local socket), and no core dump holds the pool
  // (docs/SECURITY.md "The local data path").
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    std::perror("kvcm-agent: prctl(PR_SET_DUMPABLE, 0)");
    return 1;
  }
  kvcm::SetLogProgramName("kvcm-agent");
  kvcm::ParseProgramFlags(
      argc, argv,
      {.name = "kvcm-agent",
       .usage = "kvcm-agent --agent_id=ID --manager_address=HOST:PORT [--option=value ...]: one "
                "GPU's KV block pool, registered with kvcm-manager.",
       .flag_files = {"gpu/agent/main.cc", "common/server_flags.cc"}});

  // Block SIGINT/SIGTERM before any thread starts; only sigwait below takes them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<std::unique_ptr<kvcm::Agent>> started = kvcm::Agent::Start(OptionsFromFlags());
  if (!started.ok()) Fail(started.status().ToString());
  kvcm::Agent* agent = started->get();
  const kvcm::PoolGeometry& g = agent->pool().geometry();
  std::printf("kvcm-agent %s serving BlockAgent on %s (%s), epoch %llu\n",
              absl::GetFlag(FLAGS_agent_id).c_str(), agent->address().c_str(),
              agent->options().tls.insecure ? "PLAINTEXT, insecure" : "mutual TLS",
              static_cast<unsigned long long>(agent->epoch()));
  std::fflush(stdout);
  kvcm::LogInfo(
      absl::StrCat("backend ", agent->pool().backend().name(), ": ", agent->backend_reason()));
  kvcm::LogInfo(absl::StrCat("transport ", agent->options().transport, ", data port ",
                             agent->data_address()));
  kvcm::LogInfo(absl::StrCat("pool: ", g.num_blocks, " blocks of ", g.bytes_per_block(),
                             " bytes, layout ", g.Layout().ToString()));
  if (const kvcm::BlockPool* host = agent->host_pool(); host != nullptr) {
    kvcm::LogInfo(absl::StrCat("host pool (demotion target): ", host->geometry().num_blocks,
                               " blocks in ", host->backend().name(), " memory"));
  }
  if (const std::string note =
          kvcm::HostMemoryTierNote(agent->options().tier, agent->pool().backend().is_device());
      !note.empty()) {
    kvcm::LogInfo(note);
  }

  std::thread signal_waiter([&stop_signals, agent] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    kvcm::LogInfo(absl::StrCat("received signal ", signal, ", shutting down"));
    agent->Shutdown();
  });
  agent->Wait();
  signal_waiter.join();
  started->reset();
  kvcm::LogInfo("stopped");
  return 0;
}
