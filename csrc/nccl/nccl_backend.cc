#include "nccl/nccl_backend.h"


#include "comm/array_view.h"
#include "common/error.h"
#include "common/host_timers.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using comm::ArrayView;
using comm::WorkPtr;

namespace {
// The options of call `c` (a comm::Backend::Call: deduced, as the type is the contract's own),
// in the one translation from the contract's CallOptions to CallOpts. `want_work`: whether the
// caller gets a Work. A synchronous collective, or a waited-for transfer (send/recv, Note
// [Synchronous point-to-point] in bind_backend.cc), is done once it is enqueued on the
// caller's stream, which orders every later use of its arrays: the contract returns no Work,
// so none is made. `direct`, `direct_only`: the call's route, decided by the backend
// (NcclComm::prepare_direct); a direct kernel's token carries the call's fingerprint (Note
// [Fingerprints] in common/op_desc.h), which every rank that agrees on the call computes alike.
template <class Call>
CallOpts opts_of(Call& c, bool want_work, bool direct = false, bool direct_only = false) {
  CallOpts o;  // (the entry point ordered c.opts.stream after c.opts.wait_for: check_options)
  o.stream = reinterpret_cast<abi::CUstream>(c.opts.stream);
  o.async = c.opts.async;
  o.timeout = c.opts.timeout;
  o.coll_seq = c.seq;
  o.p2p = c.p2p;
  o.desc = c.desc;
  o.keep = std::move(c.keep);
  o.want_work = want_work;
  o.direct = direct;
  o.direct_only = direct_only;
  if (direct) o.fingerprint = call_fingerprint(c.desc, c.seq);
  return o;
}

void check_no_tag(const char* what, uint32_t tag) {
  if (tag != 0)
    throw InvalidArgument(str_cat(what, ": tag ", tag, ": NCCL matches point-to-point messages "
                                  "between two ranks in posting order and has no tags; pass "
                                  "tag=0 and post sends and receives in the same order"));
}
}  // namespace

NcclBackend::NcclBackend(std::shared_ptr<NcclComm> comm)
    : Backend(comm->rank(), comm->size(), true), comm_(std::move(comm)),
      copier_(cuda(), comm_->context(), comm_->device()) {
  // Note [Call totals]: an op's record ends when the communicator sees it complete. No host
  // thread times a GPU op, so NCCL calls add their count and bytes, not time.
  comm_->set_on_done([this](uint64_t coll_seq, uint64_t p2p, const OpDesc& d) {
    if (coll_seq) ledger().set_state(coll_seq, comm::CallState::kDone);
    if (p2p) ledger().p2p_state(p2p, comm::CallState::kDone);
    if (coll_seq || p2p) ledger().add_totals(d, 0);
  });
}

std::shared_ptr<NcclBackend> NcclBackend::create(std::shared_ptr<store::Store> store, int rank,
                                                 int size, int device, Millis timeout) {
  return std::make_shared<NcclBackend>(NcclComm::create(std::move(store), rank, size, device, timeout));
}

std::shared_ptr<NcclBackend> NcclBackend::split(int color, int key, Millis timeout) {
  auto child = comm_->split(color, key, timeout);
  return child ? std::make_shared<NcclBackend>(std::move(child)) : nullptr;
}

void NcclBackend::check_reduction(DType dt, RedOp op) const {
  nccl_redop(op, dt, nccl());  // TypeMismatch naming both for pairs NCCL lacks
}

void NcclBackend::check_options(const char* what, const comm::CallOptions& o) const {
  if (o.tuning.algorithm != 0)
    throw InvalidArgument(str_cat(what, ": the algorithm is a CPU-backend choice; NCCL picks its "
                                  "own (set NCCL_ALGO to force one)"));
  // The last step before the call is issued: the array's own stream's pending work (a
  // __cuda_array_interface__ producer) comes before the op's stream.
  if (o.wait_for)
    comm_->order_streams(reinterpret_cast<abi::CUstream>(o.wait_for),
                         reinterpret_cast<abi::CUstream>(o.stream));
}

