// TCP transport, part two: moving frames over the connected mesh. Every message is a
// FrameHeader (magic, type, channel, tag, seq, OpDesc) and its payload; data frames go
// through per-peer send queues and a receive state machine that matches posted receives or
// buffers early frames (capped), probe frames carry the agreement check to silent peers,
// and abort frames spread a failure to every peer. Progress is driven by whichever thread
// waits (poll_and_progress). Connecting and the handshake are in tcp_connect.cc.
#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/interrupt.h"
#include "common/socket.h"
#include "transport/tcp/tcp_peer.h"

namespace meshcoll::transport {

namespace {

constexpr uint32_t kFrameMagic = 0x4654434d;      // "MCTF"
constexpr uint8_t kFrameData = 0;
constexpr uint8_t kFrameAbort = 1;
// Note [Probes]: the agreement check rides on data frames, so two ranks that both wait to
// *receive* first (say a tree all_reduce against a broadcast) would never compare their
// calls. A rank that has waited this long for a collective's data sends each silent peer a
// header-only probe with its OpDesc; a peer running another call at that sequence number,
// or that ran one there (its part only sent), raises MismatchError (and aborts, so both
// learn); one running or having run the same call ignores it.
constexpr uint8_t kFrameProbe = 2;
constexpr auto kProbeAfter = std::chrono::milliseconds(500);
constexpr size_t kMaxAbortMessage = 64 * 1024;
// Note [Farewell] (transport.h says what it does): destroy()'s closing frame. Its payload:
// this rank's collectives, the messages it sent the peer, the receives it posted from it.
constexpr uint8_t kFrameBye = 3;
constexpr size_t kByeBytes = 3 * sizeof(uint64_t);
// Note [Unexpected-message cap]
// Frames that arrive before their receive is posted are buffered. A sender that only sends
// (a broadcast root, a p2p producer) could otherwise run arbitrarily far ahead and grow a
// slow receiver's memory without bound. Past this many buffered bytes from one peer we stop
// reading from it, unless a receive from it is posted (its data may be next in the stream),
// so TCP's own flow control holds the sender back.
constexpr size_t kMaxUnexpectedBytes = 16ull << 20;

}  // namespace

static TcpOp& as_tcp(const Request& r) { return static_cast<TcpOp&>(*r); }

Request TcpTransport::isend(int peer, const Envelope& env, ConstBytes src) {
  if (failed_) rethrow();
  if (later_seq_) check_later_mismatch(env.channel == Channel::kP2P ? kRunning : env.seq);
  auto op = std::make_shared<TcpOp>();
  op->is_send = true;
  op->peer = peer;
  op->env = env;
  op->src = src;
  FrameHeader& h = op->hdr;
  h.magic = kFrameMagic;
  h.type = kFrameData;
  h.channel = static_cast<uint8_t>(env.channel);
  h.tag = env.tag;
  h.seq = env.seq;
  h.nbytes = src.size;
  h.op = env.op;
  Peer& p = *peers_[peer];
  if (env.channel == Channel::kP2P) ++p.p2p_sent;
  p.sendq.push_back(op);
  if (p.sendq.size() == 1) {
    try {
      progress_send(peer);  // eager: small messages leave without waiting for a poll
    } catch (const PeerError& e) {
      fail(AbortKind::kPeer, e.what());
    }
  }
  return op;
}

Request TcpTransport::irecv(int peer, const Envelope& env, MutBytes dst) {
  if (failed_) rethrow();
  if (later_seq_) check_later_mismatch(env.channel == Channel::kP2P ? kRunning : env.seq);
  auto op = std::make_shared<TcpOp>();
  op->peer = peer;
  op->env = env;
  op->dst = dst;
  if (env.channel == Channel::kP2P) ++peers_[peer]->p2p_posted;
  match_posted(peer, op);
  return op;
}

// A new receive first looks among the frames that arrived before it was posted.
void TcpTransport::match_posted(int peer, const Request& r) {
  TcpOp& op = as_tcp(r);
  Peer& p = *peers_[peer];
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    Unexpected& u = **it;
    if (u.claimed || u.hdr.channel != static_cast<uint8_t>(op.env.channel)) continue;
    bool same_seq = u.hdr.seq == op.env.seq;
    if (op.env.channel == Channel::kCollective && same_seq) {
      if (u.hdr.op != op.env.op || u.hdr.tag == op.env.tag)
        check_agreement(peer, u.hdr, op.env, op.dst.size);
      if (u.hdr.tag != op.env.tag) continue;
    } else if (op.env.channel == Channel::kP2P) {
      // Point-to-point messages from one peer match in order.
      check_agreement(peer, u.hdr, op.env, op.dst.size);
    } else {
      continue;
    }
    p.unexpected_bytes -= u.data.size();
    if (u.complete) {
      complete_from_unexpected(u, r);
      p.unexpected.erase(it);
    } else {
      u.claimed = r;
    }
    return;
  }
  p.posted.push_back(r);
}

