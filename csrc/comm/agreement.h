// The agreement check of a backend whose data path cannot compare the ranks' calls itself
// (NCCL: the data moves in GPU kernels; MPI: inside the site's library). The call descriptions
// travel instead on a host side channel among the same ranks: a CPU backend (shared memory on
// one host, TCP across hosts).
//
// Note [Agreement on a side channel]
// The backend hands every collective's sequence number and description (the ledger's, Note
// [Call ledger]) to note() at its ordering point. Two modes:
//  - async (the default): note() appends the call to a ring (a copy and one atomic store, no
//    lock, no wait) and returns; a checker thread exchanges fixed-size records with the peers'
//    checkers (one all_gather on the channel per round: how far each rank has issued, and
//    the descriptions of up to kBatch calls not yet compared) and compares each call once
//    every rank has issued it. A disagreement goes to the sink as a MismatchError naming both
//    calls (the NCCL backend aborts its communicator, so no kernel stays stuck, and every
//    rank's next call, wait() or synchronize() raises it). Data of the disagreeing call may
//    already be wrong: async trades that for no host time on the call's path.
//  - strict: note() itself runs a round on the caller's thread before the call is launched,
//    so a disagreement is raised before any rank's data is touched (a channel round per call).
// A round that compared calls is followed by a short pause (Note [Paced rounds]); one that
// compared none by a pause that grows to kIdlePause: a disagreement is found within about
// that pause of the last rank's call. The channel's deadline is the group's timeout while calls
// wait to be compared (a peer that stops answering is then a TimeoutError naming it) and
// unbounded when idle (a job may sit in other code for hours). A dead peer breaks the channel
// at once: a PeerError naming it reaches the sink without waiting for any timeout.
//
// Note [Agreement before launch]
// Some calls must not start on a disagreement even in async mode: a symmetric allocation,
// and any NCCL call on symmetric memory, whose kernels do not end at ncclCommAbort (a rank
// in a symmetric kernel whose peer runs another kernel waits forever, and so does every
// later device synchronize). For those the backend calls await(), which runs rounds on the
// caller's thread until the call is compared: a rank waits there for its peers to issue
// the call (a host-side barrier; their kernels need them anyway), and on one host a round
// is one shared-memory all_gather, a few microseconds. A call on symmetric memory that
// meshcoll's direct kernels run (NCCL, small eager calls: Note [Direct kernels] in
// nccl/direct/direct.h) needs none: those end at an abort and check the call's fingerprint at
// their barrier, writing nothing on a disagreement, as they do for any call.
// The checker's rounds and await()'s take one mutex, so a rank's rounds never overlap;
// rounds pair across ranks by order alone, so one rank's caller round may pair with a
// peer's checker round.
// While a caller awaits, its checker starts no round, and the checker counts as progress
// only what its own rounds compared. Were the callers' progress to reset the checker's pause,
// each checker would run idle rounds back to back while symmetric calls stream: a core per
// rank, and rounds that hold the mutex until every peer joins them, with a record taken
// before the caller issued its call, so the caller needs a further round (see
// docs/performance.md, "2026-11-26 (367e6c7, 959329b): the NCCL agreement check's host cost").
// Note [Paced rounds]
// While calls stream, the checker waits kStreamPause (0.5 ms) after a round that compared
// calls, unless that round compared a full batch (kBatch, so more may wait): a round costs
// about the same for one call as for kBatch. A round at once after any progress would
// compare the few calls issued since the last, and every other one none, at a cost in CPU
// per call (see docs/performance.md, "2026-11-26 (367e6c7, 959329b): the NCCL agreement
// check's host cost"). The choice must be the same on every rank, so it rests on what the
// round compared (the same records everywhere), never on this rank's own backlog: going on
// at once when this rank had issued kBatch calls ahead of the check would let a rank running
// ahead enter each round up to kStreamPause before its paused peers and spin there. The cost of
// the pause: a disagreement is found up to 0.5 ms later; a rank that leaves, and await(), still
// run rounds at once. The records also tell how far each peer has issued: census() names, for a
// timed-out call, the ranks that never issued it and the last call each did issue.
// Leaving (stop(), at destroy): a rank keeps running rounds, marked `leaving`, until every
// call it issued is compared, then stops. Its peers see that in the same round and stop
// too; a call a peer issues after that has no partner left and note() raises at once.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "comm/ledger.h"
#include "common/rank_names.h"

namespace meshcoll::comm {

class Agreement : public std::enable_shared_from_this<Agreement> {
 public:
  enum class Mode { kAsync, kStrict };
  // Called once, from the checker thread (async) or the caller's (strict), with the failure
  // and the first call it voids (0: none in particular).
  using Sink = std::function<void(std::exception_ptr error, uint64_t seq)>;

