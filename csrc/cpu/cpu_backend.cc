#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "cpu/algo/collectives.h"
#include "common/error.h"
#include "reduce/kernels.h"

namespace meshcoll::cpu {

using comm::ArrayView;
using comm::WorkPtr;

namespace {
// A view for an operation's body: the Work holds the owners (Call::keep), not the body.
ArrayView unowned(ArrayView v) {
  v.owner = nullptr;
  return v;
}

std::vector<size_t> to_bytes(const std::vector<size_t>& counts, DType dt) {
  std::vector<size_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * dtype_size(dt);
  return out;
}
}  // namespace

CpuBackend::CpuBackend(std::shared_ptr<store::Store> store, int rank, int size,
                       const CommOptions& opts, uint64_t comm_id)
    : Backend(rank, size, false),
      comm_(std::make_unique<Comm>(std::move(store), rank, size, opts, comm_id, &ledger())) {}

CpuBackend::~CpuBackend() {
  dropped_ = true;
  shutdown();
}

// destroy() says farewell to the peers (Note [Farewell]); a group dropped without it does not
// wait for them: groups are collected in any order, and two ranks waiting in different ones
// would hold each other to the timeout.
void CpuBackend::do_shutdown() { comm_->shutdown(farewell_ && !dropped_); }

static_assert(kComposedAlgo == static_cast<uint8_t>(Algorithm::kShm) + 1,
              "a composed call's algorithm code is none a user may name");

void CpuBackend::set_hierarchy(std::shared_ptr<const Hierarchy> h) {
  for (comm::Backend* child : {h->local.get(), h->leaders.get()})
    if (auto* cpu = dynamic_cast<CpuBackend*>(child)) cpu->comm().set_serves_steps();
  hier_ = std::move(h);
}

void CpuBackend::check_reduction(DType dt, RedOp op) const {
  reduce::lookup(dt, op);  // throws TypeMismatch naming both when unsupported
}

void CpuBackend::check_options(const char* what, const comm::CallOptions& o) const {
  const auto& t = o.tuning;
  for (uint8_t code : {t.algorithm, t.local_algorithm, t.global_algorithm})
    if (code > static_cast<uint8_t>(Algorithm::kShm))
      throw InvalidArgument(str_cat(what, ": unknown algorithm code ", int(code)));
  if (t.algorithm == static_cast<uint8_t>(Algorithm::kShm) && !comm_->shm() &&
      size() > 1)
    throw InvalidArgument(str_cat(what, ": algorithm 'shm' needs every rank on one host with "
                                  "shared memory; this group uses ", comm_->shm_status()));
  if (t.max_segment_bytes == 0) throw InvalidArgument("max_segment_bytes must be > 0");
  if (t.tree_arity == 1)
    throw InvalidArgument(str_cat(what, ": tree arity 1 is no tree; use 0 (binomial) or >= 2"));
  const std::string_view op = what;  // on every call: no allocation
  if (op == "reduce" || op == "broadcast") {
    for (uint8_t code : {t.algorithm, t.local_algorithm, t.global_algorithm}) {
      const auto algorithm = static_cast<Algorithm>(code);
      if (!algo::algorithm_allowed(op == "reduce" ? algo::Selects::kReduce
                                                  : algo::Selects::kBroadcast, algorithm))
        throw InvalidArgument(str_cat(what, ": algorithm '", algorithm_name(algorithm),
                                      "' is not one of ", what, "'s: use auto, tree, direct",
                                      op == "broadcast" ? " or ring" : ""));
    }
    const auto algorithm = static_cast<Algorithm>(t.algorithm);
    if (algorithm == Algorithm::kRing && comm_->shm() && size() > 1)
      throw InvalidArgument(str_cat(what, ": algorithm 'ring' (the chain over TCP) is for TCP "
                                    "groups; this group uses shared memory: use auto, tree or "
                                    "direct"));
  }
}

template <class Op>
WorkPtr CpuBackend::run(Call& c, Op&& op) {
  flush_staged();
  if (c.opts.async)
    return comm_->enqueue(c.desc, c.opts.timeout, std::forward<Op>(op), std::move(c.keep));
  comm_->run_blocking(c.desc, c.opts.timeout, op);
  return nullptr;
}

// Note [Fused all_reduces]
// In a coalesced block (Note [Coalesced blocks] in comm/backend.h) a synchronous all_reduce
// of at most kFuseCallBytes with the automatic algorithm is staged, not run: its result is
// due when the block ends. The staged calls run at the block's end, or before any other call
// on the group, in order; consecutive ones of one dtype and op are fused into one
// all_reduce of a buffer holding them end to end (copied in, reduced once, copied out), so N
// small calls cost one round of messages instead of N: the CPU's counterpart of NCCL's group
// launch. A block's calls are independent (Note [Calls of a block are independent]), so the
// fused call computes exactly what the calls one by one would. The fused call's description
// counts every element and fingerprints the calls' counts (its `shape`, Note [Fingerprints]
// in comm/array_view.h), so ranks whose calls differ in any count, or in their order, get
// MismatchError; the ledger keeps the fused call
// (its count is the sum). Its timeout is the shortest the calls gave. A failure is raised by
// whatever ran it: the block's end, or the group's next call. Over TCP a block of small calls
// costs a fraction of the calls one by one; over shared memory it gains nothing, the block's
// own checks costing about what a round does (see docs/performance.md, "Fused all_reduces").
void CpuBackend::flush_staged() {
  if (staged_.empty()) return;
  std::vector<Staged> staged;
  staged.swap(staged_);
  staged_bytes_ = 0;
  for (size_t i = 0, j; i < staged.size(); i = j) {
    const Staged& first = staged[i];
    size_t total = 0;
    Millis timeout = first.timeout;
    ShapeHash layout;
    for (j = i; j < staged.size() && staged[j].in.dtype == first.in.dtype &&
                staged[j].op == first.op;
         ++j) {
      total += staged[j].in.count;
      layout.mix(staged[j].in.count);
      if (staged[j].timeout.count() >= 0 &&
          (timeout.count() < 0 || staged[j].timeout < timeout))
        timeout = staged[j].timeout;
    }
    comm::CallOptions o;
    o.timeout = timeout;
    o.tuning = first.tuning;
    Call fused{"all_reduce", make_desc(CollKind::kAllReduce, first.in.dtype, total,
                                                first.op),
               o};
    fused.desc.block = first.block;
    if (j == i + 1) {  // alone: as it was called
      run_all_reduce(fused, first.in, first.out, first.op);
      continue;
    }
    layout.mix(j - i);  // how many calls: zero-count calls count too
    fused.desc.shape = layout.value();
    const size_t es = dtype_size(first.in.dtype);
    std::vector<uint8_t> buf(total * es);
    ArrayView all;
    all.data = buf.data();
    all.count = total;
    all.dtype = first.in.dtype;
    size_t off = 0;
    for (size_t k = i; k < j; ++k) {
      std::memcpy(buf.data() + off, staged[k].in.data, staged[k].in.bytes());
      off += staged[k].in.bytes();
    }
    run_all_reduce(fused, all, all, first.op);
    off = 0;
    for (size_t k = i; k < j; ++k) {
      std::memcpy(staged[k].out.data, buf.data() + off, staged[k].out.bytes());
      off += staged[k].out.bytes();
    }
  }
}

WorkPtr CpuBackend::do_all_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op) {
  if (coalescing() && !c.opts.async && in.bytes() <= kFuseCallBytes &&
      c.opts.tuning.algorithm == static_cast<uint8_t>(Algorithm::kAuto)) {
    if (staged_bytes_ + in.bytes() > kFuseBytes) flush_staged();
    staged_.push_back(Staged{unowned(in), unowned(out), op, c.opts.timeout, c.opts.tuning,
                             c.desc.block});
    staged_bytes_ += in.bytes();
    return nullptr;  // Note [Fused all_reduces]: run by the block's end or the next call
  }
  flush_staged();
  return run_all_reduce(c, in, out, op);
}