void TcpTransport::complete_from_unexpected(Unexpected& u, const Request& r) {
  TcpOp& op = as_tcp(r);
  if (!u.data.empty()) std::memcpy(op.dst.data, u.data.data(), u.data.size());
  op.mark_complete();
}

void TcpTransport::check_agreement(int peer, const FrameHeader& h, const Envelope& mine,
                                   size_t my_bytes) {
  auto theirs_env = Envelope{static_cast<Channel>(h.channel), h.seq, h.tag, h.op};
  bool p2p = mine.channel == Channel::kP2P;
  bool differ = p2p ? (h.tag != mine.tag || h.nbytes != my_bytes || h.op != mine.op)
                    : (h.op != mine.op || h.nbytes != my_bytes);
  if (!differ) return;
  std::string msg;
  if (p2p) {
    msg = str_cat("send/recv mismatch between rank ", global_(peer), " and rank ", global_(rank_), ": rank ", global_(peer),
                  " sent ", describe_(h.op), " tag=", h.tag, " (", h.nbytes, " bytes) but rank ",
                  global_(rank_), " posted recv ", describe_(mine.op), " tag=", mine.tag, " (", my_bytes,
                  " bytes); every send must meet a recv of the same tag, shape and dtype, in "
                  "order");
  } else if (h.op != mine.op) {
    msg = str_cat("collective mismatch at sequence number ", mine.seq, ": rank ", global_(peer),
                  " called ", describe_(h.op), " but rank ", global_(rank_), " called ",
                  describe_(mine.op), h.op.shape != mine.op.shape ? " (their shapes, splits or block layouts differ)" : "",
                  "; every rank of a group must call the same collectives, with the same "
                  "count, dtype, op and root, in the same order");
  } else {
    msg = str_cat("collective mismatch at sequence number ", mine.seq, ": rank ", global_(peer), " sent ",
                  h.nbytes, " bytes for step ", h.tag, " of ", describe_(h.op), " but rank ",
                  global_(rank_), " expected ", my_bytes,
                  " bytes (different algorithm settings on different ranks?)");
  }
  (void)theirs_env;
  fail(AbortKind::kMismatch, msg, p2p ? 0 : mine.seq);
}

void TcpTransport::progress_send(int peer) {
  Peer& p = *peers_[peer];
  while (!p.sendq.empty()) {
    TcpOp& op = as_tcp(p.sendq.front());
    const size_t hdr_size = sizeof(FrameHeader);
    const size_t total = hdr_size + op.src.size;
    while (op.sent < total) {
      iovec iov[2];
      int n = 0;
      if (op.sent < hdr_size) {
        iov[n++] = {reinterpret_cast<uint8_t*>(&op.hdr) + op.sent, hdr_size - op.sent};
        if (op.src.size) iov[n++] = {const_cast<uint8_t*>(op.src.data), op.src.size};
      } else {
        size_t off = op.sent - hdr_size;
        iov[n++] = {const_cast<uint8_t*>(op.src.data) + off, op.src.size - off};
      }
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = n;
      ssize_t rc = ::sendmsg(p.fd, &mh, MSG_NOSIGNAL);
      if (rc < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        send_failed(peer, errno);
      }
      op.sent += static_cast<size_t>(rc);
    }
    op.mark_complete();
    p.sendq.pop_front();
  }
}

