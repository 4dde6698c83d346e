// HttpGet: one plain HTTP/1.0 GET over a loopback socket, for tests that scrape /metrics.
// Header-only, test code.
#ifndef KVCM_TESTS_UTIL_HTTP_GET_H_
#define KVCM_TESTS_UTIL_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace kvcm::testing {

// GET http://127.0.0.1:`port``path` (the server closes the connection after the reply): the
// whole response, headers included. Empty on connection failure; waits at most 5 s for data.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string reply;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      pollfd p{fd, POLLIN, 0};
      char buf[4096];
      while (poll(&p, 1, 5000) > 0) {
        const ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0) break;
        reply.append(buf, static_cast<size_t>(n));
      }
    }
  }
  close(fd);
  return reply;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_HTTP_GET_H_
