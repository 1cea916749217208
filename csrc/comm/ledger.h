// The call ledger: what each call of a group is (its description, the one every rank
// compares) and what became of it. It lives above the backends: the Backend entry points
// (backend.cc) describe every call and open its record before dispatch, whatever serves it.
//
// Note [Call ledger]
// A collective's sequence number is taken here, in issue order, and travels with the call:
// in TCP frames and shared-memory slots (the CPU backend's agreement check), and as the
// index the NCCL backend's side channel compares. The ledger keeps the last kKeep calls of
// the group (description, state, times) so that a timeout, an error message or a
// MESHCOLL_DEBUG dump reads them instead of rebuilding them. Point-to-point calls are
// recorded too (with their peer) but take no collective sequence number: each pair counts
// its own messages.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/dtype.h"
#include "transport/transport.h"

namespace meshcoll::comm {

// Collective kinds, as they travel in OpDesc.coll.
enum class CollKind : uint8_t {
  kAllReduce = 1,
  kReduce,
  kBroadcast,
  kAllGather,
  kAllGatherV,
  kReduceScatter,
  kReduceScatterV,
  kAllToAll,
  kAllToAllV,
  kGather,
  kScatter,
  kBarrier,
  kSendRecv,  // point-to-point
  kFail,      // Backend::fail: the group is failed on purpose (a relayed failure)
};
const char* coll_name(CollKind k);
// "all_reduce(count=1024, float32, sum)": for error messages and logs.
std::string describe_op(const transport::OpDesc& d);
transport::OpDesc make_desc(CollKind k, DType dt, size_t count, RedOp op = RedOp::kSum,
                            int root = -1);

enum class CallState : uint8_t { kIssued, kRunning, kDone, kFailed };

struct CallRecord {
  uint64_t id = 0;   // every call of the group, from 1
  uint64_t seq = 0;  // collective sequence number; 0 for point-to-point
  int peer = -1;     // point-to-point only
  transport::OpDesc desc;
  CallState state = CallState::kIssued;
  Clock::time_point issued, finished;
  std::string describe() const;  // "all_reduce(count=4, float32, sum) [seq 3] done in 12 us"
};

class Ledger {
 public:
  static constexpr size_t kKeep = 64;

  // Opens the record of a collective and returns its sequence number.
  uint64_t open_collective(const transport::OpDesc& d);
  // Opens the record of a point-to-point transfer; returns its call id.
  uint64_t open_p2p(const transport::OpDesc& d, int peer);
  // The collective `seq` started running / ended (for the CPU backend's worker; a GPU
  // backend marks calls done as it learns of their completion).
  void set_state(uint64_t seq, CallState s);
  // The last `n` calls, oldest first.
  std::vector<CallRecord> recent(size_t n = kKeep) const;
  // One line per call, for error messages: "last calls of rank 1: ...".
  std::string summary(size_t n) const;
  uint64_t last_seq() const;

 private:
  CallRecord& slot(uint64_t id) { return ring_[id % kKeep]; }
  mutable std::mutex mu_;
  std::array<CallRecord, kKeep> ring_{};
  uint64_t next_id_ = 1;
  uint64_t next_seq_ = 1;
};

}  // namespace meshcoll::comm
