// absl::Status <-> grpc::Status, written once for every process: the code numbers are the
// same by definition, and the message travels unchanged.
#ifndef KVCM_COMMON_GRPC_STATUS_H_
#define KVCM_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvcm {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvcm

#endif  // KVCM_COMMON_GRPC_STATUS_H_
