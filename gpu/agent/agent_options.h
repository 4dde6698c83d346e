// AgentOptions: every tunable of kvcm-agent, with its unit in its name and its default.
// Flags exist only in gpu/agent/main.cc. Plain value type.
#ifndef KVCM_GPU_AGENT_AGENT_OPTIONS_H_
#define KVCM_GPU_AGENT_AGENT_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/security_options.h"
#include "common/server_limits.h"
#include "common/transports.h"
#include "common/types.h"
#include "gpu/agent/pool/pool_geometry.h"

namespace kvcm {

// local_principal_uids parsed: principal name -> the peer uids it may be used from.
using LocalPrincipalUids = absl::flat_hash_map<std::string, std::vector<uint32_t>>;

// INVALID_ARGUMENT naming local_principal_uids for a malformed list (format on the option).
absl::StatusOr<LocalPrincipalUids> ParseLocalPrincipalUids(absl::string_view text);

// What kvcm-agent logs at start when its pool is in host memory yet registers as tier gpu,
// the default (`kvcmctl stats` then shows device "host" beside tier "gpu"): the tier is the
// pool's role, not its memory. Empty when there is nothing to explain.
std::string HostMemoryTierNote(Tier tier, bool pool_on_device);

struct AgentOptions {
  // Id of this agent, also its pool's agent_id at the manager. 1..128 bytes of
  // [A-Za-z0-9._:-].
  std::string agent_id = "agent-0";
  // kvcm-manager gRPC address (AgentControl).
  std::string manager_address = "127.0.0.1:50051";
  // Where this agent serves BlockAgent, "host:port" (port 0 picks a free one).
  std::string listen_address = "127.0.0.1:0";
  // Where peers pull this agent's blocks (the TCP transport's data port), "a.b.c.d:port"
  // (port 0 picks a free one).
  std::string data_listen_address = "127.0.0.1:0";
  // The host this agent registers for its BlockAgent and data addresses (ports stay the
  // bound ones): the name workers and peers dial and verify its certificate against, e.g.
  // "<pod>.kvcm-agent.kvcm.svc". Empty: the host of each listen address.
  std::string advertise_host;
  // A peer silent for this long fails a transfer; over NCCL, a send or receive that does not
  // complete within it aborts the link. >= 1.
  uint32_t transfer_io_timeout_ms = 10'000;
  // How this agent pulls and serves block bytes, by its name in common/transports.h ("tcp",
  // "nccl"); registered with the manager. "nccl" needs a build with NCCL
  // (KVCM_HAVE_NCCL) and the pool on a CUDA device: Agent::Start refuses it otherwise
  // (FAILED_PRECONDITION). Requests and acks still use the data port.
  std::string transport = std::string(kDefaultTransport);
  // NCCL: bytes of the device staging buffer of each link end; a chunk of a pull is at most
  // this. At least one block.
  uint64_t nccl_staging_bytes = 64ull << 20;
  // NCCL: most links held at once, of each kind (links to pull from peers, links peers pull
  // from this agent over); the least recently used idle one is dropped for a new one.
  // 1..1024.
  uint32_t nccl_max_links = 16;
  // NCCL: how long making a link may take (the manager's relay, ncclCommInitRank of both
  // ranks, the warm-up send/recv). >= 1.
  uint32_t nccl_connect_timeout_ms = 30'000;
  // CUDA device of the pool when one is present. >= 0.
  int device_index = 0;
  // False forces the host backend even on a machine with a GPU.
  bool use_device = true;
  // Tier the pool is registered as: its role, not its memory. gpu: the engines' pool, which
  // the manager demotes into the host pool and the vLLM connector fetches into, also when it
  // lives in host memory (no device, or use_device false: tests and CPU engines); host: a
  // host-tier pool (SGLang's HiCache stores into one). A default by memory would turn every
  // CPU agent into a host-tier pool, which the vLLM connector neither fetches into nor
  // remembers blocks of, and which the select policy does not observe.
  Tier tier = Tier::kGpu;
  // Model preset from the catalogue (kvcm::FindModel), e.g. "deepseek-v3". Empty: use
  // `spec` as given (explicit geometry).
  std::string model = "deepseek-v3";
  // KV element type and page size applied to the preset; `spec` when model is empty.
  KvDtype dtype = KvDtype::kBf16;
  uint32_t page_size_tokens = kDefaultPageSizeTokens;
  ModelSpec spec;
  // Bytes of the pool; rounded down to whole blocks. Must hold at least one block.
  uint64_t capacity_bytes = 1ULL << 30;
  // Bytes of a second pool in host DRAM, the target of the manager's demotions; rounded
  // down to whole blocks of the same geometry. 0: no host pool. Only for tier gpu; when not
  // 0 it must hold at least one block.
  uint64_t host_capacity_bytes = 0;
  // Period of heartbeats (and of registration retries while the manager is unreachable).
  // 1..600000.
  uint32_t heartbeat_interval_ms = 1'000;
  // A store into a full pool: how long a cache allocation (BlockAgent.Allocate with a
  // namespace, in the agent's epoch) may wait while the manager evicts to make room
  // (RoomMaker), ms; the call's own deadline may be shorter. 0: never wait (a short pool
  // answers RESOURCE_EXHAUSTED at once, as before issue 33). 0..600000.
  uint32_t allocate_wait_ms = 5'000;
  // Cache blocks allocated but neither committed nor freed within this are freed (the
  // worker died between Allocate and Insert); a late write to them answers ABORTED. Checked
  // every heartbeat. 0: never. 0 or 1000..86400000.
  uint32_t allocation_ttl_ms = 60'000;
  // Take a keyed digest of every block's bytes when it is committed and check it at every
  // read of the block (ReadBlocks, a local LOAD, a peer's pull): DATA_LOSS, nothing served,
  // for bytes changed since (BlockPool). Costs a hash of each block at commit and per read.
  bool verify_block_digests = false;
  // Prometheus /metrics address "host:port"; empty disables it.
  std::string metrics_address;
  // Most blocks one WriteBlocks or ReadBlocks call may name. 1..65536. (WriteBlocks writes
  // each chunk as it arrives: a stream buffers one message, not its blocks.)
  uint32_t max_blocks_per_call = 64;
  // Largest request message the BlockAgent server accepts (a WriteBlocks data chunk, a
  // RunAttention query). 1 KiB..1 GiB.
  uint64_t max_message_bytes = 4ull << 20;
  // Bytes per ReadBlocks response message. 1..max_message_bytes (a client's default receive
  // limit is 4 MiB).
  uint64_t read_chunk_bytes = 1ull << 20;
  // Most WriteBlocks + ReadBlocks streams one principal (a token's name; without a tokens
  // file every caller is one principal) may have open at once; the next is
  // RESOURCE_EXHAUSTED naming this option, until one ends. A stream buffers at most one
  // message (max_message_bytes, or read_chunk_bytes), so this bounds what one principal's
  // streams hold: 16 x 4 MiB = 64 MiB by default, while a worker moving a few prompts'
  // pages at once needs a handful. 1..65536.
  uint32_t max_streams_per_principal = 16;

