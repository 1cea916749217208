#include "store/tcp_store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "common/error.h"
#include "common/socket.h"
#include "common/thread_name.h"
#include "store/wire.h"

namespace meshcoll::store {

namespace {

// Reads one length-prefixed string from a server connection, refusing oversized fields so
// a malformed client cannot make the server allocate without bound.
std::string read_string(int fd, uint32_t max_len, const Deadline& d) {
  uint32_t len = 0;
  net::recv_all(fd, &len, sizeof(len), d, "store server");
  if (len > max_len) throw InvalidArgument(str_cat("field of ", len, " bytes exceeds ", max_len));
  std::string s(len, '\0');
  if (len) net::recv_all(fd, s.data(), len, d, "store server");
  return s;
}

template <class T>
T read_pod(int fd, const Deadline& d) {
  T v{};
  net::recv_all(fd, &v, sizeof(v), d, "store server");
  return v;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Server

TcpStoreServer::TcpStoreServer(const std::string& host, int port, std::string token,
                               uint32_t generation)
    : token_(std::move(token)), generation_(generation) {
  listen_fd_ = net::listen_on(host, port, 1024, &port_);
  if (pipe2(wake_pipe_, O_CLOEXEC) != 0) {
    net::close_fd(listen_fd_);
    throw SystemError(str_cat("store server: pipe failed: ", errno_text(errno)));
  }
  acceptor_ = named_thread("mc-store-accept", [this] { accept_loop(); });
}

TcpStoreServer::~TcpStoreServer() { stop(); }

void TcpStoreServer::stop_accepting() {
  if (accepting_stopped_.exchange(true)) return;
  char c = 0;
  (void)!::write(wake_pipe_[1], &c, 1);  // the acceptor returns on the wake pipe
  if (acceptor_.joinable()) acceptor_.join();
  net::close_fd(listen_fd_);
  listen_fd_ = -1;
}

void TcpStoreServer::stop() {
  if (stopping_.exchange(true)) return;
  stop_accepting();
  std::map<std::thread::id, std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // shutdown() wakes every serving thread blocked in poll/recv on its client.
    for (int fd : client_fds_) ::shutdown(fd, SHUT_RDWR);
    threads.swap(client_threads_);
  }
  cv_.notify_all();
  for (auto& [id, t] : threads) t.join();
  net::close_fd(listen_fd_);
  net::close_fd(wake_pipe_[0]);
  net::close_fd(wake_pipe_[1]);
}

// Note [Connection flood]
// Anyone who can reach the port can open connections, so what a connection that has not
// said a valid hello may hold is bounded: at most kMaxUnauthenticated of them at once (a
// new one pushes out the oldest that has sent nothing: a proper client's hello is already in
// its socket when it is accepted, while a silent one has had its turn), each for at most kHelloTimeoutMs.
// When accept fails for want of descriptors (EMFILE, ENFILE) the connection stays in the
// backlog and the listener stays readable, so polling again at once would spin: the
// acceptor pushes out the oldest unauthenticated connection to free a descriptor and
// pauses briefly (longer when there was none: only an authenticated client's exit frees
// one then). Under a sustained flood a proper client may be pushed out before its hello is
// read; the client then connects again (TcpStore's constructor). Without these, 1,100
// silent connections locked proper clients out for 30 s and pinned a core.
namespace {
constexpr size_t kMaxUnauthenticated = 64;
constexpr int kHelloTimeoutMs = 5000;
}  // namespace

bool TcpStoreServer::drop_oldest_unauthenticated() {
  if (unauthenticated_.empty()) return false;
  // The oldest that has sent nothing: one whose hello is waiting in its socket only lacks
  // its serving thread's turn (on a loaded machine, a flood's new connections can outrun
  // it), so it is spared while a silent one is left. All of them sent bytes: the oldest.
  auto victim = unauthenticated_.begin();
  for (auto it = unauthenticated_.begin(); it != unauthenticated_.end(); ++it) {
    char byte;
    if (::recv(*it, &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 &&
        (errno == EAGAIN || errno == EWOULDBLOCK)) {
      victim = it;
      break;
    }
  }
  // Its serving thread wakes on the shutdown and closes the descriptor (under mu_, after
  // taking it out of unauthenticated_, so the number cannot be reused meanwhile).
  ::shutdown(*victim, SHUT_RDWR);
  unauthenticated_.erase(victim);
  return true;
}

void TcpStoreServer::forget_unauthenticated(int fd) {
  auto it = std::find(unauthenticated_.begin(), unauthenticated_.end(), fd);
  if (it != unauthenticated_.end()) unauthenticated_.erase(it);
}

void TcpStoreServer::wait_ms(int ms) {
  pollfd p{wake_pipe_[0], POLLIN, 0};
  (void)::poll(&p, 1, ms);
}

void TcpStoreServer::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    int rc = ::poll(fds, 2, -1);
    if (rc < 0 && errno == EINTR) continue;
    if (stopping_ || fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd;
    try {
      fd = net::accept_one(listen_fd_, Deadline::after_ms(0), "store server");
    } catch (const TimeoutError&) {
      continue;  // the client went away before we took it
    } catch (const Error&) {
      // Out of descriptors or memory (Note [Connection flood]).
      bool dropped;
      {
        std::lock_guard<std::mutex> lock(mu_);
        dropped = drop_oldest_unauthenticated();
      }
      wait_ms(dropped ? 5 : 100);
      continue;
    }
    std::vector<std::thread> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto id : done_) {
        auto it = client_threads_.find(id);
        if (it != client_threads_.end()) {
          finished.push_back(std::move(it->second));
          client_threads_.erase(it);
        }
      }
      done_.clear();
      if (unauthenticated_.size() >= kMaxUnauthenticated) drop_oldest_unauthenticated();
      client_fds_.push_back(fd);
      unauthenticated_.push_back(fd);
      try {
        std::thread t = named_thread("mc-store-serve", [this, fd] { serve(fd); });
        auto id = t.get_id();
        client_threads_.emplace(id, std::move(t));
      } catch (const std::system_error&) {  // out of threads: refuse this client, keep serving
        client_fds_.pop_back();
        unauthenticated_.pop_back();
        net::close_fd(fd);
      }
    }
    for (auto& t : finished) t.join();
  }
}

