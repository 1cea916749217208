// TCP key-value store: a server (one thread per client connection, so a slow or
// malformed client only stalls itself) and a client (one connection, calls serialised).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <system_error>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/store.h"

namespace meshcoll::store {

class TcpStoreServer {
 public:
  // Listens on host:port (0 = any free port). token may be empty (no check).
  TcpStoreServer(const std::string& host, int port, std::string token);
  ~TcpStoreServer();
  int port() const { return port_; }
  // Waits until no authenticated client is connected, or `timeout` passes; true if none is.
  bool wait_until_unused(Millis timeout);
  void stop();

 private:
  void accept_loop();
  void serve(int fd);
  bool handle_one(int fd);  // false when the connection must close
  // Note [Connection flood]. These two need mu_ held.
  bool drop_oldest_unauthenticated();   // false when there is none
  void forget_unauthenticated(int fd);  // its hello was accepted, or it closed
  void wait_ms(int ms);                 // sleeps, woken early by stop(); without mu_

  std::string token_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;

  std::mutex mu_;  // guards data_, client_fds_, unauthenticated_, client_threads_, done_
  std::condition_variable cv_;
  std::map<std::string, Bytes> data_;
  std::vector<int> client_fds_;
  // Connections whose hello has not been accepted yet, oldest first (Note [Connection flood]).
  std::deque<int> unauthenticated_;
  int clients_ = 0;  // connections past the hello, i.e. the store's users
  // Serving threads; finished ones (their id in done_) are joined by the acceptor, so a
  // stream of short connections does not pile up thread stacks.
  std::map<std::thread::id, std::thread> client_threads_;
  std::vector<std::thread::id> done_;
};

class TcpStore : public Store {
 public:
  // is_server: also start a server on host:port (port 0 = pick one) and connect to it.
  TcpStore(const std::string& host, int port, bool is_server, Millis timeout, std::string token);
  ~TcpStore() override;

  using Store::check;
  using Store::set;
  void set(const std::string& key, const Bytes& value, Millis timeout) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  Millis timeout() const override { return timeout_; }

  int port() const { return port_; }
  const std::string& host() const { return host_; }
  // Local address of the connection to the server: the interface that reaches the master.
  std::string local_host() const;
  // Note [Store teardown]
  // Rank 0 hosts the store, and ranks are not in step: rank 0 may be done (its groups made,
  // its calls returned) while others still rendezvous through the store, e.g. for a subgroup
  // without rank 0. So destroy says goodbye instead of just dropping the store: close()
  // closes this client's connection (later calls raise), and a store that hosts the server
  // keeps serving until every other client has closed its connection too (its owner called
  // close, or exited), at most `timeout`, then stops. Returns false if clients were still
  // connected when the timeout passed. This cannot turn into a wait on a peer that waits for
  // us: destroy closes the groups' connections first (Comm::shutdown), so a peer still in a
  // collective with this rank fails at once and leaves.
  bool close(Millis timeout);

 private:
  class Request;
  // Opens fd_ and says hello, connecting again while a flooded server pushes the connection
  // out before answering (Note [Connection flood]); sets nothing else.
  void connect(const Deadline& d);
  // Sends the hello; false when the server closed the connection before answering.
  bool say_hello(const Deadline& d);
  void send_request(const Request& req, const Deadline& d);
  void recv_status(const char* what, const std::string& key, const Deadline& d, Millis waited);
  void recv_exact(void* buf, size_t n, const Deadline& d);
  Deadline call_deadline(Millis server_wait) const;
  std::string describe() const;

  std::string host_;
  std::string token_;
  int port_;
  Millis timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mu_;
  int fd_ = -1;
  // Why the connection cannot carry another call ("": it can): after a client-side timeout
  // the stream is out of step; after close() it is gone.
  std::string unusable_;
  // Unusable after a client-side timeout only: the server may be fine again (it was stopped
  // or overloaded for a while), so the next call opens a new connection.
  bool reconnect_ = false;
};

}  // namespace meshcoll::store