  // Transport security (common/security_options.h; README "TLS"): one of TLS or insecure is
  // required. Each field of `tls` is the option tls_<field> (tls_cert_file, tls_key_file,
  // tls_ca_file, tls_reload_interval_s), `insecure` excepted, which keeps its name. TLS takes
  // all three PEM files and is mutual everywhere: tls_cert_file and tls_key_file are this
  // agent's identity, which its BlockAgent server and data port present and which it
  // presents to the manager and to peers; tls_ca_file verifies the manager, the peers and
  // BlockAgent's clients (workers, kvcmctl), who must all present certificates it signed.
  // The certificates must name the addresses they are reached at (subjectAltName), the data
  // port excepted (it checks the CA only). The files are re-read every
  // tls_reload_interval_s (1..86400). insecure = true: plaintext everywhere, for development
  // on a trusted machine only; excludes the tls_* files.
  TlsOptions tls;
  // The agent's bearer token, sent with every call to the manager (AgentControl, its streams,
  // and the Inserts of Fetch). Either token_file, read at Start, or token itself (kvcm-agent
  // sets it from $KVCM_AGENT_TOKEN; there is no flag, as a command line is visible in ps);
  // not both. Neither: no token.
  std::string token_file;
  std::string token;
  // Who may call this agent's BlockAgent: a tokens file (common/token_table.h; hashes only,
  // never a token), re-read every heartbeat_interval_ms when it changes. Workers then use
  // only their tenant's blocks, routers only Stats, agents (peers) and admins everything
  // (gpu/agent/server/block_agent_access.h). Empty: every caller may do everything (dev mode; a
  // warning is logged). Read at Start.
  std::string tokens_file;
  // Peer agents identified by their certificate on the BlockAgent port, as on the manager
  // (common/authenticator.h): needs tokens_file and mutual TLS. Empty: off.
  std::string agent_identity_dns_suffix;

