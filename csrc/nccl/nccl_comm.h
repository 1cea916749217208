// The NCCL communicator of one group: unique id through the store, non-blocking init with a
// deadline, ncclCommSplit for subgroups, every collective, a completion event per op and a
// watchdog that turns a stuck or failed op into TimeoutError / PeerError. Three pieces keep
// their own state as members: the op ring (OpRing, op_ring.h: the slots, the counts of ops
// issued and completed, the coalesced block's staged ops; Note [NCCL streams and Works]), the
// guard on calls stuck inside NCCL (StuckCallGuard, below) and the books of symmetric memory
// (SymmetricWindows, symmetric.h). The communicator asks them; they do not reach back into it.
//
// Note [NCCL failure model]
// The watchdog thread polls ncclCommGetAsyncError and the oldest pending ops' events every
// few milliseconds. An asynchronous NCCL error, or an op still running past its deadline,
// records the first error, calls ncclCommAbort (the kernels exit, so every event
// completes) and marks the communicator dead: ops not finished by then report that error
// (TimeoutError, PeerError or MeshcollError), and so do new calls, with its own type: it may
// have been found while no call was in Python, so the next call is the first to hear of it.
// The agreement check (comm/agreement.h) fails the communicator the same way (fail()), and
// also voids the ops of the disagreeing call and later ones even if they completed. A
// failure no call, wait or synchronize raised is raised by shutdown (destroy). As on the CPU
// backend, a dead group must be rebuilt, and the first failure and whether it reached the
// user are one comm::Failure (Note [Failure types] in comm/failure.h). What is NCCL's own:
// ops carry a voiding point (failed_from_: ops completed before it keep their success), and
// later calls keep the failure's type instead of AbortedError. A call stuck inside NCCL (a
// blocking connection setup or split waiting for a peer) is aborted by the watchdog at its
// deadline too (Note [Stuck calls] in nccl_internal.h). meshcoll's own direct kernels (Note
// [Direct kernels] in direct/direct.h) report failures through host memory and end at the same
// abort. A group is used by one thread at a time, as NCCL
// requires (the backend's entry points check it: Note [One issuing thread] in
// comm/backend.h); one mutex (uncontended on the hot path) orders the caller and the watchdog.
//
// Symmetric memory (windows, SymmetricBlock) is symmetric.{h,cc} (Note [Symmetric memory]).
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/failure.h"
#include "comm/work.h"
#include "common/rank_names.h"
#include "common/deadline.h"
#include "common/dtype.h"
#include "nccl/direct/direct.h"
#include "nccl/nccl_abi.h"
#include "nccl/nccl_api.h"
#include "nccl/op_ring.h"
#include "nccl/symmetric.h"
#include "store/store.h"

