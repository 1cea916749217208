// The backend contract: every collective and point-to-point operation over array views and
// one CallOptions, returning a Work. The CPU backend (csrc/cpu/), the NCCL backend
// (csrc/nccl/) and the MPI backend (csrc/mpi/) implement it; csrc/python/bind_backend.cc binds it once; the Python
// ProcessGroup holds one and is not subclassed per backend.
//
// Note [Guarantees above the backends]
// The public entry points here are not virtual. Each one checks what every backend needs
// checked (ranks, roots and peers in range, dtypes equal, each array exactly the size the
// collective reads or writes, per-rank counts, x and out overlapping only as the call's
// in-place form: Note [Overlapping buffers] in backend.cc), describes the call (the OpDesc
// every rank compares) and opens its ledger record, then hands the call to the backend's
// do_* method.
// So a check added here holds on every backend and every transport, and no backend can
// skip one. No call state lives in fields between calls: every entry point is re-entrant,
// and calls on different groups may run on different threads at once.
//
// Note [One issuing thread]
// Ranks pair their calls on a group by issue order alone, so two threads issuing on one
// group at once would pair thread A's call on one rank with thread B's on another: crossed
// results, with no error. The calls on one group must therefore be made by one thread at a
// time. Which thread does not matter (a thread pool whose calls follow one another is fine,
// and no thread identity travels with a call), only that issues never overlap. Each entry
// point marks the group with its thread while it issues (an Issue: one CAS in, one store
// out): for a synchronous CPU call the whole call, for an asynchronous or NCCL call the
// enqueue. A thread that finds the mark held by another raises ConcurrentCall and fails the
// group (fail(): the peers raise too), and the holder raises the same error at the end of
// its issue instead of returning a result that may be crossed (the attempt is remembered:
// every later call that would return raises it too).
// An asynchronous call is still being made after its enqueue: until its Work completes it
// can pair with whatever call a peer makes at its place, so a second thread that issues
// meanwhile is as unsafe as one that issues during the enqueue (two threads looping
// all_reduce(x, async_op=True).wait(): their issues never overlap, each thread waits with the
// GIL let go while the other issues; 22-50% of results came back crossed, with no error). So
// the group also remembers the thread that issued its last call (the owner), and the Works
// not yet ended (the ledger's PendingWorks, counted in when queued and out when they end,
// before a waiter can return). A thread that takes the mark after another thread's call
// (the owner's is not this thread: one plain load per call) finds the owner's Works ended,
// and becomes the owner, or finds one pending: it raises ConcurrentCall and fails the group,
// and the pending Works raise the same error when they end instead of their result (the
// count and the intrusion share one atomic word, so each Work ends either before the
// intrusion, with its result, or after it, with the error). Calls that follow one another
// (a pool's, each waited for before the next thread issues) stay allowed. Only Works that
// end on the host are counted: the CPU backend's (the hierarchy's composed calls are one
// operation of the group's own, and so counted). An NCCL call ends on the GPU, where no host
// thread sees it end, and a host check could not tell a crossing from a call handed to
// another thread in program order: NCCL calls are seen only while they enqueue.
// Python threads take turns on the GIL, so two of them looping on one group would
// alternate, each call slotting in while the other thread runs Python, and never be seen
// at once by marks that last only while the GIL is let go. The binding therefore opens the
// Issue before it lets the GIL go and ends it once the GIL is back (the entry point's own
// Issue nests in it): a thread whose call has returned in C++ keeps the mark until it
// holds the GIL again, so any other thread that issues meanwhile is seen. Calls that
// follow one another in the program (each returned to Python before the next is made) are
// never seen as overlapping. What no rank can see is not caught: threads that take turns
// without ever overlapping on a rank (one computes with the GIL let go, in numpy say, while
// the other calls; an async call that completed before the other thread issued; or a rank's
// first calls, before its second thread has come) look like one thread's calls on every rank
// and pair in whatever order each rank made them, until they first overlap on some rank,
// which then fails the group: every rank raises at its next call. Crossing needs no local
// overlap: rank 1 issues B's call then A's while rank 0 issues A's, which pairs with B's and
// completes, before B's; rank 1 sees B's pending when A issues and fails the group, but rank
// 0's first call has already returned a crossed result, and rank 0 raises only at its next
// call. And NCCL enqueues from Python hold the GIL throughout, so two Python threads' NCCL
// calls never overlap and are not seen (a synchronous barrier, which waits, is).
#pragma once

#include <atomic>
#include <exception>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/array_view.h"
#include "comm/ledger.h"
#include "comm/work.h"
#include "common/rank_names.h"
#include "common/deadline.h"
#include "common/dtype.h"
#include "transport/transport.h"  // CallOptions::within