WorkPtr CpuBackend::run_all_reduce(Call& c, const ArrayView& in, const ArrayView& out,
                                   RedOp op) {
  const auto& t = c.opts.tuning;
  if (hier_ && t.algorithm == static_cast<uint8_t>(Algorithm::kAuto))
    return run(c, [h = hier_, in = unowned(in), out = unowned(out), op, t](Comm& cm) {
      hier_all_reduce(cm, *h, in, out, op, t);
    });
  algo::AllreduceArgs a;
  a.in = in.cbytes();
  a.out = out.mbytes();
  a.count = in.count;
  a.dtype = in.dtype;
  a.op = op;
  a.algorithm = static_cast<Algorithm>(t.algorithm);
  a.arity = t.tree_arity;
  a.max_segment_bytes = t.max_segment_bytes;
  a.select.tree_threshold_bytes = t.tree_threshold_bytes;
  a.select.hd_threshold_bytes = t.hd_threshold_bytes;
  return run(c, [a](Comm& cm) { algo::all_reduce(cm, a); });
}

WorkPtr CpuBackend::do_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op,
                              int root) {
  // Off the root, out is not written: it may be any size (the entry point checked the root's).
  const auto& t = c.opts.tuning;
  algo::ReduceArgs a{in.cbytes(), rank() == root ? out.mbytes() : MutBytes(), in.count,
                     in.dtype, op, root, static_cast<Algorithm>(t.algorithm),
                     t.tree_arity, t.max_segment_bytes};
  return run(c, [a](cpu::Comm& cm) { algo::reduce(cm, a); });
}

