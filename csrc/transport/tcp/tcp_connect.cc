// TCP transport, part one: building the full mesh. Construction listens on an ephemeral
// port, publishes "tcp/addr/<rank>" in the store and connects to every lower rank (with
// retry, net::connect_to) while accepting every higher one; each connection opens with the
// job-token handshake (magic, version, rank, size, group id, token), and a client that
// fails it is refused without disturbing the real peers. Frames, queues, progress and
// abort are in tcp_transport.cc.
#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "common/cores.h"
#include "common/error.h"
#include "common/socket.h"
#include "transport/tcp/tcp_peer.h"

namespace meshcoll::transport {

namespace {

constexpr uint32_t kHandshakeMagic = 0x5348434d;  // "MCHS"
// 2: the connecting rank's global rank; 3: 40-byte OpDesc (64-bit fingerprints), so frame
// headers of 72 bytes
constexpr uint16_t kHandshakeVersion = 3;
// What a handshake refused for another group most often means, and what to do.
constexpr const char* kOtherGroup =
    "every member of a group must call new_group with the same ranks (or split with matching "
    "colors), and every rank must create its groups in the same order";

#pragma pack(push, 1)
struct Handshake {
  uint32_t magic;
  uint16_t version;
  uint16_t token_len;
  int32_t rank;    // in the group
  int32_t size;
  uint64_t comm_id;
  int32_t global;  // in the job: the acceptor's member list must give `rank` to it
};
#pragma pack(pop)

bool same_token(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

Millis remaining(const Deadline& d) {
  int ms = d.poll_ms();
  return Millis(ms < 0 ? 24LL * 3600 * 1000 : ms);
}

}  // namespace

TcpTransport::TcpTransport(int rank, int size, store::Store& store, const TcpOptions& opts,
                           DescribeOp describe, const Deadline& d)
    : rank_(rank), size_(size), global_(opts.global), stop_(opts.stop), describe_(describe) {
  for (int i = 0; i < size; ++i) peers_.push_back(std::make_unique<Peer>());
  spin_ = threads_fit(static_cast<unsigned>(size), host_cores());  // Note [Spinning]
  if (size > 1) {
    try {
      connect_all(store, opts, d);
    } catch (...) {
      for (auto& p : peers_) net::close_fd(p->fd);
      throw;
    }
  }
}

TcpTransport::~TcpTransport() {
  for (auto& p : peers_) net::close_fd(p->fd);
}

namespace {
constexpr char kWithdrawn[] = "withdrawn\n";  // an address never starts so (Note [Withdrawn ranks])

std::string address_key(int rank) { return str_cat("tcp/addr/", rank); }

// Throws the reason peer `j` gave, if `addr` is its notice of withdrawal.
void check_withdrawn(const store::Bytes& addr, const RankNames& global, int me, int j) {
  const std::string s(addr.begin(), addr.end());
  if (s.rfind(kWithdrawn, 0) != 0) return;
  throw MismatchError(str_cat("rank ", global(me), ": rank ", global(j), " will not set up this "
                              "group: ", s.substr(sizeof(kWithdrawn) - 1)));
}
}  // namespace

void TcpTransport::withdraw(store::Store& store, int rank, const std::string& why,
                            const Deadline& d) {
  const std::string notice = kWithdrawn + why;
  store.set(address_key(rank), store::Bytes(notice.begin(), notice.end()), remaining(d));
}

void TcpTransport::connect_all(store::Store& store, const TcpOptions& opts, const Deadline& d) {
  int port = 0;
  int listen_fd = net::listen_on(opts.bind_host, 0, size_ + 16, &port);
  struct Closer {
    int fd;
    ~Closer() { net::close_fd(fd); }
  } closer{listen_fd};
  std::string me = net::Endpoint{opts.bind_host, port}.str();
  store.set(address_key(rank_), store::Bytes(me.begin(), me.end()), remaining(d));

  Handshake hs{kHandshakeMagic, kHandshakeVersion, static_cast<uint16_t>(opts.token.size()),
               rank_, size_, opts.comm_id, global_(rank_)};
  // Lower ranks accept, higher ranks connect: the kernel completes a connect into the
  // listener's backlog, so connecting first and accepting second cannot deadlock.
  for (int j = 0; j < rank_; ++j) {
    std::string what = str_cat("rank ", global_(rank_), ": connecting to rank ", global_(j));
    store::Bytes addr;
    try {
      addr = store.get(address_key(j), remaining(d));
    } catch (const TimeoutError&) {
      throw TimeoutError(str_cat(what, ": rank ", global_(j), " died or never came during setup: ",
                                 "it published no address within ", d.timeout().count(),
                                 " ms; did every rank start?"));
    }
    check_withdrawn(addr, global_, rank_, j);
    std::string s(addr.begin(), addr.end());
    size_t colon = s.rfind(':');
    std::string host = s.substr(0, colon);
    if (!host.empty() && host.front() == '[') host = host.substr(1, host.size() - 2);
    int peer_port = std::stoi(s.substr(colon + 1));
    int fd;
    try {
      fd = net::connect_to(host, peer_port, d, what, true);
    } catch (const PeerError& e) {  // its listener closed: it finished setup, or gave up
      throw PeerError(str_cat(e.what(), ": rank ", global_(j), " set up this group without this "
                              "rank (", kOtherGroup, "), or it failed or died during setup"));
    }
    peers_[j]->fd = fd;
    net::send_all(fd, &hs, sizeof(hs), d, what);
    net::send_all(fd, opts.token.data(), opts.token.size(), d, what);
  }
  // Accept the higher ranks. Handshakes are read from all pending connections at once, so
  // a stray client that connects and stays silent cannot delay the real peers.
  struct Pending {
    int fd;
    std::string bytes;
    Clock::time_point since;
  };
  std::vector<Pending> pending;
  int expected = size_ - 1 - rank_;
  // A handshake with this job's token refused for another group: the likely reason, should
  // the peers we wait for never come, is that the ranks disagree on this group.
  std::string refused;
  auto drop = [&](size_t i) {
    net::close_fd(pending[i].fd);
    pending[i] = std::move(pending.back());
    pending.pop_back();
  };
  const auto accept_start = Clock::now();
  // The higher ranks seen to publish an address: the others are asked about now and then, in
  // case they withdrew (Note [Withdrawn ranks]).
  std::vector<bool> published(size_, false);
  auto next_look = Clock::now();
  while (expected > 0) {
    if (Clock::now() >= next_look) {
      next_look = Clock::now() + Millis(250);
      for (int j = rank_ + 1; j < size_; ++j) {
        if (published[j] || peers_[j]->fd >= 0) continue;
        const Millis brief(500);  // a working store answers in microseconds
        if (!store.check({address_key(j)}, brief)) continue;
        published[j] = true;
        try {
          check_withdrawn(store.get(address_key(j), brief), global_, rank_, j);
        } catch (const MismatchError&) {
          for (auto& p : pending) net::close_fd(p.fd);
          throw;
        }
      }
    }
    try {
      check_interrupt(global_(rank_), accept_start);  // Note [Interrupts]
    } catch (const Interrupted&) {
      for (auto& p : pending) net::close_fd(p.fd);
      throw;
    }
    if (d.expired()) {
      for (auto& p : pending) net::close_fd(p.fd);
      std::string missing;
      for (int j = rank_ + 1; j < size_; ++j)
        if (peers_[j]->fd < 0) missing += str_cat(missing.empty() ? "" : ", ", global_(j));
      throw TimeoutError(str_cat("rank ", global_(rank_), ": rank(s) ", missing,
                                 " died or never came during setup: no connection from them "
                                 "within ", d.timeout().count(), " ms; ",
                                 refused.empty() ? "did every rank start?" : refused));
    }
    std::vector<pollfd> fds{{listen_fd, POLLIN, 0}};
    for (auto& p : pending) fds.push_back({p.fd, POLLIN, 0});
    int ms = d.poll_ms();
    ::poll(fds.data(), fds.size(), ms < 0 || ms > 100 ? 100 : ms);
    if (fds[0].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        net::set_nodelay(fd);
        pending.push_back({fd, std::string(), Clock::now()});
      }
    }
    for (size_t i = pending.size(); i-- > 0;) {
      Pending& p = pending[i];
      char buf[256];
      ssize_t n = ::recv(p.fd, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        drop(i);
        continue;
      }
      if (n > 0) p.bytes.append(buf, static_cast<size_t>(n));
      Handshake in{};
      if (p.bytes.size() >= sizeof(in)) std::memcpy(&in, p.bytes.data(), sizeof(in));
      bool header = p.bytes.size() >= sizeof(in);
      if (header && (in.magic != kHandshakeMagic || in.token_len > 1024)) {
        drop(i);
        continue;
      }
      if (!header || p.bytes.size() < sizeof(in) + in.token_len) {
        if (Clock::now() - p.since > Millis(10000)) drop(i);  // too slow: a stray
        continue;
      }
      std::string token = p.bytes.substr(sizeof(in), in.token_len);
      const bool ours = same_token(token, opts.token);
      const bool this_group = in.comm_id == opts.comm_id && in.size == size_;
      // The same group by name and size, but this rank's members list gives that place to
      // another rank: the ranks' lists differ, and it must not stand in.
      const bool stand_in = in.rank > rank_ && in.rank < size_ && in.global != global_(in.rank);
      uint8_t ok = in.version == kHandshakeVersion && ours && this_group && !stand_in &&
                   in.rank > rank_ && in.rank < size_ && peers_[in.rank]->fd < 0 &&
                   p.bytes.size() == sizeof(in) + in.token_len;
      (void)!::send(p.fd, &ok, 1, MSG_NOSIGNAL);
      if (!ok) {
        // Only a peer that knows the token is believed about its group.
        if (refused.empty() && ours && !this_group)
          refused = str_cat("meanwhile a rank of this job connected to set up another group (it "
                            "is rank ", in.rank, " of a group of ", in.size, "), so the ranks "
                            "disagree on this group: ", kOtherGroup);
        else if (refused.empty() && ours && stand_in)
          refused = str_cat("meanwhile rank ", in.global, " connected as this group's member ",
                            in.rank, ", the place this rank's members list gives to rank ",
                            global_(in.rank), ", so the ranks disagree on this group: ",
                            kOtherGroup);
        drop(i);  // a stray or mistaken client: refused, keep waiting
        continue;
      }
      peers_[in.rank]->fd = p.fd;
      --expected;
      pending[i] = std::move(pending.back());
      pending.pop_back();
    }
  }
  for (auto& p : pending) net::close_fd(p.fd);
  for (int j = 0; j < rank_; ++j) {
    uint8_t ok = 0;
    std::string what = str_cat("rank ", global_(rank_), ": handshake with rank ", global_(j));
    try {
      net::recv_all(peers_[j]->fd, &ok, 1, d, what);
    } catch (const PeerError&) {
      throw PeerError(str_cat(what, ": rank ", global_(j), " closed the connection before it "
                              "answered: it died during setup, or set up this group without "
                              "this rank (", kOtherGroup, ")"));
    }
    if (!ok)
      throw PeerError(str_cat(what, " was refused: rank ", global_(j), " sets up another group ",
                              "(", kOtherGroup, "), or its job token (MESHCOLL_TOKEN) differs "
                              "(start every rank from one launch)"));
  }
}

}  // namespace meshcoll::transport