namespace meshcoll::comm {

// How all_reduce, reduce and broadcast pick their algorithm on the CPU backend (codes of
// Algorithm; the NCCL backend takes 0, auto, only: NCCL picks its own).
struct AllReduceTuning {
  uint8_t algorithm = 0;
  uint16_t tree_arity = 0;  // an explicit tree's (Note [Trees] in cpu/algo/tree.h): 0 binomial, k >= 2
  // A hierarchical call's steps (Note [Hierarchy] in python/meshcoll/hierarchy.py): the
  // algorithm of the step of the same collective inside each host (local) and between the
  // hosts' leaders (global); 0: auto.
  uint8_t local_algorithm = 0;
  uint8_t global_algorithm = 0;
  size_t max_segment_bytes = kDefaultMaxSegmentBytes;
  size_t tree_threshold_bytes = kDefaultTreeThresholdBytes;
  size_t hd_threshold_bytes = kDefaultHdThresholdBytes;
};

struct CallOptions {
  Millis timeout{-1};        // < 0: the group's default
  Stream stream = nullptr;   // GPU backends: the caller's stream (nullptr: legacy default)
  Stream wait_for = nullptr; // GPU backends: a stream `stream` must first wait for (the
                             // array's own, when stream= named another); nullptr: none
  // false: the call returns when the operation is done (CPU) or enqueued on `stream` (GPU),
  // and returns no Work. true: it returns a Work at once.
  bool async = false;
  // Point-to-point: the caller waits for the transfer at once (send/recv, not isend/irecv).
  // A backend may then run it to completion itself and return no Work (CPU: Note [Inline
  // execution]); one that returns a Work leaves the wait to the caller.
  bool wait = false;
  AllReduceTuning tuning;    // all_reduce, reduce and broadcast
  // A step of a composed call (the hierarchy's): that call's envelope, whose description and
  // sequence number the step's description carries whole (its block, and a fingerprint of
  // the rest in `shape`), so the steps of calls that differ, or of different calls of the
  // group, never agree (Note [Steps carry their call] in backend.cc); else null.
  const transport::Envelope* within = nullptr;
  // An internal exchange of a composed call (all_gather_v's or all_to_all_v's counts,
  // split's colors): the kind it is described as (Note [Internal exchanges] in
  // common/op_desc.h), in place of all_gather's or all_to_all's; {}: a user's call.
  CollKind exchange{};
};

// One copy of copy_spans(): `bytes` from `src` to `dst`.
struct CopySpan {
  const void* src;
  void* dst;
  size_t bytes;
};

// Memory [lo, hi) used by calls of a coalesced block (Note [Calls of a block are independent]
// in backend.cc): `hi` and the first call's name, kept by `lo`.
struct BlockSpan {
  uintptr_t hi;
  const char* what;
};

class Backend {
 public:
  // `device_memory`: the backend takes CUDA arrays, not host memory.
  Backend(int rank, int size, bool device_memory);
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual const char* name() const = 0;           // "cpu", "nccl"
  virtual std::string transport() const = 0;      // "shm", "tcp (...)", "nccl"
  bool device_memory() const { return device_memory_; }  // a field: asked on every call
  virtual int device() const { return -1; }       // the CUDA device of a GPU backend
  Ledger& ledger() { return ledger_; }
  // How errors name the group's ranks: by their global numbers (`global_ranks`, in group
  // order), and the group by its name. Until set: group ranks. Set once, before the first
  // call (a backend that keeps its own messages takes the names from here: on_identity).
  void set_identity(std::vector<int> global_ranks, const std::string& group);
  const RankNames& names() const { return names_; }
  // "rank 3 (global) of group 'world'": how errors name this rank of the group.
  const std::string& who() const { return who_; }

  // Note [One issuing thread]: this thread's issue of a call on the group, for the Issue's
  // lifetime. It throws ConcurrentCall (after failing the group) if another thread's Issue
  // is open; one opened inside an Issue of the same thread nests in it.
  class Issue {
   public:
    Issue(Backend& b, const char* what);
    ~Issue();
    Issue(const Issue&) = delete;
    Issue& operator=(const Issue&) = delete;
    // Once the call is issued: throws ConcurrentCall if another thread tried to issue on the
    // group meanwhile (or earlier: the group was failed then).
    void check() const;

   private:
    Backend& b_;
    const char* what_;
    bool outer_;  // this Issue set the mark
  };