// A failed send is this rank's own fault (EFAULT: the array is not readable memory, say
// freed) or a broken link. A peer that aborted wrote its ABORT frame, which says why, before
// it closed: read what it sent first, so the error is its reason and not "it died".
void TcpTransport::send_failed(int peer, int err) {
  if (err == EFAULT) {
    std::string msg = str_cat("rank ", global_(rank_), ": the array to send to rank ",
                              global_(peer), " is not readable memory (", errno_text(err),
                              "): rank ", global_(rank_), " passed an array whose memory was "
                              "freed or never mapped");
    abort(AbortKind::kGeneric, msg);
    throw InvalidArgument(msg);
  }
  try {
    progress_recv(peer);  // an ABORT frame fails the transport with the peer's reason
  } catch (const PeerError&) {
    if (failed_) throw;
  }
  throw PeerError(str_cat("rank ", global_(rank_), ": the connection to rank ", global_(peer),
                          " broke while sending to it (", errno_text(err), ") and it sent no "
                          "reason: rank ", global_(peer), " exited or crashed"));
}

void TcpTransport::progress_recv(int peer) {
  Peer& p = *peers_[peer];
  std::string what = str_cat("rank ", global_(rank_), ": receiving from rank ", global_(peer));
  for (;;) {
    ssize_t rc;
    if (!p.in_payload) {
      rc = net::recv_some(p.fd, reinterpret_cast<uint8_t*>(&p.rhdr) + p.rhdr_got,
                          sizeof(FrameHeader) - p.rhdr_got, what);
      if (rc > 0) {
        p.rhdr_got += static_cast<size_t>(rc);
        if (p.rhdr_got == sizeof(FrameHeader)) on_header(peer);
        continue;
      }
    } else {
      rc = net::recv_some(p.fd, p.rdst, p.rleft, what);
      if (rc > 0) {
        p.rdst += rc;
        p.rleft -= static_cast<size_t>(rc);
        if (p.rleft == 0) on_payload_done(peer);
        continue;
      }
    }
    if (rc < 0) return;  // would block
    p.closed = true;
    if (!p.in_payload && p.rhdr_got == 0) return;
    throw PeerError(str_cat("rank ", global_(rank_), ": the connection to rank ", global_(peer),
                            " closed: rank ", global_(peer), " exited, crashed or aborted"));
  }
}

void TcpTransport::on_header(int peer) {
  Peer& p = *peers_[peer];
  const FrameHeader& h = p.rhdr;
  p.rhdr_got = 0;
  if (h.magic != kFrameMagic)
    fail(AbortKind::kGeneric, str_cat("rank ", global_(rank_), ": corrupt frame from rank ", global_(peer),
                                      " (bad magic); is a different program on this port?"));
  p.in_payload = true;
  if (h.type == kFrameProbe) {
    p.rleft = 0;
    if (in_collective_ && h.channel == static_cast<uint8_t>(Channel::kCollective) &&
        h.seq == current_.seq) {
      OpDesc theirs = h.op;
      if (current_.op.algo == 0) theirs.algo = 0, theirs.arity = 0;  // not chosen yet here
      if (theirs != current_.op) check_agreement(peer, h, current_, 0);
    } else if (in_collective_ && h.channel == static_cast<uint8_t>(Channel::kCollective) &&
               h.seq < current_.seq) {
      // About a call this rank finished, its part only sending (a hierarchical broadcast's
      // root, whose steps never met the prober's flat call): a call of another description
      // there is a disagreement the prober would otherwise wait out to its timeout.
      const Envelope& past = recent_[h.seq % 16];
      if (past.seq == h.seq && past.op != h.op) check_agreement(peer, h, past, 0);
    }
  } else if (h.type == kFrameBye) {
    if (h.nbytes != kByeBytes)
      fail(AbortKind::kGeneric, str_cat("rank ", global_(rank_), ": corrupt farewell frame from rank ",
                                        global_(peer), " (", h.nbytes, " bytes)"));
    p.reading_bye = true;
    p.rdst = reinterpret_cast<uint8_t*>(p.bye);
    p.rleft = kByeBytes;
  } else if (h.type == kFrameAbort) {
    p.reading_abort = true;
    p.abort_msg.assign(std::min<uint64_t>(h.nbytes, kMaxAbortMessage), '\0');
    p.rdst = reinterpret_cast<uint8_t*>(p.abort_msg.data());
    p.rleft = p.abort_msg.size();
  } else {
    check_against_current(peer, h);
    Request target;
    for (auto it = p.posted.begin(); it != p.posted.end(); ++it) {
      TcpOp& op = as_tcp(*it);
      if (static_cast<uint8_t>(op.env.channel) != h.channel) continue;
      if (op.env.channel == Channel::kP2P) {
        check_agreement(peer, h, op.env, op.dst.size);
      } else {
        if (op.env.seq != h.seq) continue;
        if (op.env.tag == h.tag || op.env.op != h.op) check_agreement(peer, h, op.env, op.dst.size);
        if (op.env.tag != h.tag) continue;
      }
      target = *it;
      p.posted.erase(it);
      break;
    }
    if (target) {
      p.rtarget = target;
      p.rdst = as_tcp(target).dst.data;
    } else {
      auto u = std::make_unique<Unexpected>();
      u->hdr = h;
      u->data.resize(h.nbytes);
      p.unexpected_bytes += h.nbytes;
      p.runexp = u.get();
      p.rdst = u->data.data();
      p.unexpected.push_back(std::move(u));
    }
    p.rleft = h.nbytes;
  }
  if (p.rleft == 0) on_payload_done(peer);
}

