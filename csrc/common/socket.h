// Socket helpers shared by the store and the TCP transport. Every syscall retry
// (EINTR / EAGAIN) lives here, and every blocking helper takes a Deadline.
#pragma once

#include <string>

#include "common/deadline.h"

namespace meshcoll::net {

struct Endpoint {
  std::string host;
  int port = 0;
  std::string str() const;  // "host:port", IPv6 in brackets
};

// Listens on host:port (port 0 = any free port). Throws SystemError naming the address,
// with a hint when the port is in use.
int listen_on(const std::string& host, int port, int backlog, int* bound_port);

// Connects to host:port, retrying refused/unreachable attempts until the deadline:
// during rendezvous the server may not be listening yet. `what` goes into errors.
// `listening`: the address was published once its listener was up, so a refusal means that
// listener is gone: PeerError at the first one instead of retrying.
int connect_to(const std::string& host, int port, const Deadline& d, const std::string& what,
               bool listening = false);

// Accepts one connection, waiting at most until the deadline (TimeoutError).
int accept_one(int listen_fd, const Deadline& d, const std::string& what);

// Blocking-with-deadline transfers over a non-blocking fd. recv_all throws PeerError on EOF
// or reset, TimeoutError at the deadline; `what` names the operation and the peer.
void send_all(int fd, const void* buf, size_t n, const Deadline& d, const std::string& what);
void recv_all(int fd, void* buf, size_t n, const Deadline& d, const std::string& what);

void set_nonblocking(int fd);
void set_nodelay(int fd);
void close_fd(int fd);
// The local address of a connected socket: the interface that routes to the peer.
std::string local_host(int fd);
std::string peer_host(int fd);

// One helper for EINTR/EAGAIN: returns bytes moved (>0), 0 on EOF, -1 when it would block.
// Throws PeerError on a reset/broken pipe, SystemError otherwise.
ssize_t send_some(int fd, const void* buf, size_t n, const std::string& what);
ssize_t recv_some(int fd, void* buf, size_t n, const std::string& what);

}  // namespace meshcoll::net