  // Each returns nullptr for a synchronous call (opts.async false).
  WorkPtr all_reduce(const ArrayView& in, const ArrayView& out, RedOp op, const CallOptions& o);
  WorkPtr reduce(const ArrayView& in, const ArrayView& out, RedOp op, int root,
                 const CallOptions& o);
  WorkPtr broadcast(const ArrayView& buf, int root, const CallOptions& o);
  // counts[r]: elements of rank r's block, placed in rank order. `uneven`: the _v form.
  WorkPtr all_gather(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                     bool uneven, const CallOptions& o);
  // counts[r]: elements rank r keeps.
  WorkPtr reduce_scatter(const ArrayView& in, const ArrayView& out,
                         const std::vector<size_t>& counts, RedOp op, bool uneven,
                         const CallOptions& o);
  WorkPtr all_to_all(const ArrayView& in, const ArrayView& out,
                     const std::vector<size_t>& send_counts,
                     const std::vector<size_t>& recv_counts, bool uneven, const CallOptions& o);
  WorkPtr gather(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                 int root, const CallOptions& o);
  WorkPtr scatter(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                  int root, const CallOptions& o);
  WorkPtr barrier(const CallOptions& o);
  // Point-to-point returns a Work (it completes when the peer has matched it), or none where
  // o.wait let the backend finish the transfer itself.
  WorkPtr send(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o);
  WorkPtr recv(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o);
  // Note [Coalesced blocks]
  // ProcessGroup.coalesced(): the collectives issued between begin_coalesced() and the
  // matching end_coalesced() form one block, which a backend may run as one launch (NCCL:
  // one ncclGroupStart/End, so N small ops cost about one launch; Note [Coalesced blocks on
  // NCCL] in nccl/nccl_ops.cc) or in part at each call (CPU: small synchronous all_reduces
  // fused at the end, Note [Fused all_reduces] in cpu/cpu_backend.cc, the rest at their
  // call). The calls of a block must be independent (Note [Calls of a block are
  // independent] in backend.cc), and the block holds their arrays until it ends. The
  // promises, the same on every backend: a result is ready (on its stream, for a GPU group)
  // once the block has ended; a Work of the block is waited on after it; and what waits for
  // a result inside a block is refused (InvalidArgument): a synchronous barrier here, and in
  // the ProcessGroup the _v calls, whose counts are exchanged first. Blocks nest; the
  // outermost end runs them.
  // Every rank must form the same blocks: NCCL sizes a group's kernels by all of its ops, so
  // an op fused on one rank and alone on another hangs or mixes data. So each collective's
  // description carries its block's number (blocks that issued an op, counted on the group;
  // 0 outside one), and ranks whose blocks differ get MismatchError from the checks that
  // compare descriptions (the agreement check on NCCL, the transport's on the CPU), as for any
  // other difference. A block whose backend could not run it fails the group (fail(): the
  // peers are told).
  void begin_coalesced();
  void end_coalesced(Millis timeout);
  bool coalescing() const { return block_depth_ > 0; }
  // Fails the group as an operation's failure would, after the pending operations: every
  // member raises, with the type of `like` (PeerError when null). For operations composed
  // over several groups (the hierarchy).
  void fail(const std::string& message, std::exception_ptr like = nullptr);
  // Lets issued work finish (each operation's deadline bounds it; an open block's ops run
  // first), then closes the group. Every later call, on any backend, raises AbortedError
  // saying the group was destroyed.
  void shutdown();
  // This group carries another's traffic (the NCCL agreement check's side channel): its
  // destroy() skips the farewell (Note [Farewell] in transport/transport.h), whose failures
  // would be the carried group's to raise, and whose wait its own shutdown bounds otherwise.
  void skip_farewell() { farewell_ = false; }
  // Copies every span within the memory this backend works in: host memory on the CPU
  // backend (memcpy, on the calling thread), device memory on a GPU backend (queued on
  // `stream`, as few launches as it can). The reducer's copies into and out of its buckets
  // (Note [Reducer] in reducer/reducer.h). Spans must not overlap one another.
  virtual void copy_spans(const std::vector<CopySpan>& spans, Stream stream);

 protected:
  bool farewell_ = true;  // skip_farewell() not called
  // A checked, described call: what the do_* methods receive.
  struct Call {
    const char* what;  // the operation's name, static text
    OpDesc desc;
    const CallOptions& opts;
    uint64_t seq = 0;  // the ledger's sequence number, once the backend opened the record
    uint64_t p2p = 0;  // point-to-point: its number in the ledger (Ledger::open_p2p)
    // Owners of the arrays, held by the Work until the operation completed (async only:
    // a synchronous caller holds them itself).
    std::vector<std::shared_ptr<void>> keep;
  };
  virtual void do_shutdown() = 0;
  // Note [Coalesced blocks]: the outermost block begins / ends (default: nothing to do, each
  // op ran at its call).
  virtual void do_begin_coalesced() {}
  virtual void do_end_coalesced(Millis /*timeout*/) {}
  // Backend-specific checks, called before anything is described or sent.
  virtual void check_reduction(DType dt, RedOp op) const = 0;
  virtual void check_options(const char* what, const CallOptions& o) const = 0;