  // Connection limits of the BlockAgent port (docs/SECURITY.md "Connection limits"): each
  // field <name> of `limits` is the option grpc_<name> (common/server_limits.h documents it
  // and its range).
  ServerLimitsOptions limits;
  // Connection limits of the data port (TcpTransportOptions, data_port.h): connections
  // served at once in all and per peer IP address, counted once their handshake completed
  // (one more is then closed, never queued); connections still in their handshake, in all
  // and per address, and how long that may take (handshake_budget.h); and how long a
  // connection may take to finish its TLS handshake and send its request. >= 1 each.
  uint32_t data_max_connections = 64;
  uint32_t data_max_connections_per_peer = 8;
  uint32_t data_max_handshakes = 64;
  uint32_t data_max_handshakes_per_peer = 8;
  uint32_t data_handshake_timeout_ms = 1'000;
  uint32_t data_request_timeout_ms = 2'000;

  // The local data path (local_socket_server.h, docs/AGENTS.md "Local data path"): a Unix
  // SOCK_SEQPACKET socket at this path (mode 0600, or 0660 with local_socket_group; a stale
  // one is replaced) where engines on
  // this host register their KV memory and have the agent copy blocks between it and the
  // pool, with the checks of ReadBlocks / WriteBlocks. Empty (the default): off. At most
  // 107 bytes (sun_path).
  std::string local_socket;
  // Sessions the local socket serves at once (one thread each); one more connection is
  // closed as it is accepted. 1..4096.
  uint32_t local_max_sessions = 64;
  // Who may connect (docs/SECURITY.md "The local data path"): a peer is admitted by its
  // SO_PEERCRED credentials when its uid is in local_allowed_uids or its (primary) gid in
  // local_allowed_gids; both empty (the default): the agent's own effective uid only. Any
  // other peer's connection is closed as it is accepted.
  std::vector<uint32_t> local_allowed_uids;
  std::vector<uint32_t> local_allowed_gids;
  // Group of the socket file (a name or a number): set, the file is mode 0660 in that group
  // (engines of other uids must be in it to connect); empty (the default): mode 0600.
  std::string local_socket_group;
  // Connections one peer uid may hold at once (sessions, and connections awaiting their
  // hello), so that no uid takes all local_max_sessions. 1..4096.
  uint32_t local_max_sessions_per_uid = 16;
  // A connection whose hello has not registered a region within this is closed (ms).
  // 1..600000.
  uint32_t local_hello_timeout_ms = 2'000;
  // Tokens bound to peer uids: "principal=uid[:uid...][,principal=uid...]" (a principal's
  // name in the tokens file). A hello (and every copy) with a listed principal's token is
  // PERMISSION_DENIED from any other uid; unlisted principals may be used from any admitted
  // uid. Empty (the default): none bound.
  std::string local_principal_uids;
  // Most bytes a LocalCopy copies per critical section of the pool's lock (whole segments,
  // at least one): what bounds how long a copy holds the lock (ReadBlocks holds it per
  // read_chunk_bytes). A value over a call's bytes copies each call in one section.
  // 1..2^40.
  uint64_t local_copy_chunk_bytes = 1ull << 20;

  // INVALID_ARGUMENT naming the first bad option (spec errors as "spec.<field>", a pool
  // that holds no block as "capacity_bytes"). Does not read the TLS or token files.
  absl::Status Validate() const;

  // The pool's geometry: the resolved spec and the blocks capacity_bytes holds.
  // REQUIRES nothing; errors as Validate().
  absl::StatusOr<PoolGeometry> Geometry() const;
  // The host pool's geometry: Geometry() with the blocks host_capacity_bytes holds.
  // REQUIRES: host_capacity_bytes > 0; errors as Validate().
  absl::StatusOr<PoolGeometry> HostGeometry() const;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_AGENT_OPTIONS_H_
