#include "comm/backend.h"

#include <pthread.h>

#include <cstring>

#include "common/error.h"
#include "common/host_timers.h"

namespace meshcoll::comm {

Backend::Backend(int rank, int size, bool device_memory)
    : rank_(rank), size_(size), device_memory_(device_memory), who_(str_cat("rank ", rank)) {}

void Backend::set_identity(std::vector<int> global_ranks, const std::string& group) {
  names_ = RankNames(std::move(global_ranks));
  who_ = str_cat("rank ", names_(rank_), " (global) of group '", group, "'");
  on_identity();
}

Backend::Issue::Issue(Backend& b, const char* what) : b_(b), what_(what) {
  const uint64_t self = static_cast<uint64_t>(pthread_self());
  // Nested in this thread's own Issue (only this thread writes `self` there): a plain load,
  // so a call from Python pays one CAS, not two.
  outer_ = b.issuing_.load(std::memory_order_relaxed) != self;
  if (!outer_) return;
  uint64_t holder = 0;
  if (b.issuing_.compare_exchange_strong(holder, self, std::memory_order_acquire)) {
    if (b.owner_ != self) b.take_over(self, what);
    b.issuing_what_.store(what, std::memory_order_relaxed);
    return;
  }
  const char* holder_what = b.issuing_what_.load(std::memory_order_relaxed);
  b.intruder_what_.store(what, std::memory_order_relaxed);  // for the holder's error
  b.intruder_.store(self, std::memory_order_release);
  const std::string msg = b.message_of_concurrent(what, holder, holder_what);
  b.fail(msg);  // behind the holder's call, already under way: then every rank fails
  throw ConcurrentCall(msg);
}

Backend::Issue::~Issue() {
  if (outer_) b_.issuing_.store(0, std::memory_order_release);
}

void Backend::Issue::check() const {
  if (const uint64_t other = b_.intruder_.load(std::memory_order_acquire))
    throw ConcurrentCall(b_.message_of_concurrent(
        what_, other, b_.intruder_what_.load(std::memory_order_relaxed)));
}

void Backend::take_over(uint64_t self, const char* what) {
  PendingWorks& pending = ledger_.pending();
  if (!pending.none()) {
    const char* owner_what = issuing_what_.load(std::memory_order_relaxed);
    const std::string msg = message_of_concurrent(what, owner_, owner_what,
                                                  "and it had not completed");
    // What the owner's pending Works raise: the owner's side of the same error.
    auto theirs = std::make_exception_ptr(ConcurrentCall(message_of_concurrent(
        owner_what, self, what, "before this thread's calls on it had completed")));
    if (pending.intrude(theirs)) {
      intruder_what_.store(what, std::memory_order_relaxed);  // the owner's next calls raise
      intruder_.store(self, std::memory_order_release);
      issuing_.store(0, std::memory_order_release);  // the Issue throws: no destructor
      fail(msg);  // behind the pending calls: then every rank fails
      throw ConcurrentCall(msg);
    }
  }
  owner_ = self;
}

template <class F>
WorkPtr Backend::issue(const Call& c, F&& issue_op) {
  Issue issue(*this, c.what);
  host_timers::mark(host_timers::kIssued);
  WorkPtr w = issue_op();
  issue.check();
  return w;
}

std::string Backend::message_of_concurrent(const char* what, uint64_t other,
                                           const char* other_what, const char* when) const {
  return str_cat(who_, ": ", what, ": another thread (id ", other, ") issued ", other_what,
                 " on this group ", when, "; calls on one group must be made by one thread "
                 "at a time (an async call's until its Work completed), in the same order on "
                 "every rank: use one group per thread (new_group). The group is failed on "
                 "every rank: destroy it");
}

namespace {
// Elements before rank r's block.
size_t offset_of(const std::vector<size_t>& counts, int r) {
  size_t n = 0;
  for (int i = 0; i < r; ++i) n += counts[i];
  return n;
}

size_t total(const std::vector<size_t>& v) {
  size_t n = 0;
  for (size_t x : v) n += x;
  return n;
}

ShapeHash hash_of(const std::vector<size_t>& counts) {
  ShapeHash h;
  for (size_t c : counts) h.mix(c);
  return h;
}

// "x has 6 elements but ..." for size errors.
[[noreturn]] void size_error(const char* what, const char* name, size_t got, size_t want,
                             const char* why) {
  throw InvalidArgument(str_cat(what, ": ", name, " has ", got, " elements but ", why, " ", want,
                                "; pass an array of exactly that size"));
}
}  // namespace

void Backend::check_root(int root, const char* what) const {
  if (root < 0 || root >= size_)
    throw InvalidArgument(str_cat(what, ": root ", root, " is out of range for a group of ",
                                  size_, " ranks (0..", size_ - 1, ")"));
}

void Backend::check_counts(const std::vector<size_t>& counts, const char* what) const {
  if (counts.size() != static_cast<size_t>(size_))
    throw InvalidArgument(str_cat(what, ": ", counts.size(), " per-rank counts for a group of ",
                                  size_, " ranks"));
}

void Backend::check_arrays(const char* what, const ArrayView& in, const ArrayView& out) const {
  if (in.dtype != out.dtype)
    throw TypeMismatch(str_cat(what, ": out has dtype ", dtype_name(out.dtype), " but x has ",
                               dtype_name(in.dtype), "; pass an out of x's dtype"));
}

// Note [Overlapping buffers]
// One rule for every collective that takes an x and an out: they do not overlap, or they
// overlap exactly as the call's in-place form, if it has one: the same array (all_reduce,
// reduce), x = out's block of this rank (all_gather, and gather on the root), out = x's
// block of this rank (reduce_scatter, and scatter on the root). Every backend runs those
// right (NCCL takes them as its own in-place form and skips a copy; a rank's own block is
// the one it copies onto itself). all_to_all has none: every block of out is written while
// x's blocks may still be read by the transfers to other ranks. Any other overlap would read
// data the call already overwrote, here or (scatter, all_to_all) on the rank it is sent to:
// InvalidArgument, before anything is sent. The check runs on each rank on its own arrays
// (a rooted call's arrays that only the root uses, on the root), so a rank that refuses is
// one that passed the overlap; its peers, which made the call, wait for it as for any rank
// whose argument was refused (a bad dtype, say): they get its retry, the MismatchError of
// its next call, or a TimeoutError naming it.
void Backend::check_overlap(const char* what, const ArrayView& in, const ArrayView& out,
                            size_t in_place_offset, const char* in_place) const {
  const auto a = reinterpret_cast<uintptr_t>(in.data);
  const auto b = reinterpret_cast<uintptr_t>(out.data);
  const size_t es = dtype_size(in.dtype);
  const size_t na = in.count * es, nb = out.count * es;
  const size_t off = in_place_offset * es;
  if (!na || !nb || a + na <= b || b + nb <= a) return;  // disjoint
  if (in_place &&
      ((a == b + off && a + na <= b + nb) || (b == a + off && b + nb <= a + na)))
    return;
  if (!in_place)
    throw InvalidArgument(str_cat(who_, ": ", what, ": x and out overlap, and ", what,
                                  " has no in-place form (each block of out is written while "
                                  "x is still being sent); pass a separate out, sharing no "
                                  "memory with x"));
  throw InvalidArgument(str_cat(who_, ": ", what, ": x and out overlap but are not the in-place "
                                "form (", in_place, "); pass separate arrays, or exactly that"));
}

namespace {
using Spans = std::map<uintptr_t, BlockSpan>;

// The span of `m` that overlaps [lo, hi), or m.end().
Spans::const_iterator overlapping(const Spans& m, uintptr_t lo, uintptr_t hi) {
  auto it = m.upper_bound(lo);
  if (it != m.begin() && std::prev(it)->second.hi > lo) return std::prev(it);
  if (it != m.end() && it->first < hi) return it;
  return m.end();
}

// Adds [lo, hi) to `m`, merging the spans it overlaps (they keep the first call's name).
void add_span(Spans& m, uintptr_t lo, uintptr_t hi, const char* what) {
  for (auto it = overlapping(m, lo, hi); it != m.end(); it = overlapping(m, lo, hi)) {
    if (it->first < lo) {
      lo = it->first;
      what = it->second.what;
    }
    hi = std::max(hi, it->second.hi);
    m.erase(it);
  }
  m.emplace(lo, BlockSpan{hi, what});
}
}  // namespace

// Note [Calls of a block are independent]
// A coalesced block's calls run together: NCCL enqueues them in one group, whose kernels
// may run them in any order or at once, so a call that reads what another call of the block
// writes (or two that write the same memory) would give a result that depends on the
// schedule: all_reduce(x) twice in one block does not sum twice. Every backend refuses such
// a call (InvalidArgument), the CPU one too, though it runs each call at once: a program
// must mean the same on every backend. A call's own input and output may overlap as its
// in-place form allows (check_overlap); reads of the same memory by several calls are fine.
// The check costs two map lookups per array, in blocks only.
void Backend::check_block_memory(const char* what, std::initializer_list<const ArrayView*> arrays,
                                 bool reads_only) {
  struct Use {
    uintptr_t lo, hi;
    bool writes;
  };
  Use uses[2];
  size_t n = 0;
  for (const ArrayView* a : arrays) {
    const bool writes = !reads_only && (arrays.size() == 1 || a == *(arrays.end() - 1));
    const auto lo = reinterpret_cast<uintptr_t>(a->data);
    if (!a->bytes() || n == 2) continue;
    if (n == 1 && uses[0].lo == lo && uses[0].hi == lo + a->bytes()) {  // in place: one use
      uses[0].writes = uses[0].writes || writes;
      continue;
    }
    uses[n++] = Use{lo, lo + a->bytes(), writes};
  }
  for (size_t i = 0; i < n; ++i) {
    const Use& u = uses[i];
    auto w = overlapping(block_writes_, u.lo, u.hi);
    const bool by_write = w != block_writes_.end();
    auto r = by_write || !u.writes ? block_reads_.end() : overlapping(block_reads_, u.lo, u.hi);
    if (!by_write && r == block_reads_.end()) continue;
    const char* other = by_write ? w->second.what : r->second.what;
    throw InvalidArgument(str_cat(
        who_, ": ", what, " in a coalesced block ", u.writes ? "writes" : "reads",
        " memory that an earlier ", other, " of the block ", by_write ? "writes" : "reads",
        ": a block's calls run together, in no set order (NCCL enqueues them as one group), "
        "so none may use another's result; end the block before this call"));
  }
  for (size_t i = 0; i < n; ++i)
    add_span(uses[i].writes ? block_writes_ : block_reads_, uses[i].lo, uses[i].hi, what);
}

Backend::Call Backend::open(CollKind kind, const OpDesc& d, const CallOptions& o,
                            const char* what, std::initializer_list<const ArrayView*> arrays,
                            bool reads_only) {
  if (destroyed_.load(std::memory_order_acquire))
    throw Aborted(str_cat(who_, ": ", describe_op(d), " was called on a destroyed group; make "
                          "a new group to go on"));
  if (device_memory_)
    for (const ArrayView* a : arrays)
      if (a->device >= 0 && a->device != device())
        throw InvalidArgument(str_cat(what, ": the array is on CUDA device ", a->device,
                                      " but this group's communicator uses device ", device()));
  check_options(what, o);
  if (block_depth_) check_block_memory(what, arrays, reads_only);
  Call c{what, d, o, {}};
  if (block_depth_ && kind != CollKind::kSendRecv) {  // Note [Coalesced blocks]
    if (!block_used_) ++blocks_;
    block_used_ = true;
    c.desc.block = blocks_;
  }
  // Note [Steps carry their call]
  // A composed call (the hierarchy's) runs as steps on other groups (local shared memory,
  // then the hosts' leaders), each described by its own arguments. Which steps a rank runs,
  // and with which roots and counts, follows from the call's arguments and the rank's host,
  // so ranks that disagree on the call may still run steps that agree: a rank on another
  // host than the root that names another root on the root's host runs the same local
  // broadcast as its host's peers and silently takes their data; a block's calls split one
  // total differently sum misaligned data. So every step's description carries the whole
  // call's: its coalesced block, and a fingerprint of everything else the ranks must agree
  // on (kind, dtype, op, root, count, layout, block) mixed into `shape`, with the call's
  // sequence number in the group: a rank whose part of a flat call only sent (a reduce
  // leaf) goes on to the group's next call, and were that one hierarchical its steps would
  // otherwise pair with the steps of the call the others still run. Steps then agree
  // only where the calls they serve agree, and a disagreement is a MismatchError in the
  // first step the disagreeing ranks share (run_steps in cpu/hierarchy.cc names the call).
  if (o.within) {
    const OpDesc w = o.within->op;  // a copy: the struct is packed
    c.desc.block = w.block;
    ShapeHash h;
    for (uint64_t v : {c.desc.shape, uint64_t{w.coll}, uint64_t{w.dtype}, uint64_t{w.redop},
                       uint64_t{static_cast<uint32_t>(w.root)}, w.count, w.shape, w.block,
                       o.within->seq})
      h.mix(v);
    c.desc.shape = h.value();
  }
  // Point-to-point returns a Work even when synchronous: its owners ride with it too.
  if (o.async || kind == CollKind::kSendRecv)
    for (const ArrayView* a : arrays)
      if (a->owner) c.keep.push_back(a->owner);
  // The block holds every array of its calls until it ends: a call may run only then (NCCL),
  // and memory freed and reused within the block would look like one call using another's.
  if (block_depth_)
    for (const ArrayView* a : arrays)
      if (a->owner && (block_keep_.empty() || block_keep_.back() != a->owner))
        block_keep_.push_back(a->owner);
  return c;
}

void Backend::begin_coalesced() {
  if (destroyed_.load(std::memory_order_acquire))
    throw Aborted(str_cat(who_, ": coalesced() on a destroyed group; make a new group to go on"));
  if (block_depth_ == 0) {
    do_begin_coalesced();
    block_used_ = false;
    block_writes_.clear();
    block_reads_.clear();
    block_keep_.clear();
  }
  ++block_depth_;
}

void Backend::end_coalesced(Millis timeout) {
  if (block_depth_ == 0) {
    if (destroyed_.load(std::memory_order_acquire)) return;  // shutdown() ran the block
    throw InvalidArgument(str_cat(who_, ": end_coalesced without an open coalesced block"));
  }
  if (--block_depth_ > 0) return;
  // Enqueued (or failed), the block's calls are ordered by their streams, as any synchronous
  // call's, or held by their Works: the block lets its arrays go on the way out.
  std::vector<std::shared_ptr<void>> arrays = std::move(block_keep_);
  Issue issue(*this, "end of a coalesced block");  // it issues the block's ops
  try {
    do_end_coalesced(timeout);
    issue.check();
  } catch (const InvalidArgument& e) {
    // Its ops never ran here, and peers that ran theirs wait for them: tell them.
    fail(str_cat(who_, ": its coalesced block could not run: ", e.what()));
    throw;
  }
}

void Backend::copy_spans(const std::vector<CopySpan>& spans, Stream /*stream*/) {
  for (const CopySpan& s : spans) std::memcpy(s.dst, s.src, s.bytes);
}

void Backend::shutdown() {
  if (block_depth_) {  // destroy() inside a block: the block's ops are issued, so run them
    block_depth_ = 1;
    try {
      end_coalesced(Millis(-1));
    } catch (...) {  // the group failed: do_shutdown reports it
    }
  }
  destroyed_.store(true, std::memory_order_release);
  do_shutdown();
}

WorkPtr Backend::all_reduce(const ArrayView& in, const ArrayView& out, RedOp op,
                            const CallOptions& o) {
  const char* what = "all_reduce";
  check_arrays(what, in, out);
  if (out.count != in.count) size_error(what, "out", out.count, in.count, "x has");
  check_overlap(what, in, out, 0, "out is x");
  check_reduction(in.dtype, op);
  Call c = open(CollKind::kAllReduce, make_desc(CollKind::kAllReduce, in.dtype, in.count, op), o,
                what, {&in, &out});
  return issue(c, [&] { return do_all_reduce(c, in, out, op); });
}

WorkPtr Backend::reduce(const ArrayView& in, const ArrayView& out, RedOp op, int root,
                        const CallOptions& o) {
  const char* what = "reduce";
  check_arrays(what, in, out);
  check_root(root, what);
  if (rank_ == root && out.count != in.count) size_error(what, "out", out.count, in.count, "x has");
  if (rank_ == root) check_overlap(what, in, out, 0, "out is x");
  check_reduction(in.dtype, op);
  Call c = open(CollKind::kReduce, make_desc(CollKind::kReduce, in.dtype, in.count, op, root), o,
                what, {&in, &out});
  return issue(c, [&] { return do_reduce(c, in, out, op, root); });
}

WorkPtr Backend::broadcast(const ArrayView& buf, int root, const CallOptions& o) {
  const char* what = "broadcast";
  check_root(root, what);
  Call c = open(CollKind::kBroadcast,
                make_desc(CollKind::kBroadcast, buf.dtype, buf.count, RedOp::kSum, root), o, what,
                {&buf});
  return issue(c, [&] { return do_broadcast(c, buf, root); });
}

WorkPtr Backend::all_gather(const ArrayView& in, const ArrayView& out,
                            const std::vector<size_t>& counts, bool uneven, const CallOptions& o) {
  const CollKind kind = o.exchange != CollKind{} ? o.exchange
                        : uneven                  ? CollKind::kAllGatherV
                                                  : CollKind::kAllGather;
  const char* what = coll_name(kind);
  check_arrays(what, in, out);
  check_counts(counts, what);
  if (in.count != counts[rank_]) size_error(what, "x", in.count, counts[rank_], "its count is");
  if (out.count != total(counts)) size_error(what, "out", out.count, total(counts), "the counts add up to");
  check_overlap(what, in, out, offset_of(counts, rank_), "x is out's block of this rank");
  auto d = make_desc(kind, in.dtype, total(counts));
  // The result is stacked by shape: (2, 3) on one rank and (3, 2) on another disagree even
  // with equal counts; the _v form concatenates rows, so only a row's shape must agree.
  d.shape = uneven ? in.row_hash : in.shape_hash;
  Call c = open(kind, d, o, what, {&in, &out});
  return issue(c, [&] { return do_all_gather(c, in, out, counts); });
}

WorkPtr Backend::reduce_scatter(const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& counts, RedOp op, bool uneven,
                                const CallOptions& o) {
  const char* what = uneven ? "reduce_scatter_v" : "reduce_scatter";
  check_arrays(what, in, out);
  check_counts(counts, what);
  if (in.count != total(counts)) size_error(what, "x", in.count, total(counts), "the counts add up to");
  if (out.count != counts[rank_]) size_error(what, "out", out.count, counts[rank_], "this rank's count is");
  check_overlap(what, in, out, offset_of(counts, rank_), "out is x's block of this rank");
  check_reduction(in.dtype, op);
  const CollKind kind = uneven ? CollKind::kReduceScatterV : CollKind::kReduceScatter;
  auto d = make_desc(kind, in.dtype, total(counts), op);
  // Every rank must split the same way: the counts travel as a fingerprint.
  d.shape = hash_of(counts).value();
  Call c = open(kind, d, o, what, {&in, &out});
  return issue(c, [&] { return do_reduce_scatter(c, in, out, counts, op); });
}

WorkPtr Backend::all_to_all(const ArrayView& in, const ArrayView& out,
                            const std::vector<size_t>& send_counts,
                            const std::vector<size_t>& recv_counts, bool uneven,
                            const CallOptions& o) {
  const CollKind kind = o.exchange != CollKind{} ? o.exchange
                        : uneven                  ? CollKind::kAllToAllV
                                                  : CollKind::kAllToAll;
  const char* what = coll_name(kind);
  check_arrays(what, in, out);
  check_counts(send_counts, what);
  check_counts(recv_counts, what);
  if (in.count != total(send_counts))
    size_error(what, "x", in.count, total(send_counts), "the send counts add up to");
  if (out.count != total(recv_counts))
    size_error(what, "out", out.count, total(recv_counts), "the receive counts add up to");
  check_overlap(what, in, out, 0, nullptr);
  // Uneven: per-rank totals differ, so the count is not compared; a row's shape is.
  auto d = make_desc(kind, in.dtype, uneven ? 0 : in.count);
  d.shape = in.row_hash;
  Call c = open(kind, d, o, what, {&in, &out});
  return issue(c, [&] { return do_all_to_all(c, in, out, send_counts, recv_counts); });
}

WorkPtr Backend::gather(const ArrayView& in, const ArrayView& out,
                        const std::vector<size_t>& counts, int root, const CallOptions& o) {
  const char* what = "gather";
  check_root(root, what);
  check_arrays(what, in, out);
  check_counts(counts, what);
  if (in.count != counts[rank_]) size_error(what, "x", in.count, counts[rank_], "its count is");
  if (rank_ == root && out.count != total(counts))
    size_error(what, "out", out.count, total(counts), "the counts add up to");
  if (rank_ == root)
    check_overlap(what, in, out, offset_of(counts, rank_), "x is out's block of this rank");
  auto d = make_desc(CollKind::kGather, in.dtype, in.count, RedOp::kSum, root);
  d.shape = in.shape_hash;  // the root stacks the blocks by shape, as all_gather does
  Call c = open(CollKind::kGather, d, o, what, {&in, &out});
  return issue(c, [&] { return do_gather(c, in, out, counts, root); });
}

WorkPtr Backend::scatter(const ArrayView& in, const ArrayView& out,
                         const std::vector<size_t>& counts, int root, const CallOptions& o) {
  const char* what = "scatter";
  check_root(root, what);
  check_arrays(what, in, out);
  check_counts(counts, what);
  if (out.count != counts[rank_]) size_error(what, "out", out.count, counts[rank_], "its count is");
  if (rank_ == root && in.count != total(counts))
    size_error(what, "x", in.count, total(counts), "the counts add up to");
  if (rank_ == root)
    check_overlap(what, in, out, offset_of(counts, rank_), "out is x's block of this rank");
  auto d = make_desc(CollKind::kScatter, out.dtype, out.count, RedOp::kSum, root);
  d.shape = out.shape_hash;  // each rank's block has the shape it expects: the same one
  Call c = open(CollKind::kScatter, d, o, what, {&in, &out});
  return issue(c, [&] { return do_scatter(c, in, out, counts, root); });
}

WorkPtr Backend::barrier(const CallOptions& o) {
  if (block_depth_ && !o.async)
    throw InvalidArgument(str_cat(who_, ": barrier: a synchronous barrier waits for the ops "
                                  "before it, and a coalesced block's ops run when the block "
                                  "ends; call it after the block, or barrier(async_op=True) "
                                  "inside it"));
  Call c = open(CollKind::kBarrier, make_desc(CollKind::kBarrier, DType::kUint8, 0), o,
                "barrier", {});
  return issue(c, [&] { return do_barrier(c); });
}

namespace {
void check_peer(int peer, int rank, int size, const char* what) {
  if (peer < 0 || peer >= size)
    throw InvalidArgument(str_cat(what, ": peer ", peer, " is out of range for a group of ", size,
                                  " ranks (0..", size - 1, ")"));
  if (peer == rank)
    throw InvalidArgument(str_cat(what, ": rank ", rank, " cannot send to or receive from itself"));
}
}  // namespace

WorkPtr Backend::send(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o) {
  check_peer(peer, rank_, size_, "send");
  auto d = make_desc(CollKind::kSendRecv, buf.dtype, buf.count);
  Call c = open(CollKind::kSendRecv, d, o, "send", {&buf}, /*reads_only=*/true);
  c.p2p = ledger_.open_p2p(d, peer);
  return issue(c, [&] { return do_send(c, buf, peer, tag); });
}

WorkPtr Backend::recv(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o) {
  check_peer(peer, rank_, size_, "recv");
  auto d = make_desc(CollKind::kSendRecv, buf.dtype, buf.count);
  Call c = open(CollKind::kSendRecv, d, o, "recv", {&buf});
  c.p2p = ledger_.open_p2p(d, peer);
  return issue(c, [&] { return do_recv(c, buf, peer, tag); });
}

void Backend::fail(const std::string& message, std::exception_ptr like) {
  do_fail(message, like);
}

}  // namespace meshcoll::comm