void TcpStoreServer::serve(int fd) {
  bool counted = false;  // a user of the store (Note [Store teardown])
  try {
    // The hello must arrive promptly; a port scanner or stray client cannot pin a thread.
    Deadline hello_deadline = Deadline::after_ms(kHelloTimeoutMs);
    auto hello = read_pod<wire::Hello>(fd, hello_deadline);
    std::string reply_msg;
    wire::HelloStatus status = wire::HelloStatus::kOk;
    // Not our protocol: drop it (the cleanup below closes the descriptor).
    if (hello.magic != wire::kMagic || hello.token_len > wire::kMaxTokenBytes)
      throw InvalidArgument("not a meshcoll store client");
    std::string token;
    token.resize(hello.token_len);
    if (hello.token_len) net::recv_all(fd, token.data(), token.size(), hello_deadline, "store");
    if (hello.version != wire::kVersion) {
      status = wire::HelloStatus::kBadVersion;
      reply_msg = str_cat("store protocol version ", hello.version, " is not supported (server ",
                          wire::kVersion, "); use the same meshcoll version on every rank");
    } else if (!token_.empty() && !constant_time_equal(token, token_)) {
      status = wire::HelloStatus::kBadToken;
      reply_msg = "job token rejected by the store server; set MESHCOLL_TOKEN to the job's token";
    } else if (hello.generation > generation_) {
      // Note [Generations]: a later init's client; it connects again until its own store.
      throw InvalidArgument("a client of a later generation");
    } else if (hello.generation < generation_) {
      status = wire::HelloStatus::kStale;
      reply_msg = str_cat("this process is at its meshcoll.init number ", hello.generation + 1,
                          ", the store's host at number ", generation_ + 1, ": every rank "
                          "must call destroy() and init() as often as the others");
    }
    if (status == wire::HelloStatus::kOk) {
      // Before the answer: once the client reads "ok" it must not be pushed out any more
      // (if it was already, the answer fails to send and the client connects again), and it
      // is a user a closing store waits for (Note [Store teardown]).
      std::lock_guard<std::mutex> lock(mu_);
      forget_unauthenticated(fd);
      ++clients_;
      counted = true;
    }
    reply_msg.resize(std::min<size_t>(reply_msg.size(), wire::kMaxHelloMessageBytes));
    wire::HelloReply reply{static_cast<uint8_t>(status), static_cast<uint16_t>(reply_msg.size())};
    net::send_all(fd, &reply, sizeof(reply), hello_deadline, "store");
    net::send_all(fd, reply_msg.data(), reply_msg.size(), hello_deadline, "store");
    if (status == wire::HelloStatus::kOk) {
      while (!stopping_ && handle_one(fd)) {
      }
    }
  } catch (const std::exception&) {
    // Malformed input, a closed client or shutdown: drop this connection only.
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : client_fds_) {
      if (c == fd) {
        c = client_fds_.back();
        client_fds_.pop_back();
        break;
      }
    }
    // A connection that ended before its hello (the client closed it, sent garbage, or
    // took too long) must leave the list with its number: once closed, the number is
    // reused, and a stale entry would push out whichever client got it next.
    forget_unauthenticated(fd);
    net::close_fd(fd);
    if (counted) --clients_;
    done_.push_back(std::this_thread::get_id());
  }
  cv_.notify_all();  // wait_until_unused
}