  virtual WorkPtr do_all_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op) = 0;
  virtual WorkPtr do_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op,
                            int root) = 0;
  virtual WorkPtr do_broadcast(Call& c, const ArrayView& buf, int root) = 0;
  virtual WorkPtr do_all_gather(Call& c, const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& counts) = 0;
  virtual WorkPtr do_reduce_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                    const std::vector<size_t>& counts, RedOp op) = 0;
  virtual WorkPtr do_all_to_all(Call& c, const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& send_counts,
                                const std::vector<size_t>& recv_counts) = 0;
  virtual WorkPtr do_gather(Call& c, const ArrayView& in, const ArrayView& out,
                            const std::vector<size_t>& counts, int root) = 0;
  virtual WorkPtr do_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                             const std::vector<size_t>& counts, int root) = 0;
  virtual WorkPtr do_barrier(Call& c) = 0;
  virtual WorkPtr do_send(Call& c, const ArrayView& buf, int peer, uint32_t tag) = 0;
  virtual WorkPtr do_recv(Call& c, const ArrayView& buf, int peer, uint32_t tag) = 0;
  virtual void do_fail(const std::string& message, std::exception_ptr like) = 0;
  // set_identity ran: a backend whose own parts write messages hands them the names.
  virtual void on_identity() {}

 private:
  // `arrays`: the call's input then output ({in, out}), or its one buffer, which it writes
  // unless `reads_only` (send).
  Call open(CollKind kind, const OpDesc& d, const CallOptions& o, const char* what,
            std::initializer_list<const ArrayView*> arrays, bool reads_only = false);
  // Note [Calls of a block are independent]: refuses a call of the open block whose memory
  // another call of the block writes, or that writes memory another call uses; then notes
  // the call's memory.
  void check_block_memory(const char* what, std::initializer_list<const ArrayView*> arrays,
                          bool reads_only);
  void check_root(int root, const char* what) const;
  void check_counts(const std::vector<size_t>& counts, const char* what) const;
  void check_arrays(const char* what, const ArrayView& in, const ArrayView& out) const;
  // Note [Overlapping buffers]: in and out are disjoint or the in-place form, where one
  // starts `in_place_offset` elements into the other (`in_place` says which, for the error;
  // nullptr: the collective has no in-place form, and any overlap is refused).
  void check_overlap(const char* what, const ArrayView& in, const ArrayView& out,
                     size_t in_place_offset, const char* in_place) const;
  // Runs `issue_op` (the do_* call) in an Issue of `c`.
  template <class F>
  WorkPtr issue(const Call& c, F&& issue_op);
  // `when`: how the calls met ("at the same time", ...).
  std::string message_of_concurrent(const char* what, uint64_t other, const char* other_what,
                                    const char* when = "at the same time") const;
  // Note [One issuing thread]: thread `self`, holding the mark, issues `what` after another
  // thread's calls; throws ConcurrentCall (the mark let go, the group failed) if one of them
  // is still pending.
  void take_over(uint64_t self, const char* what);

  int rank_, size_;
  bool device_memory_;
  Ledger ledger_;
  RankNames names_;
  std::string who_;  // "rank 3 (global) of group 'world'"
  // Note [One issuing thread]. Threads are named by pthread_self(), which is Python's
  // threading.get_ident(): errors name them as the user knows them.
  std::atomic<bool> destroyed_{false};  // shutdown() was called: open() refuses calls
  // Note [Coalesced blocks], kept by the issuing thread: open blocks, blocks that issued a
  // collective (their numbers), and whether the open one has.
  int block_depth_ = 0;
  uint64_t blocks_ = 0;
  bool block_used_ = false;
  // The open block's memory, as disjoint [lo, hi) intervals by lo, each with the first call
  // that used it: what its calls write, and what they only read (overlapping reads merged).
  std::map<uintptr_t, BlockSpan> block_writes_, block_reads_;
  std::vector<std::shared_ptr<void>> block_keep_;  // its arrays' owners, until it ends
  std::atomic<uint64_t> issuing_{0};  // the thread issuing a call now, or 0
  // Its operation, for the error only; once it is done, the last operation issued.
  std::atomic<const char*> issuing_what_{""};
  // The thread that issued the last call, whose Works may be pending (ledger_.pending()):
  // read and written under the mark (issuing_).
  uint64_t owner_ = 0;
  std::atomic<uint64_t> intruder_{0};  // a thread that found the mark taken, or 0
  std::atomic<const char*> intruder_what_{""};
};

}  // namespace meshcoll::comm
