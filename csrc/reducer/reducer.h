// The reducer: gradient buckets averaged over a group while backward still runs, below both
// data-parallel wrappers (python/meshcoll/ddp.py's DataParallel and the torch adapter).
//
// Note [Reducer]
// A reducer holds flat buckets (arrays of the group's memory, one dtype each) and the place
// of every gradient in them (its slot: a bucket, an offset and a count). In each step every
// gradient is handed over once, by its index, as two addresses: where its value is now
// (`src`) and where the average must go at the end (`out`). A `src` that is the slot itself
// (a gradient computed in its bucket: torch's gradient_as_bucket_view) is not copied, and an
// `out` that is the slot (or 0) is not copied back. A bucket whose last gradient arrived is
// launched once every bucket before it has been: every rank must issue the same collectives
// in the same order, whatever order its backward produced gradients in. A launch copies the
// bucket's gradients in (Backend::copy_spans: one kernel for the whole bucket on a GPU, Note
// [Span copies] in nccl/span_copy.h) and queues its all-reduce, asynchronously, on the
// caller's stream. finish() orders the caller's stream after every all-reduce (GPU) or waits
// for them (CPU) and copies the averages out (one kernel for every bucket on a GPU; each
// bucket as soon as it is waited for on the CPU). Nothing runs in
// Python per bucket: a torch training step calls ready() from each parameter's hook and
// finish() from the last one (the torch adapter), and the host's work per gradient is a
// few compares and stores.
//
// A compression hook (the wrappers' register_comm_hook and compression="bf16") replaces the
// all-reduce of a bucket: then the reducer does not launch, and the wrapper takes each
// complete bucket in order (take_complete(), which copies its gradients in), runs the hook,
// waits for the hook's work and leaves the result in the bucket; finish() then copies it out.
//
// The gradient arrays themselves are the caller's to keep alive until finish() (the
// wrappers hold them); the buckets are held here (their ArrayView owners).
//
// Statistics follow Note [Stats] in python/meshcoll/ddp.py: each launched all-reduce is
// stamped when it completes by a CompletionStamps thread (Note [Completion stamps]), and a
// bucket's communication time runs from max(its launch, the previous bucket's end) to its
// end; the part before finish() was called is "overlapped". Stream-ordered finishes (GPU)
// are counted once the device got there: at the next finish(), stats() or reset.
//
// Note [In-place gradients]
// On the CPU a bucket's copies are the step's largest cost after the model's own: copying
// a gradient into its bucket and its average back reads and writes it twice more, on the
// calling thread (on the 2-core VM 2 x 6.7 ms for 33.6 MB, more than the all-reduce's
// 9.8 ms). So in a group on shared memory (one host, CPU) a gradient of at least
// kInPlaceBytes is averaged by an all-reduce of its own, in the memory it was given in,
// when its average goes there too (out == src, as the torch adapter without
// gradient_as_bucket_view and DataParallel with plain arrays give it): nothing is copied.
// The calls a bucket makes are fixed by its layout alone, the same on every rank: each large
// slot one all-reduce, and the smaller slots one all-reduce together, copied in and out of
// a buffer where they lie end to end (the stage: between large slots a bucket's small ones
// are not contiguous, and a call each would cost a synchronisation each). A bucket without
// large slots is one all-reduce, as before. A large gradient that cannot be averaged in
// place (given elsewhere than its average goes, as with gradient_as_bucket_view after
// zero_grad(set_to_none=True), or overlapping another gradient given this step) is averaged
// by the same call from where it was given into its slot: the shared-memory all-reduce reads
// x where it is at no extra cost (Note [Out-of-place shared-memory all_reduce] in
// cpu/algo/shm_collectives.cc), so the copy into the slot (6.7 ms for 33.6 MB) is saved,
// and ranks that decide differently still issue identical collectives. Such a gradient is
// only read while its call runs; the calls run in issue order, so a later gradient averaged
// in place over the same memory writes it only after that read, and one given earlier is
// the overlap below. A gradient given after one it overlaps was averaged in place
// would read a changed value: that fails the group (every rank raises) instead of averaging
// it silently wrong. A step that fails leaves such a gradient partly averaged (a copied one
// keeps its value): the step raised, and its gradients are not to be used. A bucket's calls
// complete in issue order (one worker per group), so its last one stands for the bucket in
// finish() and in the statistics (one call per bucket, as on a GPU).
// GPU buckets keep one all-reduce each: their copies are one kernel on the device, and the
// host time goes to launches. So do groups over TCP, where each call pays its network round
// trips (2(n-1) for a ring): there a bucket's calls could cost more than its copies (not
// measured). On host memory, the small gradients are copied as they arrive (copy_in),
// while their values are still in the caches, rather than all at once when the bucket is
// complete.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/array_view.h"
#include "comm/backend.h"
#include "comm/stamps.h"

namespace meshcoll::reducer {

// On host memory, a gradient of at least this many bytes is averaged by an all-reduce of
// its own (Note [In-place gradients]): below it, one call for several gradients costs less
// than the copies it would save.
inline constexpr size_t kInPlaceBytes = 256 << 10;

class Reducer {
 public:
  struct Slot {
    size_t bucket;
    size_t offset;  // elements into the bucket
    size_t count;
  };
  struct Stats {
    uint64_t calls = 0;
    uint64_t bytes = 0;
    double comm_seconds = 0;
    double overlapped_seconds = 0;
    uint64_t copied_bytes = 0;  // copied into and out of the buckets (Note [In-place gradients])
  };