bool TcpStoreServer::wait_until_unused(Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [this] { return clients_ == 0; });
}

bool TcpStoreServer::handle_one(int fd) {
  const Deadline io = Deadline::after_ms(60000);  // a request's fields once its type arrived
  uint8_t type = 0;
  ssize_t n;
  // Wait for the next request without a deadline: clients may idle for the whole job.
  for (;;) {
    n = net::recv_some(fd, &type, 1, "store server");
    if (n == 1) break;
    if (n == 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, -1) < 0 && errno != EINTR) return false;
    if (stopping_) return false;
  }
  std::string out;  // reply bytes after the status
  auto put = [&out](const void* p, size_t len) { out.append(static_cast<const char*>(p), len); };
  auto put_str = [&](const std::string& s) {
    uint32_t len = static_cast<uint32_t>(s.size());
    put(&len, 4);
    put(s.data(), s.size());
  };
  wire::Status status = wire::Status::kOk;
  auto wait_for = [&](const std::vector<std::string>& keys, int64_t timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] {
      if (stopping_) return true;
      for (const auto& k : keys)
        if (!data_.count(k)) return false;
      return true;
    };
    bool ok = timeout_ms < 0 ? (cv_.wait(lock, ready), true)
                             : cv_.wait_for(lock, Millis(timeout_ms), ready);
    return ok && !stopping_;
  };

  switch (static_cast<wire::QueryType>(type)) {
    case wire::QueryType::kSet: {
      std::string key = read_string(fd, wire::kMaxKeyBytes, io);
      std::string value = read_string(fd, wire::kMaxValueBytes, io);
      {
        std::lock_guard<std::mutex> lock(mu_);
        data_[key] = Bytes(value.begin(), value.end());
      }
      cv_.notify_all();
      break;
    }
    case wire::QueryType::kGet: {
      std::string key = read_string(fd, wire::kMaxKeyBytes, io);
      auto timeout_ms = read_pod<int64_t>(fd, io);
      if (wait_for({key}, timeout_ms)) {
        std::lock_guard<std::mutex> lock(mu_);
        const Bytes& v = data_[key];
        put_str(std::string(v.begin(), v.end()));
      } else {
        status = wire::Status::kTimeout;
      }
      break;
    }
    case wire::QueryType::kAdd: {
      std::string key = read_string(fd, wire::kMaxKeyBytes, io);
      auto delta = read_pod<int64_t>(fd, io);
      int64_t result = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Bytes& v = data_[key];
        if (add_decimal(v, delta, &result) == AddResult::kOk) {
          std::string s = std::to_string(result);
          v.assign(s.begin(), s.end());
        } else {
          status = wire::Status::kBadValue;  // the key keeps its value
        }
      }
      cv_.notify_all();
      put(&result, 8);
      break;
    }
    case wire::QueryType::kCompareSet: {
      std::string key = read_string(fd, wire::kMaxKeyBytes, io);
      std::string expected = read_string(fd, wire::kMaxValueBytes, io);
      std::string desired = read_string(fd, wire::kMaxValueBytes, io);
      std::string now;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = data_.find(key);
        bool absent = it == data_.end();
        if ((absent && expected.empty()) ||
            (!absent && std::string(it->second.begin(), it->second.end()) == expected)) {
          data_[key] = Bytes(desired.begin(), desired.end());
          now = desired;
        } else {
          now = absent ? std::string() : std::string(it->second.begin(), it->second.end());
        }
      }
      cv_.notify_all();
      put_str(now);
      break;
    }
    case wire::QueryType::kWait:
    case wire::QueryType::kCheck: {
      auto count = read_pod<uint32_t>(fd, io);
      if (count > wire::kMaxWaitKeys) return false;
      std::vector<std::string> keys;
      for (uint32_t i = 0; i < count; ++i) keys.push_back(read_string(fd, wire::kMaxKeyBytes, io));
      if (static_cast<wire::QueryType>(type) == wire::QueryType::kWait) {
        auto timeout_ms = read_pod<int64_t>(fd, io);
        if (!wait_for(keys, timeout_ms)) status = wire::Status::kTimeout;
      } else {
        uint8_t all = wait_for(keys, 0) ? 1 : 0;
        put(&all, 1);
      }
      break;
    }
    case wire::QueryType::kDelete: {
      std::string key = read_string(fd, wire::kMaxKeyBytes, io);
      uint8_t erased;
      {
        std::lock_guard<std::mutex> lock(mu_);
        erased = data_.erase(key) ? 1 : 0;
      }
      put(&erased, 1);
      break;
    }
    case wire::QueryType::kNumKeys: {
      int64_t count;
      {
        std::lock_guard<std::mutex> lock(mu_);
        count = static_cast<int64_t>(data_.size());
      }
      put(&count, 8);
      break;
    }
    default:
      return false;  // unknown query: the stream cannot be trusted any more
  }
  auto st = static_cast<uint8_t>(status);
  net::send_all(fd, &st, 1, io, "store server");
  if (status == wire::Status::kOk && !out.empty()) net::send_all(fd, out.data(), out.size(), io, "store server");
  return true;
}