namespace meshcoll::nccl {

class NcclComm;

// Where and how one op runs. timeout < 0: the communicator's default.
struct CallOpts {
  abi::CUstream stream = nullptr;  // the caller's stream (nullptr = legacy default)
  bool async = false;
  Millis timeout{-1};
  uint64_t coll_seq = 0;  // the call's collective sequence number (Note [Call ledger]); 0: p2p
  uint64_t p2p = 0;       // a transfer's number in the ledger (Ledger::open_p2p); else 0
  OpDesc desc{};  // the call as the ledger describes it (Note [Call totals])
  // A hash of the call's description and coll_seq, equal on ranks that agree: a direct
  // kernel's token carries it (Note [Direct kernels] in direct/direct.h).
  uint32_t fingerprint = 0;
  // The call's route, decided once by the backend (prepare_direct): a direct kernel takes it
  // if it is launched eagerly (Note [Direct kernels] in direct/direct.h); else NCCL's.
  bool direct = false;
  // The call skipped its agreement before launch because a direct kernel runs it (Note
  // [Agreement before launch] in comm/agreement.h): NCCL's symmetric kernels must not.
  bool direct_only = false;
  // The caller keeps a Work (async ops, point-to-point, a barrier); else the op returns
  // nullptr and costs no allocation (a synchronous collective: its stream orders its result).
  bool want_work = true;
  // Owners of an async op's arrays: its slot holds them until the op completed (or the
  // communicator was aborted), whatever the caller drops.
  std::vector<std::shared_ptr<void>> keep;
};

// The NCCL call in progress that may block inside NCCL waiting for a peer, and its abort
// from another thread (Note [Stuck calls] in nccl_internal.h). The issuing thread enters and
// leaves it holding the communicator's mutex; the watchdog and fail() claim it without that
// mutex (the stuck thread holds it), by moving the deadline to -1.
class StuckCallGuard {
 public:
  // Before the call: its deadline (steady-clock ns; 0: none) and the communicator it runs on.
  void enter(abi::ncclComm_t comm, int64_t deadline_ns) {
    comm_.store(comm, std::memory_order_relaxed);
    deadline_.store(deadline_ns, std::memory_order_release);
  }
  // After it: true when it returned by itself; false when another thread claimed it, once
  // that thread's abort is done (the communicator is aborted).
  bool leave(int64_t deadline_ns) {
    int64_t expect = deadline_ns;
    if (deadline_ns == 0 || deadline_.compare_exchange_strong(expect, 0)) {
      if (deadline_ns == 0) deadline_.store(0, std::memory_order_release);
      return true;
    }
    while (!aborted_.load(std::memory_order_acquire)) std::this_thread::yield();
    deadline_.store(0, std::memory_order_release);
    return false;
  }
  // The watchdog: a call still inside NCCL past its deadline is claimed and its communicator
  // aborted (ncclCommAbort makes the call return). True when it did.
  bool abort_if_expired(int64_t now_ns, const NcclApi& nc) {
    int64_t dl = deadline_.load(std::memory_order_acquire);
    if (!(dl > 0 && now_ns > dl && deadline_.compare_exchange_strong(dl, -1))) return false;
    abort(nc);
    return true;
  }
  // fail() while the issuing thread is inside such a call: leaves `error` (of collective
  // `coll_seq`) for that thread to record in place of a timeout (external()), claims the
  // call and aborts. False when no call is in progress or another thread claimed it first.
  bool abort_for(const std::exception_ptr& error, uint64_t coll_seq, const NcclApi& nc) {
    int64_t dl = deadline_.load(std::memory_order_acquire);
    if (dl <= 0) return false;
    {
      std::lock_guard<std::mutex> el(ext_mu_);
      ext_error_ = error;
      ext_seq_ = coll_seq;
    }
    if (!deadline_.compare_exchange_strong(dl, -1)) return false;
    abort(nc);
    return true;
  }
  // Whether the call in progress was claimed (its NCCL error is the abort's).
  bool claimed() const { return deadline_.load(std::memory_order_acquire) == -1; }
  // What abort_for left: the failure and its collective (null: the watchdog's timeout).
  std::pair<std::exception_ptr, uint64_t> external() {
    std::lock_guard<std::mutex> el(ext_mu_);
    return {ext_error_, ext_seq_};
  }

 private:
  void abort(const NcclApi& nc) {
    nc.comm_abort(comm_.load(std::memory_order_relaxed));
    aborted_.store(true, std::memory_order_release);
  }
  // The deadline (steady-clock ns) of the call in progress, 0 when none, -1 once claimed.
  std::atomic<int64_t> deadline_{0};
  std::atomic<abi::ncclComm_t> comm_{nullptr};
  std::atomic<bool> aborted_{false};
  std::mutex ext_mu_;
  std::exception_ptr ext_error_;
  uint64_t ext_seq_ = 0;
};

class NcclComm : public std::enable_shared_from_this<NcclComm> {
 public:
  // Collective over the group the store is namespaced for: rank 0 makes the unique id and
  // publishes it; every rank initialises on `device` within `timeout`.
  static std::shared_ptr<NcclComm> create(std::shared_ptr<store::Store> store, int rank,
                                          int size, int device, Millis timeout);
  // Whether split() uses ncclCommSplit (NCCL >= 2.18, and MESHCOLL_NCCL_SPLIT is not 0).
  static bool split_supported();
  // Collective over every rank of this communicator: ranks with the same color >= 0 form a
  // new communicator, ordered by key; color < 0 joins none and gets nullptr.
  std::shared_ptr<NcclComm> split(int color, int key, Millis timeout);

  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  abi::CUcontext context() const { return ctx_; }
  Millis timeout() const { return timeout_; }
  // Lets issued work finish (each op's deadline bounds it), then frees the communicator.
  void shutdown();
  // Aborts now (ncclCommAbort); pending ops fail with Aborted.
  void abort(const std::string& why);
  bool failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_.failed();
  }
  void mark_reported() {
    std::lock_guard<std::mutex> lock(mu_);
    failure_.mark_reported();
  }
  // Aborts now with `error` (the agreement check's MismatchError, a dead peer): the op of
  // collective `coll_seq` and every later one report it, even if they completed (their data
  // is void); so do new calls. coll_seq 0: the ops not completed yet.
  void fail(std::exception_ptr error, uint64_t coll_seq);
  // What the backend's agreement check (Note [Agreement on a side channel]) lends the ops;
  // set once, before the first op (unset: no check, every call counts as agreed).
  struct CheckHooks {
    // Appended to a timeout's message: who never reached collective `coll_seq`.
    std::function<std::string(uint64_t coll_seq)> census;
    // Whether every collective up to `coll_seq` is known to agree (no wait).
    std::function<bool(uint64_t coll_seq)> agreed;
    // Blocks until every collective up to `coll_seq` agreed, or raises the check's failure
    // (Note [Results at host synchronization points]).
    std::function<void(uint64_t coll_seq, Millis timeout)> settle;
  };
  void set_check(CheckHooks hooks) { check_ = std::move(hooks); }
  // Told of every op that completed without error, in issue order, by the thread that saw
  // it complete (under the communicator's lock: keep it short): the ledger's record of it
  // ends there (Note [Call totals]).
  using OnDone = OpRing::OnDone;
  void set_on_done(OnDone on_done) {
    std::lock_guard<std::mutex> lock(mu_);
    on_done_ = std::move(on_done);
  }
  // How messages name ranks (global numbers). Set once, before the first op.
  void set_rank_names(RankNames names) { names_ = std::move(names); }

