// The transport layer: ordered byte messages to one peer, matched by an Envelope.
// TCP implements it (tcp/). Shared memory does not: it is the ground under a second family of
// same-host collectives (shm/, algo/shm_collectives.cc); README.md here says why.
//
// Note [Agreement check]
// Every message carries the Envelope of the operation that sent it: the collective's
// sequence number and an OpDesc (kind, dtype, op, root, count). A receiver compares the
// sender's OpDesc with its own for the same sequence number before any byte lands in user
// memory; a difference means the ranks called different collectives (or the same one with
// different arguments). The receiver then raises MismatchError naming both ranks and both
// calls, and aborts the communicator, which sends an ABORT frame carrying that message to
// every peer so that all ranks raise it within one round trip instead of hanging.
//
// Note [Farewell]
// Over TCP a call may end on a rank before its peers looked at what it sent: a rank whose part
// only sends (a broadcast or scatter root, a reduce or gather leaf, a p2p sender) returns once
// its frames are in the kernel's buffers. If the peers disagree it hears of it at its next call
// (their ABORT, or its own check of a stray frame); if none follows, only at destroy(). Learning
// it before returning would cost every such call a round trip, so destroy() ends with one
// exchange instead: each rank sends every peer a farewell frame (the collectives it ran, the
// messages it sent that peer, the receives it posted from it) and waits for each peer's
// farewell or close, until the group's timeout. TCP keeps order, so once a peer's farewell is
// read so is every frame it sent before: one still buffered was consumed by no call (a
// collective this rank ran with another description, or never ran; a message no recv took),
// and the counts tell the sender whether its sends were all received and the two ranks ran as
// many collectives. An ABORT read meanwhile carries a disagreement that this rank's calls
// returned before hearing of, and is raised too (a timeout or a death was raised by the peers
// that saw it). Each rank of a pair checks from its side, so whichever comes later sees the
// other's farewell: a job whose last call disagreed does not end cleanly on every rank. A peer
// that left without destroy() is no error by itself (what it sent is still checked); one that
// neither says farewell nor closes (stopped) holds destroy() to the timeout, no longer. A peer
// still waiting for this rank in a call reads the farewell as this rank leaving and fails at
// once (PeerError) instead of at its timeout.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "common/deadline.h"

namespace meshcoll::transport {

enum class Channel : uint8_t { kCollective = 0, kP2P = 1 };

// Kinds of error an ABORT frame can carry, so the receiving rank raises the same type.
enum class AbortKind : uint8_t { kGeneric = 0, kMismatch = 1, kTimeout = 2, kPeer = 3 };

#pragma pack(push, 1)
struct OpDesc {
  uint8_t coll = 0;    // algo::CollKind
  uint8_t dtype = 0;   // DType
  uint8_t redop = 0;   // RedOp
  uint8_t algo = 0;   // algorithm code when several exist (all_reduce, reduce, broadcast),
                      // so a rank running another algorithm is a mismatch, not a hang
  int32_t root = -1;
  uint64_t count = 0;  // elements (per rank, as the collective defines it)
  // A fingerprint of what else the result depends on (Note [Fingerprints] in
  // comm/array_view.h): the array's shape (all_gather), a split's counts, a fused block's
  // calls, a composed call's description; 0 where nothing else.
  uint64_t shape = 0;
  // The coalesced block the call was issued in (Note [Coalesced blocks] in comm/backend.h):
  // the group's count of blocks so far, 0 outside one. Ranks must form the same blocks.
  uint64_t block = 0;
  // Where the buffers lie when the kernels depend on it, else 0: on NCCL, a tag of the
  // symmetric windows and offsets of the call's buffers (Note [Symmetric memory]), which
  // must be the same on every rank.
  uint32_t memory = 0;
  // The tree's arity when `algo` is a tree (0: binomial; Note [Trees] in algo/tree.h), so
  // ranks that build different trees disagree instead of waiting on each other; else 0.
  // (A whole 8-byte word keeps the shared-memory slot's payload 8-aligned, and NCCL hashes
  // the struct word by word.)
  uint32_t arity = 0;
  bool operator==(const OpDesc& o) const {
    return coll == o.coll && dtype == o.dtype && redop == o.redop && algo == o.algo &&
           root == o.root && count == o.count && shape == o.shape && memory == o.memory &&
           block == o.block && arity == o.arity;
  }
  bool operator!=(const OpDesc& o) const { return !(*this == o); }
};
#pragma pack(pop)
static_assert(sizeof(OpDesc) == 40, "OpDesc travels on the wire");

struct Envelope {
  Channel channel = Channel::kCollective;
  uint64_t seq = 0;   // collective sequence number; for P2P, the per-peer message count
  uint32_t tag = 0;   // step within a collective; the user tag for P2P
  OpDesc op;
};

// Renders an OpDesc for error messages: "all_reduce(count=1024, float32, sum)".
using DescribeOp = std::string (*)(const OpDesc&);

// One pending send or receive; each transport derives its own state from it.
class Op {
 public:
  virtual ~Op() = default;
  bool complete() const { return complete_; }

 protected:
  bool complete_ = false;
};
using Request = std::shared_ptr<Op>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Start moving bytes; the buffers must stay valid until the request completes.
  virtual Request isend(int peer, const Envelope& env, ConstBytes src) = 0;
  virtual Request irecv(int peer, const Envelope& env, MutBytes dst) = 0;
  // Drive progress until every request completes. Throws TimeoutError naming the peers still
  // pending, MismatchError, PeerError or Aborted; after a throw the transport is aborted.
  virtual void wait_all(const std::vector<Request>& reqs, const Deadline& d) = 0;
  void wait(const Request& r, const Deadline& d) { wait_all({r}, d); }
  // Progress until any of `reqs` completes, `wake_fd` (if >= 0) becomes readable, or the
  // deadline passes; false only at the deadline. Failures throw as in wait_all.
  virtual bool wait_any(const std::vector<Request>& reqs, const Deadline& d, int wake_fd) = 0;
  // One non-blocking pass over every peer: reads what has arrived, so an ABORT frame or a
  // dead peer is noticed even by a rank whose operation only sent (and so never waited).
  virtual void poll_once() = 0;
  // True once the peer's connection has closed (it exited or died) or it destroyed the group
  // (its farewell came: Note [Farewell]).
  virtual bool peer_closed(int peer) const = 0;
  // The collective this rank runs now. Frames of the same sequence number with another
  // OpDesc, or frames of an earlier sequence number (the peer ran a different algorithm or
  // collective), raise MismatchError when they arrive or, if already buffered, at once.
  virtual void begin_collective(const Envelope& current) = 0;
  // Re-checks buffered frames against the current collective (after its OpDesc changed, e.g.
  // once the algorithm is chosen; and while waiting in shared memory).
  virtual void check_unexpected() = 0;
  // destroy()'s closing exchange (Note [Farewell]), waiting for the peers until `d`. Throws
  // MismatchError naming the ranks when calls were left unmatched (a frame no call here
  // consumed, different numbers of collectives, sends never received), or the disagreement a
  // peer's pending ABORT carries. A transport that failed earlier does nothing: its failure
  // was raised already.
  virtual void farewell(const Deadline& d) = 0;
  // Fail every pending request and tell every peer (best effort), then close.
  virtual void abort(AbortKind kind, const std::string& why) = 0;
  virtual bool aborted() const = 0;
};

}  // namespace meshcoll::transport