// ---------------------------------------------------------------------------------------
// Client

class TcpStore::Request {
 public:
  explicit Request(wire::QueryType t) { bytes_.push_back(static_cast<char>(t)); }
  Request& str(const std::string& s) {
    uint32_t len = static_cast<uint32_t>(s.size());
    bytes_.append(reinterpret_cast<const char*>(&len), 4);
    bytes_.append(s);
    return *this;
  }
  Request& str(const Bytes& b) { return str(std::string(b.begin(), b.end())); }
  template <class T>
  Request& pod(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Millis timeout,
                   std::string token, uint32_t generation)
    : host_(host), generation_(generation), token_(std::move(token)), port_(port),
      timeout_(timeout) {
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(host, port, token_, generation);
    port_ = server_->port();
  }
  connect(Deadline(timeout_));
}

void TcpStore::connect(const Deadline& d) {
  std::string connect_host = (host_.empty() || host_ == "0.0.0.0") ? "127.0.0.1"
                             : host_ == "::" ? "::1" : host_;
  // A server flooded with connections that say no hello pushes out the oldest (Note
  // [Connection flood]), sometimes ours before it read our hello: connect again.
  auto backoff = Millis(10);
  for (;;) {
    fd_ = net::connect_to(connect_host, port_, d, "meshcoll store client");
    bool answered;
    try {
      answered = say_hello(d);
    } catch (...) {
      net::close_fd(fd_);
      fd_ = -1;
      throw;
    }
    if (answered) return;
    net::close_fd(fd_);
    fd_ = -1;
    if (d.expired())
      throw PeerError(str_cat(describe(), " closed every connection before answering its hello "
                              "for ", d.timeout().count(), " ms: it is flooded with connections "
                              "that present no token, it has exited, or it is not a meshcoll "
                              "store"));
    int left_ms = d.poll_ms();  // -1: no deadline
    std::this_thread::sleep_for(left_ms < 0 ? backoff : std::min(backoff, Millis(left_ms)));
    backoff = std::min(backoff * 2, Millis(500));
  }
}

