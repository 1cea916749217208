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
#include "store/wire.h"

namespace meshcoll::store {

class TcpStoreServer {
 public:
  // Listens on host:port (0 = any free port). token may be empty (no check).
  TcpStoreServer(const std::string& host, int port, std::string token, uint32_t generation = 0);
  ~TcpStoreServer();
  int port() const { return port_; }
  // Waits until no authenticated client is connected, or `timeout` passes; true if none is.
  bool wait_until_unused(Millis timeout);
  // Closes the listening socket and serves only the clients already connected (Note [Store
  // teardown]): a connection made now is refused, and its client retries.
  void stop_accepting();
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
  uint32_t generation_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> accepting_stopped_{false};
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
  // Note [Generations]
  // A rank that destroyed its world and calls init again (the recovery a MismatchError
  // suggests) may reach rank 0's store of the world before, whose keys name listeners that
  // are gone, while rank 0 is still in that world or on its way out. So each process counts
  // its inits (`generation`, from 0), the hello carries it, and a server drops a client of a
  // later generation without answering: the client connects again (Note [Connection flood]'s
  // loop) until the store of its own generation listens. A client of an earlier generation
  // is told so (PeerError): its process made fewer inits than the store's host.
  TcpStore(const std::string& host, int port, bool is_server, Millis timeout, std::string token,
           uint32_t generation = 0);
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
  // collective with this rank fails at once and leaves. The server stops accepting
  // connections first: a rank that destroyed and calls init again must not reach this
  // store, whose keys name the old job's listeners, and so keep it serving; its connection is
  // refused and it retries until rank 0's next store listens on the port.
  bool close(Millis timeout);

 private:
  class Request;
  // Opens fd_ and says hello, connecting again while a flooded server pushes the connection
  // out before answering (Note [Connection flood]); sets nothing else.
  void connect(const Deadline& d);
  // Sends the hello; false when the server closed the connection before answering.
  bool say_hello(const Deadline& d);
  [[noreturn]] void throw_foreign(const wire::HelloReply& reply) const;
  void send_request(const Request& req, const Deadline& d);
  void recv_status(const char* what, const std::string& key, const Deadline& d, Millis waited);
  void recv_exact(void* buf, size_t n, const Deadline& d);
  Deadline call_deadline(Millis server_wait) const;
  std::string describe() const;

  std::string host_;
  uint32_t generation_ = 0;
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
