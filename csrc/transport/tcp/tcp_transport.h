// TCP transport: one socket per peer (full mesh), non-blocking, progressed by whichever
// thread waits (the communicator's worker). Frames: FrameHeader + payload.
// tcp_connect.cc builds the mesh (listen, connect, job-token handshake); tcp_transport.cc
// moves frames over it; tcp_peer.h holds the per-peer state both use.
#pragma once

#include <poll.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/interrupt.h"
#include "common/rank_names.h"
#include "store/store.h"
#include "transport/transport.h"

namespace meshcoll::transport {

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t type;        // FrameType
  uint8_t channel;     // Channel
  uint8_t abort_kind;  // AbortKind, for kAbort frames
  uint8_t pad;
  uint32_t tag;
  uint32_t pad2;
  uint64_t seq;
  uint64_t nbytes;  // payload bytes that follow
  OpDesc op;
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 72, "FrameHeader travels on the wire");

struct TcpOptions {
  std::string bind_host;  // address to listen on and advertise (the interface reaching the master)
  std::string token;      // job token every connection must present
  uint64_t comm_id = 0;   // identifies the group, so connections of two groups never mix
  RankNames global;       // how messages name the ranks
  std::shared_ptr<StopRequest> stop;  // checked by every wait (Note [Interrupts])
};

class TcpTransport : public Transport {
 public:
  // Listens, publishes its address under "<prefix>tcp/addr/<rank>" in the store, and connects
  // to every peer before the deadline.
  TcpTransport(int rank, int size, store::Store& store, const TcpOptions& opts,
               DescribeOp describe, const Deadline& d);
  ~TcpTransport() override;

  // Note [Withdrawn ranks]
  // A rank listed in a group that it will not set up (it asked new_group for another
  // backend than its peers did: Note [Agreeing on a new group's request] in
  // python/meshcoll/process_group.py) publishes why in place of its address. A peer waiting
  // for its address, or for its connection, reads that and raises MismatchError with the
  // reason at once, instead of a TimeoutError at its setup deadline.
  static void withdraw(store::Store& store, int rank, const std::string& why, const Deadline& d);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Request isend(int peer, const Envelope& env, ConstBytes src) override;
  Request irecv(int peer, const Envelope& env, MutBytes dst) override;
  void wait_all(const std::vector<Request>& reqs, const Deadline& d) override;
  bool wait_any(const std::vector<Request>& reqs, const Deadline& d, int wake_fd) override;
  void poll_once() override;
  bool peer_closed(int peer) const override;
  void begin_collective(const Envelope& current) override;
  void check_unexpected() override;
  void farewell(const Deadline& d) override;
  void abort(AbortKind kind, const std::string& why) override;
  bool aborted() const override { return failed_; }

 private:
  struct Peer;
  struct Unexpected;
  void connect_all(store::Store& store, const TcpOptions& opts, const Deadline& d);
  // poll() every live peer (and wake_fd, if >= 0) for `timeout_ms` and progress what is
  // ready. Returns kTimedOut, kProgressed or kWoken.
  enum PollResult { kTimedOut, kProgressed, kWoken };
  PollResult poll_and_progress(int timeout_ms, int wake_fd = -1);
  void check_pending_peers(const std::vector<Request>& reqs);
  void send_probes(const std::vector<Request>& reqs);  // Note [Probes]
  void progress_send(int peer);
  [[noreturn]] void send_failed(int peer, int err);
  void progress_recv(int peer);
  void on_header(int peer);
  void on_payload_done(int peer);
  void match_posted(int peer, const Request& op);
  void complete_from_unexpected(Unexpected& u, const Request& op);
  void check_agreement(int peer, const FrameHeader& h, const Envelope& mine, size_t my_bytes);
  void check_against_current(int peer, const FrameHeader& h);
  std::string unmatched_at_farewell(int peer);
  // `seq`: the collective the failure is about, which the ABORT frame carries (Note [A later
  // call's mismatch]); by default the running one (0 outside collectives).
  [[noreturn]] void fail(AbortKind kind, const std::string& why, uint64_t seq = kRunning);
  void abort_at(AbortKind kind, const std::string& why, uint64_t seq);
  [[noreturn]] void rethrow() const;
  // Note [A later call's mismatch]: fails now with a peer's MismatchError that waited for this
  // rank to reach its call, if one did and `seq` (a collective's; kRunning: any other
  // operation) reaches it.
  void check_later_mismatch(uint64_t seq);
  static constexpr uint64_t kRunning = ~uint64_t{0};

  int rank_;
  int size_;
  RankNames global_;
  std::shared_ptr<StopRequest> stop_;
  DescribeOp describe_;
  std::vector<std::unique_ptr<Peer>> peers_;
  bool failed_ = false;
  AbortKind fail_kind_ = AbortKind::kGeneric;
  std::string fail_msg_;
  // Note [A later call's mismatch]: a peer's MismatchError about collective later_seq_ (0:
  // none), held until this rank reaches that collective.
  uint64_t later_seq_ = 0;
  std::string later_msg_;
  bool spin_ = false;      // busy-poll before blocking (ranks <= cores)
  Envelope current_;       // the collective running now (begin_collective)
  Envelope recent_[16];    // the last collectives, by seq % 16, to name a late frame's pair
  bool in_collective_ = false;
  bool closing_ = false;   // in farewell(): read every peer, past the unexpected-message cap
  std::vector<struct pollfd> pfds_;  // reused by every poll
  std::vector<int> pfd_peer_;
};

}  // namespace meshcoll::transport