// The bytes at the port answer no hello of ours: another program listens there. Said at
// once; waiting for the message length those bytes claim would only end at the timeout.
[[noreturn]] void TcpStore::throw_foreign(const wire::HelloReply& reply) const {
  const auto* b = reinterpret_cast<const unsigned char*>(&reply);
  std::string seen;
  for (size_t i = 0; i < sizeof(reply); ++i)
    seen += (b[i] >= 32 && b[i] < 127) ? std::string(1, static_cast<char>(b[i]))
                                       : str_cat("\\x", "0123456789abcdef"[b[i] >> 4],
                                                 "0123456789abcdef"[b[i] & 15]);
  throw PeerError(str_cat(describe(), " is not a meshcoll store: it answered the hello with '",
                          seen, "...', so another program listens on this port (the master "
                          "port is taken); set another master port (MESHCOLL_MASTER_PORT, "
                          "master_port=, or meshcoll-run --master-port) on every rank"));
}

bool TcpStore::say_hello(const Deadline& d) {
  wire::HelloReply reply{};
  std::string msg;
  try {
    wire::Hello hello{wire::kMagic, wire::kVersion, static_cast<uint16_t>(token_.size()),
                      generation_};
    net::send_all(fd_, &hello, sizeof(hello), d, describe());
    net::send_all(fd_, token_.data(), token_.size(), d, describe());
    net::recv_all(fd_, &reply, sizeof(reply), d, describe());
  } catch (const PeerError&) {
    return false;  // closed or reset before the answer
  }
  if (reply.status > wire::kLastHelloStatus || reply.message_len > wire::kMaxHelloMessageBytes)
    throw_foreign(reply);
  try {
    msg.resize(reply.message_len);
    if (reply.message_len) net::recv_all(fd_, msg.data(), msg.size(), d, describe());
  } catch (const PeerError&) {
    return false;
  }
  if (reply.status != static_cast<uint8_t>(wire::HelloStatus::kOk))
    throw PeerError(str_cat(describe(), ": ", msg));
  return true;
}

TcpStore::~TcpStore() {
  net::close_fd(fd_);
  if (server_) server_->stop();
}

bool TcpStore::close(Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);  // after any call in flight
  if (fd_ >= 0) {
    net::close_fd(fd_);
    fd_ = -1;
    unusable_ = "closed by this process (meshcoll.destroy or close)";
    reconnect_ = false;
  }
  if (!server_) return true;
  server_->stop_accepting();
  bool unused = server_->wait_until_unused(timeout);
  server_->stop();
  return unused;
}

std::string TcpStore::describe() const {
  return str_cat("store at ", net::Endpoint{host_, port_}.str());
}

std::string TcpStore::local_host() const { return net::local_host(fd_); }

Deadline TcpStore::call_deadline(Millis server_wait) const {
  // A waiting call gets the server's wait plus slack for the reply to travel; a short one,
  // so that a stopped store host fails the call about when its own timeout says (Note
  // [Store deadlines]).
  if (server_wait.count() < 0) return Deadline();
  return Deadline(server_wait + std::min(timeout_, Millis(1000)));
}

void TcpStore::recv_exact(void* buf, size_t n, const Deadline& d) {
  try {
    net::recv_all(fd_, buf, n, d, describe());
  } catch (const PeerError&) {
    unusable_ = str_cat(describe(), " closed the connection: the store server (usually rank 0) "
                        "has exited or crashed");
    reconnect_ = false;
    throw PeerError(unusable_);
  } catch (const TimeoutError&) {
    unusable_ = str_cat(describe(), " did not answer within ", d.timeout().count(),
                        " ms: the store server (usually rank 0) is stopped, overloaded or "
                        "unreachable");
    reconnect_ = true;
    throw TimeoutError(unusable_);
  }
}