  using WorkPtr = std::shared_ptr<NcclWork>;
  // Counts are in elements; the caller validated buffers against them. `in` may alias `out`.
  WorkPtr all_reduce(const CallOpts& c, const void* in, void* out, size_t count, DType dt, RedOp op);
  WorkPtr reduce(const CallOpts& c, const void* in, void* out, size_t count, DType dt, RedOp op,
                 int root);
  WorkPtr broadcast(const CallOpts& c, void* buf, size_t count, DType dt, int root);
  // counts[r]: elements from rank r, placed in rank order. Equal counts: ncclAllGather;
  // otherwise grouped ncclBroadcast.
  WorkPtr all_gather(const CallOpts& c, const void* in, void* out, const std::vector<size_t>& counts,
                     DType dt);
  // counts[r]: elements rank r keeps. Equal: ncclReduceScatter; otherwise grouped ncclReduce.
  WorkPtr reduce_scatter(const CallOpts& c, const void* in, void* out,
                         const std::vector<size_t>& counts, DType dt, RedOp op);
  // Grouped ncclSend/ncclRecv (every NCCL version has them).
  WorkPtr all_to_all(const CallOpts& c, const void* in, void* out,
                     const std::vector<size_t>& send_counts,
                     const std::vector<size_t>& recv_counts, DType dt);
  WorkPtr gather(const CallOpts& c, const void* in, void* out, const std::vector<size_t>& counts,
                 DType dt, int root);
  WorkPtr scatter(const CallOpts& c, const void* in, void* out, const std::vector<size_t>& counts,
                  DType dt, int root);
  WorkPtr send(const CallOpts& c, const void* buf, size_t count, DType dt, int peer);
  WorkPtr recv(const CallOpts& c, void* buf, size_t count, DType dt, int peer);
  // Collective, once, when the group is made (Note [Direct kernels] in direct/direct.h): sets up
  // meshcoll's direct kernels among the ranks where all of them can use them.
  void setup_direct(Millis timeout);
  // "" when direct kernels are on, else why not.
  std::string direct_unavailable() const;
  // The largest call they take (0: off).
  size_t direct_bytes() const;
  // Compiles the kernel a call of these sizes will run, if a direct one (once per process);
  // before the call is noted to the agreement check, so that a first call's compilation
  // (a fraction of a second) never sits between the note and the launch. True: a direct kernel
  // takes such a call when it is eager (issued outside a block, on a stream not being captured).
  bool prepare_direct(DirectPath::Kind kind, DType dt, RedOp op, size_t count) {
    if (!direct_ || !direct_->takes(kind, dt, op, count)) return false;
    direct_->prepare(kind, dt, op, count);
    return true;
  }
  // Whether a call that prepare_direct() took, issued now on `stream`, runs a direct kernel:
  // no block is open and the stream is not being captured.
  bool direct_now(abi::CUstream stream);
  // A one-element all_reduce; its Work's wait() blocks the host.
  WorkPtr barrier(const CallOpts& c);
  // Orders `waiter` after the work issued so far on `producer` (an event; no host block).
  void order_streams(abi::CUstream producer, abi::CUstream waiter);
  // Collective (Note [Symmetric memory] in symmetric.h): `bytes` of ncclMemAlloc memory on
  // every rank, registered as a symmetric window where NCCL can; zeroed when `zero`. Ranks must
  // pass the same bytes (the backend agrees on it first).
  std::shared_ptr<SymmetricBlock> alloc_symmetric(size_t bytes, bool zero, Millis timeout);
  // "" when this communicator can register symmetric windows, else why not.
  std::string symmetric_unavailable() const;
  // This communicator's windows (tag(), contains()): Note [Symmetric memory].
  const SymmetricWindows& windows() const { return windows_; }
  // Small metadata exchange through device scratch on a private stream: every rank's
  // `bytes` bytes, concatenated in rank order. Blocks the host (bounded by `timeout`).
  // `coll_seq`: the ledger's number of the call it serves (0: setup of the communicator).
  std::vector<uint8_t> host_all_gather(const void* data, size_t bytes, Millis timeout,
                                       uint64_t coll_seq = 0);
  // Note [Coalesced blocks on NCCL]: ops issued between begin_block() and end_block() are
  // staged, and end_block() enqueues them in one ncclGroupStart/End.
  void begin_block();
  // `cancel`: the block must not run (its agreement failed): the communicator fails with it.
  void end_block(Millis timeout, std::exception_ptr cancel = nullptr);