void TcpTransport::on_payload_done(int peer) {
  Peer& p = *peers_[peer];
  p.in_payload = false;
  if (p.reading_abort) {
    p.reading_abort = false;
    const auto kind = static_cast<AbortKind>(p.rhdr.abort_kind);
    // Note [A later call's mismatch]
    const uint64_t mine = in_collective_ ? current_.seq : 0;
    if (kind == AbortKind::kMismatch && p.rhdr.seq > mine) {
      if (!later_seq_ || p.rhdr.seq < later_seq_) {
        later_seq_ = p.rhdr.seq;
        later_msg_ = p.abort_msg;
      }
      return;
    }
    fail(kind, p.abort_msg, p.rhdr.seq);  // relayed with the call it is about (Note above)
  }
  if (p.reading_bye) {
    p.reading_bye = false;
    p.said_bye = true;
    return;
  }
  if (p.rtarget) {
    as_tcp(p.rtarget).mark_complete();
    p.rtarget.reset();
  } else if (p.runexp) {
    Unexpected* u = p.runexp;
    p.runexp = nullptr;
    u->complete = true;
    if (u->claimed) {
      complete_from_unexpected(*u, u->claimed);
      for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
        if (it->get() == u) {
          p.unexpected.erase(it);
          break;
        }
      }
    }
  }
}

TcpTransport::PollResult TcpTransport::poll_and_progress(int timeout_ms, int wake_fd) {
  pfds_.clear();
  pfd_peer_.clear();
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || peers_[j]->fd < 0 || peers_[j]->closed) continue;
    const Peer& p = *peers_[j];
    short ev = p.unexpected_bytes < kMaxUnexpectedBytes || !p.posted.empty() || p.in_payload ||
                       closing_  // the farewell must be read behind whatever is buffered
                   ? POLLIN
                   : 0;
    if (!p.sendq.empty()) ev |= POLLOUT;
    if (!ev) continue;
    pfds_.push_back({p.fd, ev, 0});
    pfd_peer_.push_back(j);
  }
  if (wake_fd >= 0) {
    pfds_.push_back({wake_fd, POLLIN, 0});
    pfd_peer_.push_back(-1);
  }
  int rc = ::poll(pfds_.data(), pfds_.size(), timeout_ms);
  if (rc < 0) {
    if (errno == EINTR) return kProgressed;
    fail(AbortKind::kGeneric, str_cat("rank ", global_(rank_), ": poll failed: ", errno_text(errno)));
  }
  if (rc == 0) return kTimedOut;
  bool woken = false;
  try {
    for (size_t i = 0; i < pfds_.size(); ++i) {
      if (pfd_peer_[i] < 0) {
        woken = pfds_[i].revents != 0;
        continue;
      }
      if (pfds_[i].revents & POLLOUT) progress_send(pfd_peer_[i]);
      if (pfds_[i].revents & (POLLIN | POLLHUP | POLLERR)) progress_recv(pfd_peer_[i]);
    }
  } catch (const PeerError& e) {
    fail(AbortKind::kPeer, e.what());
  }
  return woken ? kWoken : kProgressed;
}

