// The call ledger: what each call of a group is (its description, the one every rank
// compares) and what became of it. It lives above the backends: the Backend entry points
// (backend.cc) describe every call; each backend opens the call's record when it takes the
// call's place in its issue order (under the lock that orders its calls, which it takes
// anyway: no lock of the ledger's own on the hot path).
//
// Note [Call ledger]
// A collective's sequence number is taken here, in issue order, and travels with the call:
// in TCP frames and shared-memory slots (the CPU backend's agreement check), and as the
// index the NCCL backend's side channel compares. The ledger keeps the last kKeep calls of
// the group (description and state) so that a timeout, an error message or a
// MESHCOLL_DEBUG dump reads them instead of rebuilding them. Point-to-point calls are
// recorded too (with their peer) but take no collective sequence number: each pair counts
// its own messages.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "comm/work.h"
#include "common/dtype.h"
#include "common/op_desc.h"

namespace meshcoll::comm {

enum class CallState : uint8_t { kIssued, kDone, kFailed };

// One call as the ledger keeps it. Written by the issuing thread (under the backend's
// issue lock); the state by whichever thread learns how the call ended.
struct CallRecord {
  uint64_t seq = 0;  // collective sequence number; 0 for point-to-point
  int peer = -1;     // point-to-point only
  OpDesc desc;
  CallState state = CallState::kIssued;
  const char* route = "";  // how it was carried ("shm", "tcp", "ring", ...): static text
  // "all_reduce(count=4, float32, sum) [seq 3] done via ring" / "... pending".
  std::string describe() const;
};

// Note [Call totals]
// Per collective kind (point-to-point as kSendRecv), the calls of this rank on the group that
// completed without error: how many, their bytes (count x item size of the call's
// description, which every rank agrees on: an all_gather counts the whole gathered result, a
// send/recv its message) and the time this rank spent running them (from the moment the rank
// began the call, after any wait in the queue, to its end; two clock reads per call), added
// by the thread that saw each end. What ProcessGroup.stats() reports. The CPU backend times
// every call; the NCCL backend's calls end on the GPU, where no host thread times them: they
// add their count and bytes when the communicator sees them complete, and no time.
struct KindTotals {
  CollKind kind;
  uint64_t calls = 0, bytes = 0, nanoseconds = 0;
};

class Ledger {
 public:
  static constexpr size_t kKeep = 64;

  // Opens the record of a collective and returns its sequence number. Called at the point
  // that orders the backend's calls (under the CPU Comm's queue lock; by the one thread an
  // NCCL group allows), so the numbers follow issue order.
  uint64_t open_collective(const OpDesc& d);
  // Records a point-to-point transfer (it takes no collective sequence number) and returns
  // its number, for p2p_state.
  uint64_t open_p2p(const OpDesc& d, int peer);
  // How collective `seq` ended (the CPU worker, or the calling thread when it ran inline),
  // and how it was carried (`route`: static text, or nullptr).
  void set_state(uint64_t seq, CallState s, const char* route = nullptr);
  // How point-to-point transfer `n` (open_p2p's number) ended: the thread that saw it end.
  void p2p_state(uint64_t n, CallState s);
  // Note [Call totals]: a call described by `d` completed without error in `ns` nanoseconds.
  void add_totals(const OpDesc& d, uint64_t ns);
  // The totals of every kind that completed a call, in CollKind order.
  std::vector<KindTotals> totals() const;
  // The last `n` collectives and the last `n` point-to-point transfers, each oldest first.
  std::vector<CallRecord> recent(size_t n = kKeep) const;
  // The last `n` calls on one line, for error messages.
  std::string summary(size_t n) const;
  // Note [One issuing thread] in backend.h: the group's Works that have not ended.
  PendingWorks& pending() { return pending_; }

 private:
  // Note [Ledger without locks on the hot path]: a call costs one slot write and one atomic
  // store; readers (errors, debug dumps) copy slots and may see a slot being rewritten,
  // which costs them a stale line, never a crash (every field is plain data, the tags and
  // the state atomic). Collectives sit at seq % kKeep, so finishing one needs no search.
  struct Slot {
    std::atomic<uint64_t> tag{0};  // seq (collectives) or p2p number; 0 while rewritten
    int peer = -1;
    OpDesc desc;
    std::atomic<uint8_t> state{0};
    std::atomic<const char*> route{""};
  };
  static void write(Slot& r, uint64_t tag, const OpDesc& d, int peer);
  static void read(const Slot& r, CallRecord* out);
  std::array<Slot, kKeep> coll_{};
  std::array<Slot, kKeep> p2p_{};
  std::atomic<uint64_t> next_seq_{1};  // written by the ordering thread only
  std::atomic<uint64_t> next_p2p_{1};
  // Note [Call totals], indexed by CollKind (relaxed atomics: readers may see one call's
  // count before its bytes; a report taken while calls run is approximate anyway).
  struct Totals {
    std::atomic<uint64_t> calls{0}, bytes{0}, ns{0};
  };
  static constexpr size_t kKinds = 16;
  std::array<Totals, kKinds> totals_{};
  PendingWorks pending_;
};

}  // namespace meshcoll::comm
