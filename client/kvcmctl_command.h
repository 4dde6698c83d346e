// What every kvcmctl command shares: its exit codes, one run's flags and client, and how a
// result prints under --json. Commands live in kvcmctl.cc (the manager's) and
// kvcmctl_agent.cc (an agent's, and the manager's agent-facing lookups).
#ifndef KVCM_CLIENT_KVCMCTL_COMMAND_H_
#define KVCM_CLIENT_KVCMCTL_COMMAND_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/cli_args.h"
#include "client/client.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace kvcm::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// The agent's BlockAgent port when an --agent_address has none.
inline constexpr int kDefaultAgentPort = 50052;

// One run of one command: its name (for messages), its parsed flags and the client.
struct Invocation {
  absl::string_view command;
  const FlagSet& flags;
  Client* client;     // null for a command that needs no manager
  bool json = false;  // --json: results print as one JSON object per line

  // Prints `message` and the help pointer on stderr; returns kExitUsage.
  int Usage(absl::string_view message) const;
  // Prints "kvcmctl <command>: CODE: message" on stderr; returns kExitFailed.
  int Failed(const absl::Status& status) const;
  // CallOptions whose reply lands in `reply` under --json (nothing is copied otherwise).
  CallOptions Call(google::protobuf::Message& reply) const;
};

// `message` as one line of JSON: field names as in the proto (snake_case), every primitive
// field printed, 64-bit integers as strings (the proto3 JSON mapping).
std::string ToJson(const google::protobuf::Message& message);
// Prints ToJson(message) and a newline on stdout; returns kExitOk.
int PrintJson(const google::protobuf::Message& message);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_KVCMCTL_COMMAND_H_