void TcpTransport::poll_once() {
  if (failed_) rethrow();
  if (stop_) stop_->check();
  poll_and_progress(0);
}

bool TcpTransport::peer_closed(int peer) const {
  return peers_[peer]->closed || peers_[peer]->said_bye;
}

void TcpTransport::begin_collective(const Envelope& current) {
  recent_[current_.seq % 16] = current_;
  current_ = current;
  in_collective_ = true;
  if (later_seq_) check_later_mismatch(current.seq);
  check_unexpected();
}

// Note [A later call's mismatch]
// Ranks do not finish a collective together: the last message of a barrier may still be on
// its way to one rank while the others, done, have made their next call and found that they
// disagree on it. The rank that finds it aborts the group, and its ABORT frame reached the
// late rank inside the earlier call, which raised the later call's MismatchError from a call
// that every rank had made alike (meshcoll.init() would raise the MismatchError of the first
// user call). So an ABORT carries the sequence number of the collective it is about (0: none, a
// point-to-point failure), and a MismatchError about a collective later than the one this rank
// runs waits, held here, until this rank reaches that collective (begin_collective), or starts
// or waits for a point-to-point transfer, and is raised there; the call before it runs on. That
// call can finish: the rank that aborted finished every collective before the one it names (a
// rank runs its collectives in order, and a collective's sends complete before it returns), so
// its messages of this call have all arrived before its ABORT, on the same link; every other
// rank either finishes this call too or fails in it, and such a failure names this call and is
// raised at once. Only mismatches wait: a timeout or a dead peer is raised at once wherever it
// lands, since the timeout census needs every rank now and a dead peer may be the one this call
// waits for.
// A rank that fails by a peer's ABORT passes it on to every other peer before it closes, with
// the sequence number the ABORT carried, not the one of the call the relaying rank has reached:
// the relaying rank may be the one that ran another algorithm, so it left the disagreeing call
// without sending what a third rank waits for there. Relayed with its own later number, that
// third rank would hold the mismatch as a later call's and then read the relaying rank's
// close as its death (a PeerError instead of the MismatchError, seen under load).
void TcpTransport::check_later_mismatch(uint64_t seq) {
  if (later_seq_ && (seq == kRunning || seq >= later_seq_))
    fail(AbortKind::kMismatch, later_msg_, later_seq_);
}

void TcpTransport::check_unexpected() {
  for (int j = 0; j < size_; ++j)
    for (const auto& u : peers_[j]->unexpected) check_against_current(j, u->hdr);
}

// Note [Agreement check], for frames no posted receive claims: a frame of the running
// collective must carry its OpDesc, and no frame may belong to one this rank has finished.
void TcpTransport::check_against_current(int peer, const FrameHeader& h) {
  if (!in_collective_ || h.channel != static_cast<uint8_t>(Channel::kCollective)) return;
  OpDesc theirs = h.op;
  if (current_.op.algo == 0) theirs.algo = 0, theirs.arity = 0;  // not chosen yet here
  if (h.seq == current_.seq && theirs != current_.op) {
    check_agreement(peer, h, current_, h.nbytes);
  } else if (h.seq < current_.seq) {
    const Envelope& past = recent_[h.seq % 16];
    if (past.seq == h.seq && past.op != h.op) check_agreement(peer, h, past, h.nbytes);
    // About that earlier collective, where the sender is still (Note [A later call's
    // mismatch]).
    fail(AbortKind::kMismatch,
         str_cat("collective mismatch: rank ", global_(peer), " sent data for ", describe_(h.op),
                 " [seq ", h.seq, "] after rank ", global_(rank_), " had finished its collective of that "
                 "sequence number; the ranks ran different collectives or algorithms (compare "
                 "MESHCOLL_ALGO, algorithm= and the call order on every rank)"),
         h.seq);
  }
}