  // `launches`: the reducer queues each complete bucket's all-reduce with `op` itself
  // (false: a hook does, after take_complete, and leaves the sum in the bucket for finish()).
  // `names`: the gradients' names, for errors.
  Reducer(std::shared_ptr<comm::Backend> backend, std::vector<comm::ArrayView> buckets,
          std::vector<Slot> slots, std::vector<std::string> names, RedOp op, bool launches);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  size_t size() const { return slots_.size(); }
  size_t num_buckets() const { return buckets_.size(); }
  // The address of gradient i's slot.
  uintptr_t slot_address(size_t i) const;
  // Gradient i of this step: its value at `src`, its average to `out` (0: stays in the slot).
  // Returns true when a bucket is now ready to launch (call launch_ready(), with the GIL let
  // go). Raises InvalidArgument for an unknown index or a gradient given twice in one step.
  bool mark(size_t i, uintptr_t src, uintptr_t out);
  // On host memory, copies gradient i (just given) into its slot now, while its values are
  // still in the caches, unless its all-reduce reads it where it is (a large gradient on
  // shared memory, Note [In-place gradients]). Returns
  // whether there is such a copy to make (call copy_in with the GIL let go).
  bool copies_early(size_t i) const;
  void copy_in(size_t i);
  // Launches every complete bucket whose predecessors were launched, on `stream`. If a launch
  // fails (the group failed), the step is dropped (abandon()) and the failure raised.
  void launch_ready(comm::Stream stream);
  // Gradients still to come this step, and which (indices, in bucket order).
  size_t remaining() const { return remaining_; }
  std::vector<size_t> missing() const;
  // A hook's turn: the complete buckets not handed out yet, in order, their gradients copied
  // in (on `stream`).
  std::vector<size_t> take_complete(comm::Stream stream);
  // Every gradient was given: waits for the all-reduces (stream-ordered on a GPU) and copies
  // the averages out; the step ends. Raises the first failure after draining every bucket.
  void finish(comm::Stream stream);
  // Whether every all-reduce launched this step has completed (never blocks): a step kept in
  // flight by an asynchronous mode may then be finished without waiting.
  bool done();
  // Ends the step without results (a hook failed, or the caller gave up): waits for what
  // was launched (its buffers are in use), forgets what was given.
  void abandon();
  // The order gradients arrived in during the first complete step (indices), for buckets
  // rebuilt in the order backward produces them.
  const std::vector<size_t>& first_order() const { return first_order_; }
  // Settles stream-ordered flights (blocking until the device finished them) and returns
  // the totals; raises the first failure among the flights settled.
  Stats stats();
  void reset_stats();

 private:
  struct Bucket {
    comm::ArrayView buf;
    std::vector<size_t> members;  // slot indices, in layout (offset) order
    // Shared memory (Note [In-place gradients]): its large slots, an all-reduce each (none:
    // one all-reduce of `buf`, as on a GPU), and its smaller ones, averaged together in
    // `stage` (memory of the reducer's own, at staged_at_).
    std::vector<size_t> large, small;
    comm::ArrayView stage;
    size_t missing = 0;           // gradients still to come this step
    comm::WorkPtr work;           // its (last) all-reduce, launched this step
    std::vector<comm::WorkPtr> earlier;  // its other all-reduces, launched this step
    uint64_t ticket = 0;          // the work's CompletionStamps ticket
    double t_launch = 0;
  };
  struct Flight {
    uint64_t ticket;
    double t_launch;
    double t_wait;
    uint64_t bytes;
  };
  std::vector<comm::CopySpan> spans_in(const Bucket& b) const;
  // backend_->copy_spans, counted in the statistics.
  void copy(const std::vector<comm::CopySpan>& spans, comm::Stream stream);
  void spans_out(size_t b, std::vector<comm::CopySpan>* spans) const;
  // Bucket `b`'s averages out to the `out` addresses (on `stream`).
  void copy_out(size_t b, comm::Stream stream);
  // Launches bucket `b`'s all-reduces on host memory (Note [In-place gradients]).
  void launch_calls(Bucket& b, comm::Stream stream);
  // The gradient given this step whose src or out range overlaps [lo, hi), other than
  // `except`; SIZE_MAX when none. `spans` maps a range's start to (its end, its slot).
  using Spans = std::multimap<uintptr_t, std::pair<uintptr_t, size_t>>;
  size_t overlapping(const Spans& spans, uintptr_t lo, uintptr_t hi, size_t except) const;
  size_t bytes_of(size_t i) const { return slots_[i].count * elem_size_[i]; }
  // Where gradient i is averaged when it is not in place: its stage or its slot.
  uintptr_t home(size_t i) const;
  void count(const comm::CompletionStamps::Stamp& s, const Flight& f);
  void settle();
  void end_step();

  std::shared_ptr<comm::Backend> backend_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  std::vector<std::string> names_;
  RedOp op_;
  bool launches_;
  bool splits_ = false;  // buckets are split into calls (Note [In-place gradients])
  std::vector<size_t> elem_size_;  // per slot
  std::vector<uintptr_t> src_, out_;  // this step's addresses, by slot
  std::vector<char> given_;           // this step's gradient arrived, by slot
  std::vector<char> in_place_;        // this step's gradient is averaged where it was given
  std::vector<size_t> staged_at_;     // elements into its bucket's stage; SIZE_MAX: unstaged
  Spans given_spans_;     // host memory: this step's src and out ranges (overlap checks)
  Spans in_place_spans_;  // host memory: this step's gradients averaged in place
  size_t longest_span_ = 0;  // bytes: how far before a range an overlapping span may start
  size_t remaining_ = 0;
  size_t next_launch_ = 0;
  std::vector<size_t> order_;       // arrival order of this step
  std::vector<size_t> first_order_;
  comm::CompletionStamps stamps_;
  std::vector<Flight> unsettled_;
  double prev_end_ = 0;
  Stats stats_;
};

}  // namespace meshcoll::reducer
