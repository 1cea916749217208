#include "common/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "common/error.h"

namespace meshcoll::net {

std::string Endpoint::str() const {
  if (host.find(':') != std::string::npos) return str_cat("[", host, "]:", port);
  return str_cat(host, ":", port);
}

namespace {

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, int port, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out->head);
  if (rc != 0) {
    throw InvalidArgument(str_cat("cannot resolve address '", host, "': ", gai_strerror(rc),
                                  "; check the master address / MESHCOLL_MASTER_ADDR"));
  }
}

std::string sockaddr_host(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

// Waits for fd to become ready for `events`; false at the deadline.
bool wait_ready(int fd, short events, const Deadline& d) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, d.poll_ms());
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) throw SystemError(str_cat("poll failed: ", errno_text(errno)));
  }
}

}  // namespace

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    throw SystemError(str_cat("fcntl(O_NONBLOCK) failed: ", errno_text(errno)));
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void close_fd(int fd) {
  if (fd >= 0) ::close(fd);
}

int listen_on(const std::string& host, int port, int backlog, int* bound_port) {
  AddrInfo ai;
  resolve(host, port, true, &ai);
  int last_err = 0;
  for (addrinfo* a = ai.head; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_err = errno;
      continue;
    }
    int one = 1;
    // SO_REUSEADDR lets a restarted job reuse a port in TIME_WAIT; it does not let two
    // live listeners share a port on Linux, so "port in use" is still reported.
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      *bound_port = ntohs(ss.ss_family == AF_INET
                              ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                              : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
      set_nonblocking(fd);
      return fd;
    }
    last_err = errno;
    ::close(fd);
  }
  std::string hint = last_err == EADDRINUSE
                         ? "; another process is using this port: set another master port "
                           "(MESHCOLL_MASTER_PORT, master_port=, or meshcoll-run --master-port, "
                           "where 0 lets a one-node job choose)"
                         : (last_err == EADDRNOTAVAIL
                                ? "; this host has no interface with that address: check "
                                  "MESHCOLL_MASTER_ADDR / MESHCOLL_SOCKET_IFNAME"
                                : "");
  throw SystemError(str_cat("cannot listen on ", Endpoint{host, port}.str(), ": ",
                            errno_text(last_err), hint));
}

namespace {
constexpr int kConnectAttemptMs = 500;
}  // namespace

int connect_to(const std::string& host, int port, const Deadline& d, const std::string& what,
               bool listening) {
  Endpoint ep{host, port};
  int last_err = 0;
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    AddrInfo ai;
    resolve(host, port, false, &ai);
    for (addrinfo* a = ai.head; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        last_err = errno;
        continue;
      }
      set_nonblocking(fd);
      int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        // One attempt waits at most kConnectAttemptMs: a SYN dropped by a full backlog (a
        // busy or flooded listener) is otherwise resent by the kernel after 1, 3, 7 s, so a
        // 10 s deadline would get four tries; a fresh connect sends one at once.
        const int left = d.poll_ms();
        const Deadline attempt = Deadline::after_ms(
            left < 0 ? kConnectAttemptMs : std::min(left, kConnectAttemptMs));
        if (wait_ready(fd, POLLOUT, attempt)) {
          int err = 0;
          socklen_t len = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          errno = ETIMEDOUT;
          rc = -1;
        }
      }
      if (rc == 0) {
        set_nodelay(fd);
        return fd;
      }
      last_err = errno;
      ::close(fd);
      if (listening && last_err == ECONNREFUSED)
        throw PeerError(str_cat(what, ": connection refused at ", ep.str(), ": nothing listens "
                                "there any more"));
    }
    if (d.expired()) break;
    // The listener may not be up yet (rendezvous); back off and retry until the deadline.
    std::this_thread::sleep_for(std::min<Millis>(backoff, Millis(std::max(1, d.poll_ms()))));
    backoff = std::min<Millis>(backoff * 2, Millis(500));
  }
  throw TimeoutError(str_cat(what, ": could not connect to ", ep.str(), " within ",
                             d.timeout().count(), " ms (last error: ", errno_text(last_err),
                             "); is the master running and reachable at that address?"));
}

int accept_one(int listen_fd, const Deadline& d, const std::string& what) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      set_nonblocking(fd);
      set_nodelay(fd);
      return fd;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      throw SystemError(str_cat(what, ": accept failed: ", errno_text(errno)));
    if (!wait_ready(listen_fd, POLLIN, d))
      throw TimeoutError(str_cat(what, ": no connection arrived within ", d.timeout().count(),
                                 " ms"));
  }
}

ssize_t send_some(int fd, const void* buf, size_t n, const std::string& what) {
  for (;;) {
    ssize_t rc = ::send(fd, buf, n, MSG_NOSIGNAL);
    if (rc >= 0) return rc;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
    if (errno == EPIPE || errno == ECONNRESET)
      throw PeerError(str_cat(what, ": connection closed by the peer (", errno_text(errno), ")"));
    throw SystemError(str_cat(what, ": send failed: ", errno_text(errno)));
  }
}

ssize_t recv_some(int fd, void* buf, size_t n, const std::string& what) {
  for (;;) {
    ssize_t rc = ::recv(fd, buf, n, 0);
    if (rc >= 0) return rc;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
    if (errno == ECONNRESET || errno == EPIPE)
      throw PeerError(str_cat(what, ": connection reset by the peer (", errno_text(errno), ")"));
    if (errno == EFAULT)  // this process's own buffer, not the peer
      throw InvalidArgument(str_cat(what, ": the receive buffer is not writable memory (",
                                    errno_text(errno), "): it was freed or never mapped"));
    throw SystemError(str_cat(what, ": recv failed: ", errno_text(errno)));
  }
}

void send_all(int fd, const void* buf, size_t n, const Deadline& d, const std::string& what) {
  auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t rc = send_some(fd, p, n, what);
    if (rc > 0) {
      p += rc;
      n -= static_cast<size_t>(rc);
    } else if (!wait_ready(fd, POLLOUT, d)) {
      throw TimeoutError(str_cat(what, ": send timed out after ", d.timeout().count(), " ms"));
    }
  }
}

void recv_all(int fd, void* buf, size_t n, const Deadline& d, const std::string& what) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t rc = recv_some(fd, p, n, what);
    if (rc > 0) {
      p += rc;
      n -= static_cast<size_t>(rc);
    } else if (rc == 0) {
      throw PeerError(str_cat(what, ": connection closed by the peer"));
    } else if (!wait_ready(fd, POLLIN, d)) {
      throw TimeoutError(str_cat(what, ": receive timed out after ", d.timeout().count(), " ms"));
    }
  }
}

std::string local_host(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  return sockaddr_host(ss);
}

std::string peer_host(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  return sockaddr_host(ss);
}

}  // namespace meshcoll::net