WorkPtr CpuBackend::do_broadcast(Call& c, const ArrayView& buf, int root) {
  const auto& t = c.opts.tuning;
  if (hier_ && t.algorithm == static_cast<uint8_t>(Algorithm::kAuto))
    return run(c, [h = hier_, buf = unowned(buf), root, t](cpu::Comm& cm) {
      hier_broadcast(cm, *h, buf, root, t);
    });
  algo::BroadcastArgs a{buf.mbytes(), root, t.max_segment_bytes,
                        static_cast<Algorithm>(t.algorithm), t.tree_arity};
  return run(c, [a](cpu::Comm& cm) { algo::broadcast(cm, a); });
}

WorkPtr CpuBackend::do_all_gather(Call& c, const ArrayView& in, const ArrayView& out,
                                  const std::vector<size_t>& counts) {
  if (hier_ && std::all_of(counts.begin(), counts.end(), [&](size_t n) { return n == in.count; }))
    return run(c, [h = hier_, in = unowned(in), out = unowned(out)](Comm& cm) {
      hier_all_gather(cm, *h, in, out);
    });
  algo::AllGatherArgs a{in.cbytes(), out.mbytes(), to_bytes(counts, in.dtype)};
  return run(c, [a](Comm& cm) { algo::all_gather(cm, a); });
}

WorkPtr CpuBackend::do_reduce_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                      const std::vector<size_t>& counts, RedOp op) {
  algo::ReduceScatterArgs a{in.cbytes(), out.mbytes(), counts, in.dtype, op};
  return run(c, [a](Comm& cm) { algo::reduce_scatter(cm, a); });
}

WorkPtr CpuBackend::do_all_to_all(Call& c, const ArrayView& in, const ArrayView& out,
                                  const std::vector<size_t>& send_counts,
                                  const std::vector<size_t>& recv_counts) {
  algo::AllToAllArgs a{in.cbytes(), out.mbytes(), to_bytes(send_counts, in.dtype),
                       to_bytes(recv_counts, in.dtype)};
  return run(c, [a](Comm& cm) { algo::all_to_all(cm, a); });
}

WorkPtr CpuBackend::do_gather(Call& c, const ArrayView& in, const ArrayView& out,
                              const std::vector<size_t>& counts, int root) {
  algo::GatherArgs a{in.cbytes(), rank() == root ? out.mbytes() : MutBytes(),
                     to_bytes(counts, in.dtype), root};
  return run(c, [a](Comm& cm) { algo::gather(cm, a); });
}

WorkPtr CpuBackend::do_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                               const std::vector<size_t>& counts, int root) {
  algo::GatherArgs a{rank() == root ? in.cbytes() : ConstBytes(), out.mbytes(),
                     to_bytes(counts, out.dtype), root};
  return run(c, [a](Comm& cm) { algo::scatter(cm, a); });
}

WorkPtr CpuBackend::do_barrier(Call& c) {
  return run(c, [](Comm& cm) { algo::barrier(cm); });
}

WorkPtr CpuBackend::do_send(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  flush_staged();
  if (c.opts.wait) {
    comm_->run_p2p_blocking(true, peer, tag, buf.cbytes(), MutBytes(), c.desc, c.opts.timeout, c.p2p);
    return nullptr;
  }
  return comm_->enqueue_p2p(true, peer, tag, buf.cbytes(), MutBytes(), c.desc, c.opts.timeout,
                            c.p2p, std::move(c.keep));
}

WorkPtr CpuBackend::do_recv(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  flush_staged();
  if (c.opts.wait) {
    comm_->run_p2p_blocking(false, peer, tag, ConstBytes(), buf.mbytes(), c.desc, c.opts.timeout, c.p2p);
    return nullptr;
  }
  return comm_->enqueue_p2p(false, peer, tag, ConstBytes(), buf.mbytes(), c.desc, c.opts.timeout,
                            c.p2p, std::move(c.keep));
}

void CpuBackend::do_fail(const std::string& message, std::exception_ptr like) {
  comm_->fail(message, like);
}

}  // namespace meshcoll::cpu