void TcpTransport::check_pending_peers(const std::vector<Request>& reqs) {
  for (const auto& r : reqs) {
    const TcpOp& op = as_tcp(r);
    // A transfer waits on no collective: a held mismatch is raised (Note [A later call's
    // mismatch]).
    if (later_seq_ && !r->complete() && op.env.channel == Channel::kP2P)
      check_later_mismatch(kRunning);
    if (!r->complete() && peers_[op.peer]->said_bye)  // Note [Farewell]: nothing follows it
      fail(AbortKind::kPeer, str_cat("rank ", global_(rank_), ": rank ", global_(op.peer),
                                     " destroyed the group while a ",
                                     op.is_send ? "send to" : "receive from", " it was pending: rank ",
                                     global_(op.peer), " never made this call, or left it early"));
    if (!r->complete() && peers_[op.peer]->closed)
      fail(AbortKind::kPeer, str_cat("rank ", global_(rank_), ": the connection to rank ", global_(op.peer),
                                     " closed while a ", op.is_send ? "send to" : "receive from",
                                     " it was pending: rank ", global_(op.peer),
                                     " exited, crashed or aborted"));
  }
}

bool TcpTransport::wait_any(const std::vector<Request>& reqs, const Deadline& d, int wake_fd) {
  for (;;) {
    if (failed_) rethrow();
    for (const auto& r : reqs)
      if (r->complete()) return true;
    check_pending_peers(reqs);
    if (stop_) stop_->check();
    int timeout_ms = d.poll_ms();  // naps of kInterruptEvery at most: see the stop request
    if (timeout_ms < 0 || timeout_ms > kInterruptEvery.count())
      timeout_ms = static_cast<int>(kInterruptEvery.count());
    PollResult res = poll_and_progress(timeout_ms, wake_fd);
    if (res == kWoken) return true;
    if (res == kTimedOut && d.expired()) return false;
  }
}

void TcpTransport::send_probes(const std::vector<Request>& reqs) {
  for (const auto& r : reqs) {
    const TcpOp& op = as_tcp(r);
    Peer& p = *peers_[op.peer];
    // Between frames only (nothing queued to that peer), and only for collectives.
    if (r->complete() || op.is_send || op.env.channel != Channel::kCollective ||
        !p.sendq.empty() || p.closed)
      continue;
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.type = kFrameProbe;
    h.channel = static_cast<uint8_t>(Channel::kCollective);
    h.tag = op.env.tag;
    h.seq = op.env.seq;
    h.op = op.env.op;
    try {
      net::send_all(p.fd, &h, sizeof(h), Deadline::after_ms(100), "probe");
    } catch (const Error&) {
    }
  }
}

void TcpTransport::wait_all(const std::vector<Request>& reqs, const Deadline& d) {
  const auto spin_start = Clock::now();
  bool probed = false;
  for (;;) {
    if (failed_) rethrow();
    bool all = true;
    for (const auto& r : reqs) {
      if (!r->complete()) {
        all = false;
        break;
      }
    }
    if (all) return;
    check_pending_peers(reqs);
    check_interrupt(global_(rank_), spin_start);
    if (stop_) stop_->check();
    // Busy-poll briefly before sleeping in poll(): a reply is usually microseconds away, and
    // a wake-up from a blocking poll costs tens of microseconds. Not when ranks outnumber
    // cores: spinning would steal the core the peer needs. Sleeps last at most
    // kInterruptEvery (Note [Interrupts]).
    int timeout_ms = d.poll_ms();
    if (timeout_ms < 0 || timeout_ms > kInterruptEvery.count())
      timeout_ms = static_cast<int>(kInterruptEvery.count());
    const auto waited = Clock::now() - spin_start;
    if (spin_ && waited < std::chrono::microseconds(50)) timeout_ms = 0;
    if (!probed) {
      if (waited >= kProbeAfter) {
        send_probes(reqs);
        probed = true;
      } else {  // wake up when the probe is due (Note [Probes])
        auto left = std::chrono::duration_cast<Millis>(kProbeAfter - waited).count() + 1;
        if (timeout_ms < 0 || left < timeout_ms) timeout_ms = static_cast<int>(left);
      }
    }
    PollResult res = poll_and_progress(timeout_ms);
    // A poll shortened to spin, to run the signal handlers or to probe ends with the
    // deadline still ahead: only an expired deadline is the call's timeout.
    if (res == kTimedOut && !d.expired()) continue;
    if (res == kTimedOut) {
      std::string waiting;
      for (const auto& r : reqs) {
        if (r->complete()) continue;
        const TcpOp& op = as_tcp(r);
        std::string item = str_cat(op.is_send ? "send to rank " : "receive from rank ", global_(op.peer));
        if (waiting.find(item) == std::string::npos) waiting += (waiting.empty() ? "" : ", ") + item;
      }
      fail(AbortKind::kTimeout,
           str_cat("rank ", global_(rank_), " timed out after ", d.timeout().count(),
                   " ms waiting for: ", waiting,
                   "; that rank is slow, stuck in other code, or called a different collective"));
    }
  }
}