WorkPtr NcclBackend::do_all_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op) {
  // The call's route, decided here once (CallOpts::direct).
  const bool direct = comm_->prepare_direct(DirectPath::Kind::kAllReduce, in.dtype, op, in.count);
  const bool only = open(c, &in, &out, direct);
  return comm_->all_reduce(opts_of(c, c.opts.async, direct, only),
                           in.data, out.data, in.count, in.dtype, op);
}

WorkPtr NcclBackend::do_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op,
                               int root) {
  open(c, &in, &out);
  return comm_->reduce(opts_of(c, c.opts.async),
                       in.data, out.data, in.count, in.dtype, op, root);
}

WorkPtr NcclBackend::do_broadcast(Call& c, const ArrayView& buf, int root) {
  open(c, &buf, &buf);
  return comm_->broadcast(opts_of(c, c.opts.async),
                          buf.data, buf.count, buf.dtype, root);
}

WorkPtr NcclBackend::do_all_gather(Call& c, const ArrayView& in, const ArrayView& out,
                                   const std::vector<size_t>& counts) {
  const bool direct =
      detail::all_equal(counts) &&
      comm_->prepare_direct(DirectPath::Kind::kAllGather, in.dtype, RedOp::kSum, counts[0]);
  const bool only = open(c, &in, &out, direct);
  return comm_->all_gather(opts_of(c, c.opts.async, direct, only),
                           in.data, out.data, counts, in.dtype);
}

WorkPtr NcclBackend::do_reduce_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                       const std::vector<size_t>& counts, RedOp op) {
  const bool direct =
      detail::all_equal(counts) &&
      comm_->prepare_direct(DirectPath::Kind::kReduceScatter, in.dtype, op, counts[0]);
  const bool only = open(c, &in, &out, direct);
  return comm_->reduce_scatter(opts_of(c, c.opts.async, direct, only),
                               in.data, out.data, counts, in.dtype, op);
}

WorkPtr NcclBackend::do_all_to_all(Call& c, const ArrayView& in, const ArrayView& out,
                                   const std::vector<size_t>& send_counts,
                                   const std::vector<size_t>& recv_counts) {
  open(c);
  return comm_->all_to_all(opts_of(c, c.opts.async),
                           in.data, out.data, send_counts, recv_counts, in.dtype);
}

WorkPtr NcclBackend::do_gather(Call& c, const ArrayView& in, const ArrayView& out,
                               const std::vector<size_t>& counts, int root) {
  open(c);
  return comm_->gather(opts_of(c, c.opts.async),
                       in.data, out.data, counts, in.dtype, root);
}

WorkPtr NcclBackend::do_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& counts, int root) {
  open(c);
  return comm_->scatter(opts_of(c, c.opts.async),
                        in.data, out.data, counts, out.dtype, root);
}

WorkPtr NcclBackend::do_barrier(Call& c) {
  open(c);
  auto w = comm_->barrier(opts_of(c, true));  // its wait blocks the host
  if (c.opts.async) return w;
  w->wait(c.opts.timeout, false, nullptr);  // a barrier's wait blocks the host
  return nullptr;
}

WorkPtr NcclBackend::do_send(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  check_no_tag("send", tag);
  return comm_->send(opts_of(c, !c.opts.wait), buf.data, buf.count, buf.dtype, peer);
}

WorkPtr NcclBackend::do_recv(Call& c, const ArrayView& buf, int peer, uint32_t tag) {
  check_no_tag("recv", tag);
  return comm_->recv(opts_of(c, !c.opts.wait), buf.data, buf.count, buf.dtype, peer);
}

// NCCL has no way to tell the peers: the side channel does (their groups fail with `message`).
// The peers first: ncclCommAbort may take a while.
void NcclBackend::do_fail(const std::string& message, std::exception_ptr like) {
  if (agreement_) agreement_->relay(message, like);
  comm_->abort(message);
}