void TcpStore::send_request(const Request& req, const Deadline& d) {
  if (!unusable_.empty()) {
    if (!reconnect_) throw PeerError(str_cat(describe(), ": connection unusable: ", unusable_));
    net::close_fd(fd_);
    fd_ = -1;
    connect(d);  // on failure, as unusable as before (or more: a closed connection)
    unusable_.clear();
  }
  try {
    net::send_all(fd_, req.bytes().data(), req.bytes().size(), d, describe());
  } catch (const Error&) {
    unusable_ = str_cat(describe(), " closed the connection: the store server (usually rank 0) "
                        "has exited or crashed");
    reconnect_ = false;
    throw PeerError(unusable_);
  }
}

void TcpStore::recv_status(const char* what, const std::string& key, const Deadline& d,
                           Millis waited) {
  uint8_t st = 0;
  recv_exact(&st, 1, d);
  if (st == static_cast<uint8_t>(wire::Status::kTimeout))
    throw TimeoutError(str_cat(describe(), ": ", what, "(", key, ") timed out after ",
                               waited.count(), " ms"));
  if (st == static_cast<uint8_t>(wire::Status::kBadValue))
    throw InvalidArgument(str_cat(describe(), ": ", what, "(", key, "): the key's value is not "
                                  "a decimal int64, or the sum overflows int64"));
  if (st != static_cast<uint8_t>(wire::Status::kOk))
    throw Error(str_cat(describe(), ": ", what, "(", key, ") failed on the server"));
}

void TcpStore::set(const std::string& key, const Bytes& value, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout);
  send_request(Request(wire::QueryType::kSet).str(key).str(value), d);
  recv_status("set", key, d, timeout);
}

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d = call_deadline(timeout);
  send_request(Request(wire::QueryType::kGet).str(key).pod<int64_t>(timeout.count()), d);
  recv_status("get", key, d, timeout);
  uint32_t len = 0;
  recv_exact(&len, 4, d);
  Bytes out(len);
  if (len) recv_exact(out.data(), len, d);
  return out;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout_);
  send_request(Request(wire::QueryType::kAdd).str(key).pod<int64_t>(delta), d);
  recv_status("add", key, d, timeout_);
  int64_t v = 0;
  recv_exact(&v, 8, d);
  return v;
}

Bytes TcpStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout_);
  send_request(Request(wire::QueryType::kCompareSet).str(key).str(expected).str(desired), d);
  recv_status("compare_set", key, d, timeout_);
  uint32_t len = 0;
  recv_exact(&len, 4, d);
  Bytes out(len);
  if (len) recv_exact(out.data(), len, d);
  return out;
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d = call_deadline(timeout);
  Request req(wire::QueryType::kWait);
  req.pod<uint32_t>(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) req.str(k);
  req.pod<int64_t>(timeout.count());
  send_request(req, d);
  std::string names;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) names += (i ? ", " : "") + keys[i];
  if (keys.size() > 8) names += ", ...";
  recv_status("wait", names, d, timeout);
}

bool TcpStore::check(const std::vector<std::string>& keys, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout);
  Request req(wire::QueryType::kCheck);
  req.pod<uint32_t>(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) req.str(k);
  send_request(req, d);
  recv_status("check", "", d, timeout);
  uint8_t all = 0;
  recv_exact(&all, 1, d);
  return all != 0;
}

bool TcpStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout_);
  send_request(Request(wire::QueryType::kDelete).str(key), d);
  recv_status("delete_key", key, d, timeout_);
  uint8_t erased = 0;
  recv_exact(&erased, 1, d);
  return erased != 0;
}

int64_t TcpStore::num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d(timeout_);
  send_request(Request(wire::QueryType::kNumKeys), d);
  recv_status("num_keys", "", d, timeout_);
  int64_t v = 0;
  recv_exact(&v, 8, d);
  return v;
}

}  // namespace meshcoll::store