void TcpTransport::farewell(const Deadline& d) {
  if (failed_) return;
  closing_ = true;
  for (int j = 0; j < size_; ++j) {
    Peer& p = *peers_[j];
    // Every transfer of this rank has ended (destroy() drained them), so nothing is queued.
    if (j == rank_ || p.fd < 0 || p.closed || !p.sendq.empty()) continue;
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.type = kFrameBye;
    h.nbytes = kByeBytes;
    const uint64_t body[3] = {current_.seq, p.p2p_sent, p.p2p_posted};
    std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
    frame.append(reinterpret_cast<const char*>(body), kByeBytes);
    try {
      net::send_all(p.fd, frame.data(), frame.size(), d, "farewell");
    } catch (const Error&) {  // it left: its frames are read below all the same
    }
  }
  const auto since = Clock::now();
  try {
    for (;;) {
      bool waiting = false;
      for (int j = 0; j < size_; ++j) {
        const Peer& p = *peers_[j];
        if (j != rank_ && p.fd >= 0 && !p.closed && !p.said_bye) waiting = true;
      }
      if (!waiting || d.expired()) break;
      check_interrupt(global_(rank_), since);
      int ms = d.poll_ms();
      if (ms < 0 || ms > kInterruptEvery.count()) ms = static_cast<int>(kInterruptEvery.count());
      poll_and_progress(ms);
    }
  } catch (const Error&) {
    if (!failed_) throw;
  }
  // A peer's mismatch held for a call this rank never reached (Note [A later call's
  // mismatch]): this rank left before it, so it is raised here, as any pending disagreement.
  if (!failed_ && later_seq_) {
    try {
      check_later_mismatch(kRunning);
    } catch (const Error&) {
    }
  }
  if (failed_) {
    // A peer's ABORT. A disagreement (or a peer's bad argument) that this rank's calls returned
    // before hearing of is raised here; a timeout or a death was raised by the peers that saw
    // it, and a peer failed by this rank's own leaving (a call it never made) says so itself.
    if (fail_kind_ != AbortKind::kMismatch && fail_kind_ != AbortKind::kGeneric) return;
    fail_msg_ = str_cat("rank ", global_(rank_), ": destroy() read an error from a peer that this "
                        "rank's calls had returned before hearing of: ", fail_msg_);
    rethrow();
  }
  std::string problems;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    std::string s = unmatched_at_farewell(j);
    if (!s.empty()) problems += (problems.empty() ? "" : "; ") + s;
  }
  if (!problems.empty())
    throw MismatchError(str_cat("rank ", global_(rank_), ": destroy() found calls left unmatched "
                                "on this group: ", problems, ". Every send must meet a recv, and "
                                "every rank must make the same collective calls"));
}

