// TCP transport internals shared by its two halves: the per-peer state (socket, send
// queue, posted receives, frames that arrived early, the receive state machine) and the op
// behind each Request. tcp_connect.cc fills in the sockets; tcp_transport.cc moves frames.
// Private to csrc/transport/tcp/.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "transport/tcp/tcp_transport.h"

namespace meshcoll::transport {

class TcpOp : public Op {
 public:
  bool is_send = false;
  int peer = -1;
  Envelope env;
  ConstBytes src;
  MutBytes dst;
  FrameHeader hdr{};  // sends: the header to write
  size_t sent = 0;    // sends: bytes of header + payload written so far
  void mark_complete() { complete_ = true; }
};

struct TcpTransport::Unexpected {
  FrameHeader hdr{};
  std::vector<uint8_t> data;
  bool complete = false;
  Request claimed;  // a receive posted while this frame was still arriving
};

struct TcpTransport::Peer {
  int fd = -1;
  std::deque<Request> sendq;
  std::deque<Request> posted;  // receives not yet matched to a frame
  std::deque<std::unique_ptr<Unexpected>> unexpected;
  // Receive state machine: a header, then its payload into rdst.
  FrameHeader rhdr{};
  size_t rhdr_got = 0;
  bool in_payload = false;
  uint8_t* rdst = nullptr;
  size_t rleft = 0;
  Request rtarget;
  Unexpected* runexp = nullptr;
  bool reading_abort = false;
  std::string abort_msg;
  // EOF seen: the peer finished (or died). Not an error until a request needs it, since a
  // rank may legitimately exit while others still finish their last step with third ranks.
  bool closed = false;
  size_t unexpected_bytes = 0;  // Note [Unexpected-message cap]
  // Note [Farewell]: point-to-point messages sent to this peer and receives posted from it;
  // its farewell, once read: its collectives and its own two counts, seen from its side.
  uint64_t p2p_sent = 0;
  uint64_t p2p_posted = 0;
  bool reading_bye = false;
  bool said_bye = false;
  uint64_t bye[3] = {0, 0, 0};  // collectives, messages it sent us, receives it posted from us
};

}  // namespace meshcoll::transport