// An NCCL group is used by one thread at a time (NCCL requires it; the entry points check it:
// Note [One issuing thread]), so the order of these calls is the order the ops reach NCCL:
// the record opens here (Note [Call ledger]).
bool NcclBackend::open(Call& c, const ArrayView* in, const ArrayView* out, bool direct) {
  auto bytes = [](const ArrayView* v) { return v ? v->count * dtype_size(v->dtype) : 0; };
  const void* in_data = in ? in->data : nullptr;
  const void* out_data = out ? out->data : nullptr;
  const size_t in_bytes = bytes(in), out_bytes = bytes(out);
  c.desc.memory = comm_->windows().tag(in_data, in_bytes, out_data, out_bytes);
  c.seq = ledger().open_collective(c.desc);
  bool direct_only = false;
  if (agreement_) {
    try {
      agreement_->note(c.seq, c.desc);
      // Symmetric kernels do not end at an abort: agree first (Note [Agreement before launch]).
      // In a block nothing is launched before its end, which agrees once for all its calls.
      // A direct kernel ends at an abort and checks the call itself: no need.
      if (c.desc.memory && coalescing())
        block_await_ = c.seq;
      else if (c.desc.memory && direct &&
               comm_->direct_now(reinterpret_cast<abi::CUstream>(c.opts.stream)))
        direct_only = true;
      else if (c.desc.memory)
        agreement_->await(c.seq, c.opts.timeout);
    } catch (...) {
      comm_->mark_reported();  // raised by this call: destroy() need not raise it again
      throw;
    }
  }
  host_timers::mark(host_timers::kNoted);
  return direct_only;
}

void NcclBackend::do_end_coalesced(Millis timeout) {
  const uint64_t seq = block_await_;
  block_await_ = 0;
  if (seq && agreement_) {
    try {
      agreement_->await(seq, timeout);  // every call up to seq agreed
    } catch (...) {
      comm_->mark_reported();
      comm_->end_block(timeout, std::current_exception());  // runs none of it
      throw;
    }
  }
  comm_->end_block(timeout);
}

void NcclBackend::set_agreement(std::shared_ptr<comm::Backend> channel,
                                comm::Agreement::Mode mode) {
  std::weak_ptr<NcclComm> comm = comm_;
  agreement_ = comm::Agreement::create(
      std::move(channel), mode, comm_->timeout(), ledger(),
      [comm](std::exception_ptr error, uint64_t seq) {
        if (auto c = comm.lock()) c->fail(std::move(error), seq);
      },
      names());
  std::weak_ptr<comm::Agreement> a = agreement_;
  NcclComm::CheckHooks hooks;
  hooks.census = [a](uint64_t seq) {
    auto p = a.lock();
    return p ? p->census(seq) : std::string();
  };
  hooks.agreed = [a](uint64_t seq) {
    auto p = a.lock();
    return !p || p->agreed(seq);
  };
  hooks.settle = [a](uint64_t seq, Millis timeout) {
    if (auto p = a.lock()) p->await(seq, timeout);
  };
  comm_->set_check(std::move(hooks));
}

std::shared_ptr<SymmetricBlock> NcclBackend::alloc_symmetric(size_t bytes, bool zero,
                                                             Millis timeout) {
  const auto d = make_desc(CollKind::kAllocSymmetric, DType::kUint8, bytes);
  const uint64_t seq = ledger().open_collective(d);
  if (agreement_) {
    try {
      agreement_->note(seq, d);
      agreement_->await(seq, timeout);
    } catch (...) {
      comm_->mark_reported();
      throw;
    }
  }
  auto block = comm_->alloc_symmetric(bytes, zero, timeout);
  ledger().set_state(seq, comm::CallState::kDone);
  return block;
}

std::vector<uint8_t> NcclBackend::host_all_gather(const void* data, size_t bytes,
                                                  const OpDesc& d, Millis timeout) {
  const uint64_t seq = ledger().open_collective(d);
  if (agreement_) {
    try {
      agreement_->note(seq, d);
    } catch (...) {
      comm_->mark_reported();
      throw;
    }
  }
  try {
    // Its Work's synchronize waits for this call's agreement (Note [Results at host
    // synchronization points] in op_ring.cc): the bytes returned agree.
    auto out = comm_->host_all_gather(data, bytes, timeout, seq);
    ledger().set_state(seq, comm::CallState::kDone);
    return out;
  } catch (...) {
    ledger().set_state(seq, comm::CallState::kFailed);
    throw;
  }
}

void NcclBackend::do_shutdown() {
  if (agreement_) agreement_->stop(comm_->failed());
  comm_->shutdown();
}

}  // namespace meshcoll::nccl