 private:
  friend class NcclWork;
  friend class SymmetricBlock;  // retires itself (windows_.retire) when dropped
  // On the issuing thread, before taking mu_: synchronizes the device (bounded by the
  // timeout: Note [Bounded device synchronize] in symmetric.cc; not under mu_, which the
  // watchdog may need to abort a stuck op), then deregisters and frees the retired blocks.
  void drain_retired();
  // Deregisters every window (shutdown); later drops free their memory themselves. A failed
  // group waits at most kFailedSyncBound for its device to go idle.
  void close_windows_locked();
  static constexpr Millis kFailedSyncBound{2000};
  // Deregisters (while the communicator is usable) and frees dropped blocks; the device is
  // idle already.
  void free_retired_locked(const SymmetricWindows::Retired& retired);

  NcclComm(abi::ncclComm_t comm, int rank, int size, int device, abi::CUcontext ctx,
           Millis timeout);
  static abi::ncclComm_t init_rank(const abi::ncclUniqueId& id, int rank, int size,
                                   abi::CUcontext ctx, const Deadline& deadline,
                                   const std::string& where);

  // Runs `launch(stream)` under the lock with the op's bookkeeping around it; in an open
  // block, stages it (a copy of `launch`: it captures by value).
  template <class Launch>
  WorkPtr run(const CallOpts& c, const char* what, bool host_blocking, Launch&& launch);
  WorkPtr stage_locked(std::unique_lock<std::mutex>& lock, const CallOpts& c, const char* what,
                       bool host_blocking, bool captured, OpRing::Staged op);
  // The caller's stream, or internal_ ordered after it for an async op.
  abi::CUstream exec_stream_locked(abi::CUstream user, bool async);
  // Runs a call that may block inside NCCL, under the watchdog's deadline (Note [Stuck calls]).
  template <class Call>
  abi::ncclResult_t guarded_locked(const Deadline& d, const char* what, Call&& call);
  void check_nccl_locked(abi::ncclResult_t r, const char* what, const Deadline& d);
  void wait_ready_locked(abi::ncclComm_t comm, const Deadline& d, const char* what);
  void usable_locked() const;
  // Launches a direct kernel in place of NCCL's when the backend routed the call there
  // (`direct`, CallOpts) and the op is eager (Note [Direct kernels]); false: NCCL's turn.
  // Raises when the call is `direct_only` yet cannot go direct (its stream began a capture
  // since its agreement was skipped).
  bool try_direct_locked(bool direct, DirectPath::Kind kind, DType dt, RedOp op, const void* in,
                         void* out, size_t count, uint32_t fingerprint, bool direct_only,
                         abi::CUstream s, const Deadline& d);
  // A direct kernel's failure report becomes the communicator's failure (MismatchError,
  // TimeoutError naming the peer). Read wherever an op's completion is observed.
  // no_grace: at shutdown, the agreement check has had its chance.
  void check_direct_locked(bool no_grace = false);
  // shutdown(): the last direct op meets the peers, then the staging buffer is freed.
  void close_direct_locked();
  static constexpr Millis kMismatchGrace{2000};
  // Waits (bounded by d) until the ring has a free slot after `staged` staged ones.
  void claim_slot_locked(std::unique_lock<std::mutex>& lock, const Deadline& d,
                         size_t staged = 0);
  // Ops from index `voids_from` (or not completed yet, whichever is first) report `error`.
  void fail_locked(std::exception_ptr error, uint64_t voids_from = UINT64_MAX);
  void abort_locked();
  // shutdown() of an aborted communicator: releases what it can and raises a failure no
  // call raised.
  void close_failed_locked();
  void poll_locked();  // advances the ring, checks async errors and deadlines
  // The ring's advance (OpRing::advance), telling on_done_ of each op unless the group failed.
  abi::CUresult advance_completed_locked(uint64_t* at);
  void watchdog();
  // NcclWork's questions about op `seq`.
  bool op_done_locked(uint64_t seq, std::exception_ptr* error);
  void op_synchronize(uint64_t seq, Millis timeout);
  void op_stream_wait(uint64_t seq, abi::CUstream stream);
  // Waits for the agreement of every collective up to `coll_seq` (Note [Results at host
  // synchronization points] in op_ring.cc); raises the check's failure.
  void settle(uint64_t coll_seq, Millis timeout);
  // Work.wait/synchronize on op `seq`, staged in the open block: InvalidArgument.
  [[noreturn]] void staged_error(uint64_t seq) const;
  std::string where() const;  // "rank 1 of 4, CUDA device 1"

