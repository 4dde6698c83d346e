#include "client/kvcmctl_command.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"

namespace kvcm::cli {

int Invocation::Usage(absl::string_view message) const {
  absl::FPrintF(stderr, "kvcmctl %s: %s\nRun 'kvcmctl %s --help' for its flags.\n", command,
                message, command);
  return kExitUsage;
}

int Invocation::Failed(const absl::Status& status) const {
  absl::FPrintF(stderr, "kvcmctl %s: %s: %s\n", command, absl::StatusCodeToString(status.code()),
                status.message());
  return kExitFailed;
}

CallOptions Invocation::Call(google::protobuf::Message& reply) const {
  CallOptions call;
  if (json) call.reply = &reply;
  return call;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.add_whitespace = false;
  std::string out;
  // Fails only for a message that cannot be JSON (an Any of an unknown type): none of ours.
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) {
    out = "{}";
  }
  return out;
}

int PrintJson(const google::protobuf::Message& message) {
  absl::PrintF("%s\n", ToJson(message));
  return kExitOk;
}

}  // namespace kvcm::cli