  // `channel`: a CPU backend among the same ranks, used by this object only. Starts the
  // checker thread in async mode. `ledger`: the checked backend's, to describe its calls in
  // messages.
  // messages. `names`: the members' global ranks, which messages name.
  static std::shared_ptr<Agreement> create(std::shared_ptr<Backend> channel, Mode mode,
                                           Millis timeout, const Ledger& ledger, Sink sink,
                                           RankNames names);
  Agreement(std::shared_ptr<Backend> channel, Mode mode, Millis timeout, const Ledger& ledger,
            Sink sink, RankNames names);
  ~Agreement();
  Agreement(const Agreement&) = delete;
  Agreement& operator=(const Agreement&) = delete;

  // Collective `seq` (consecutive from 1) was issued with description `d`. Strict: raises
  // MismatchError (or the channel's failure) before the call may be launched.
  void note(uint64_t seq, const OpDesc& d);
  // Blocks until every rank issued call `seq` and it agreed, running rounds on this thread
  // (Note [Agreement before launch]). Raises the check's failure, or TimeoutError naming
  // the ranks that never issued it after `timeout` (< 0: the group's).
  void await(uint64_t seq, Millis timeout);
  // Whether call `seq` and every earlier one agreed (no wait).
  bool agreed(uint64_t seq) const {
    return size_ == 1 || checked_.load(std::memory_order_acquire) >= seq;
  }
  // "; rank(s) 1 never issued it (last issued: seq 41, all_reduce(...))" for a call `seq`
  // that timed out, from the last round; "" when every rank had issued it.
  std::string census(uint64_t seq) const;
  // Tells the peers this rank failed the group on purpose (Backend::fail): their checks fail
  // with `message`, and so do their groups, with the type of `like` (PeerError when null):
  // a disagreement found by one rank stays a MismatchError on every rank.
  void relay(const std::string& message, std::exception_ptr like = nullptr) {
    channel_->fail(message, like);
  }
  // Compares what remains (bounded by the timeout), then stops the checker and the channel.
  // `abandon` (the checked group failed already, or is dropped without destroy): compares
  // nothing more; the peers' checks fail with a PeerError saying so (their groups fail too,
  // as they must: this rank left). A checker stuck in a round with a stopped peer is left
  // to end on its own (it holds this object) rather than blocking destroy.
  void stop(bool abandon = false);

  static constexpr size_t kBatch = 64;   // descriptions per record
  static constexpr size_t kRing = 4096;  // calls issued ahead of the checker before note() waits

 private:
  struct Record;
  struct Entry {
    uint64_t seq = 0;
    OpDesc desc;
  };
  void loop();
  // One exchange with every peer; false once no further round can run (a peer left).
  bool round(bool leaving, Millis deadline);
  void fail(std::exception_ptr error, uint64_t seq);
  std::string desc_of(uint64_t seq) const;  // this rank's call `seq`, if still in the ring

  std::shared_ptr<Backend> channel_;
  const Mode mode_;
  const Millis timeout_;
  const Ledger& ledger_;
  Sink sink_;
  const int rank_, size_;
  const RankNames names_;

  std::array<Entry, kRing> ring_{};
  // A round's records and counts, made once: rounds run one at a time (the checker thread,
  // or in strict mode the one thread that issues on the group).
  std::vector<Record> all_;
  const std::vector<size_t> counts_;
  std::atomic<uint64_t> issued_{0};   // written by the issuing thread
  std::atomic<uint64_t> checked_{0};  // every call up to here agreed (written by rounds)
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;          // set before failed_
  // After a peer left: the last call it issued; later calls of this rank have no partner.
  std::atomic<uint64_t> peer_final_{UINT64_MAX};
  std::atomic<int> left_rank_{-1};
  std::atomic<bool> stopped_{false};

  mutable std::mutex census_mu_;
  std::vector<uint64_t> peer_issued_;  // as of the last round
  Clock::time_point last_round_;

  // Held around every round (the checker's, and await()'s on the caller's thread): a rank's
  // rounds on the channel must not overlap (Note [One issuing thread]).
  std::timed_mutex round_mu_;
  // Callers inside await(): while any is, the checker starts no round of its own.
  std::atomic<int> awaiting_{0};
  std::mutex wake_mu_;
  std::condition_variable wake_;
  bool done_ = false;  // the checker has ended (under wake_mu_)
  std::thread checker_;
};

}  // namespace meshcoll::comm