  const NcclApi& nc_;
  const CudaApi& cu_;
  abi::ncclComm_t comm_;  // nullptr once aborted or destroyed
  int rank_, size_, device_;
  abi::CUcontext ctx_;
  Millis timeout_;
  abi::CUstream internal_ = nullptr;  // async ops
  abi::CUstream meta_ = nullptr;      // host_all_gather only: never waits on user work
  abi::CUevent order_event_ = nullptr;  // caller stream -> internal stream ordering
  abi::CUdeviceptr barrier_buf_ = 0;
  abi::CUdeviceptr scratch_ = 0;
  size_t scratch_bytes_ = 0;

  mutable std::mutex mu_;
  // Note [NCCL streams and Works] (op_ring.h): the ops in flight and the open block's staged
  // ones, under mu_.
  OpRing ring_;
  // The first failure and whether it reached the user (a call, wait or synchronize): Note
  // [Failure types] in comm/failure.h. Mutable: usable_locked() const raises it, marking it
  // reported.
  mutable comm::Failure failure_;
  uint64_t failed_from_ = 0;  // ops at or above this failed with failure_'s error
  bool shut_down_ = false;
  CheckHooks check_;
  OnDone on_done_;
  RankNames names_;

  // Note [Direct kernels]: null until setup_direct turned them on.
  std::unique_ptr<DirectPath> direct_;
  std::string direct_why_ = "not set up (NcclBackend.setup_direct was not called)";
  bool launch_eager_ = false;        // run() is launching an eager op (not captured, not staged)
  uint32_t launched_direct_ = 0;     // the epoch of the direct kernel the launch just issued
  abi::CUevent direct_last_done_ = nullptr;  // the last direct op's completion event
  // A direct kernel met another call: ops from this one wait for the agreement check's
  // verdict until direct_grace_until_ (check_direct_locked).
  uint64_t direct_grace_op_ = UINT64_MAX;
  Clock::time_point direct_grace_until_{};

  // Note [Symmetric memory] (symmetric.h): the windows and dropped blocks, under their own
  // mutex.
  SymmetricWindows windows_;

  StuckCallGuard stuck_;  // Note [Stuck calls]

  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;
  std::thread watchdog_;
};

// DType / RedOp -> NCCL enums; TypeMismatch naming both for pairs NCCL lacks.
abi::ncclDataType_t nccl_dtype(DType t, bool reduction, const NcclApi& api);
abi::ncclRedOp_t nccl_redop(RedOp op, DType t, const NcclApi& api);

}  // namespace meshcoll::nccl