// Note [Farewell]: what the frames still buffered from `peer` and its farewell's counts say
// was never matched; empty when all was.
std::string TcpTransport::unmatched_at_farewell(int peer) {
  const Peer& p = *peers_[peer];
  const int me = global_(rank_), them = global_(peer);
  std::string out;
  auto add = [&out](const std::string& s) { out += (out.empty() ? "" : "; ") + s; };
  bool collective_said = false;
  uint64_t stray = 0;
  std::string tags;
  for (const auto& u : p.unexpected) {
    if (u->claimed) continue;
    const FrameHeader& h = u->hdr;
    if (h.channel == static_cast<uint8_t>(Channel::kP2P)) {
      ++stray;
      const std::string tag = str_cat(h.tag);
      if (tags.find(tag) == std::string::npos) tags += (tags.empty() ? "" : ", ") + tag;
      continue;
    }
    if (collective_said) continue;
    collective_said = true;
    const Envelope& past = recent_[h.seq % 16];
    const Envelope* mine = h.seq == current_.seq ? &current_ : past.seq == h.seq ? &past : nullptr;
    if (h.seq > current_.seq)
      add(str_cat("rank ", them, " sent data for ", describe_(h.op), " [seq ", h.seq, "], a call rank ",
                  me, " never made (it made ", current_.seq, " collective calls)"));
    else if (mine && mine->op != h.op)
      add(str_cat("collective mismatch at sequence number ", h.seq, ": rank ", them, " called ",
                  describe_(h.op), " but rank ", me, " called ", describe_(mine->op)));
    else
      add(str_cat("rank ", them, " sent data for ", describe_(h.op), " [seq ", h.seq, "] that rank ",
                  me, "'s call of it never read (different algorithm settings?)"));
  }
  if (stray)
    add(str_cat("rank ", them, " sent ", stray, " message(s) (tag ", tags, ") to rank ", me,
                " that no recv on rank ", me, " took"));
  if (!p.said_bye) return out;  // it left without destroy(): its frames are all we know
  if (p.bye[0] != current_.seq && !collective_said)
    add(str_cat("rank ", me, " made ", current_.seq, " collective calls on this group but rank ",
                them, " made ", p.bye[0], " (rank ", me, "'s last: ", describe_(current_.op), ")"));
  if (p.p2p_sent > p.bye[2])
    add(str_cat("rank ", me, " sent ", p.p2p_sent, " message(s) to rank ", them, " but rank ",
                them, " posted only ", p.bye[2], " recv(s) from it: the last ",
                p.p2p_sent - p.bye[2], " were never received"));
  return out;
}

void TcpTransport::abort(AbortKind kind, const std::string& why) {
  abort_at(kind, why, in_collective_ ? current_.seq : 0);
}

void TcpTransport::abort_at(AbortKind kind, const std::string& why, uint64_t seq) {
  if (failed_) return;
  failed_ = true;
  fail_kind_ = kind;
  fail_msg_ = why;
  std::string msg = why.substr(0, kMaxAbortMessage);
  for (int j = 0; j < size_; ++j) {
    Peer& p = *peers_[j];
    if (p.fd < 0) continue;
    // An ABORT frame can only go between frames. A peer with a frame half-sent is most
    // likely reading it (it waits in the same operation): finish the frame, briefly, so the
    // ABORT follows and the peer learns the reason (and joins the timeout census) instead
    // of seeing the connection close mid-frame, which reads as this rank's death.
    bool mid_frame = !p.sendq.empty() && as_tcp(p.sendq.front()).sent > 0;
    if (mid_frame) {
      TcpOp& op = as_tcp(p.sendq.front());
      const size_t hdr_size = sizeof(FrameHeader);
      try {
        if (op.sent < hdr_size)
          net::send_all(p.fd, reinterpret_cast<uint8_t*>(&op.hdr) + op.sent, hdr_size - op.sent,
                        Deadline::after_ms(100), "abort");
        size_t off = op.sent < hdr_size ? 0 : op.sent - hdr_size;
        net::send_all(p.fd, op.src.data + off, op.src.size - off, Deadline::after_ms(100),
                      "abort");
        op.sent = hdr_size + op.src.size;
        mid_frame = false;
      } catch (const Error&) {
      }
    }
    if (!mid_frame) {
      FrameHeader h{};
      h.magic = kFrameMagic;
      h.type = kFrameAbort;
      h.abort_kind = static_cast<uint8_t>(kind);
      h.seq = seq;  // Note [A later call's mismatch]
      h.nbytes = msg.size();
      std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
      frame += msg;
      try {
        net::send_all(p.fd, frame.data(), frame.size(), Deadline::after_ms(100), "abort");
      } catch (const Error&) {
      }
    }
    // FIN after the frame (not close): closing with unread input would send a reset that can
    // destroy the ABORT frame before the peer reads it.
    ::shutdown(p.fd, SHUT_WR);
  }
}

void TcpTransport::fail(AbortKind kind, const std::string& why, uint64_t seq) {
  abort_at(kind, why, seq != kRunning ? seq : in_collective_ ? current_.seq : 0);
  rethrow();
}

void TcpTransport::rethrow() const {
  switch (fail_kind_) {
    case AbortKind::kMismatch: throw MismatchError(fail_msg_);
    case AbortKind::kTimeout: throw TimeoutError(fail_msg_);
    case AbortKind::kPeer: throw PeerError(fail_msg_);
    default: throw Error(fail_msg_);
  }
}

}  // namespace meshcoll::transport
