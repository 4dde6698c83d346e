// The one place where kvcm's processes get their gRPC transport credentials: every server
// (manager, agent) and every channel (client, agent -> manager, tests, benchmarks) is built
// through these, so transport security changes here and nowhere else.
//
// Today kvcm speaks plaintext gRPC, for trusted networks only; TLS and mTLS (with their
// options) arrive here with the security work.
#ifndef KVCM_COMMON_CREDENTIALS_H_
#define KVCM_COMMON_CREDENTIALS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace kvcm {

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials();
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials();

// A channel to `address` ("host:port") with MakeChannelCredentials() and `args`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const grpc::ChannelArguments& args = {});

}  // namespace kvcm

#endif  // KVCM_COMMON_CREDENTIALS_H_
