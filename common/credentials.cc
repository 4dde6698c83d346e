#include "common/credentials.h"

namespace kvcm {

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials() {
  return grpc::InsecureServerCredentials();
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials() {
  return grpc::InsecureChannelCredentials();
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const grpc::ChannelArguments& args) {
  return grpc::CreateCustomChannel(address, MakeChannelCredentials(), args);
}

}  // namespace kvcm
