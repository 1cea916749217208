// The NCCL communicator's op path: the caller's or the internal stream, the collectives and
// point-to-point as NCCL calls, coalesced blocks (Note [NCCL streams and Works] in
// op_ring.h). The op ring (OpRing: slots, completion, the staged block) and NcclWork are
// op_ring.{h,cc}; lifecycle and failures nccl_comm.cc.
#include "nccl/nccl_comm.h"

#include "common/check.h"
#include "common/error.h"
#include "common/host_timers.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here
using detail::all_equal;
using detail::backoff;
using detail::CtxGuard;

namespace {
// ncclGroupStart/End around `body`; the group is closed even when body throws.
template <class Check, class Body>
void grouped(const NcclApi& nc, Check&& check, Body&& body) {
  check(nc.group_start(), "ncclGroupStart");
  try {
    body();
  } catch (...) {
    nc.group_end();
    throw;
  }
  check(nc.group_end(), "ncclGroupEnd");
}
}  // namespace

// ---- the op path -------------------------------------------------------------------------

template <class Launch>
NcclComm::WorkPtr NcclComm::run(const CallOpts& c, const char* what, bool host_blocking,
                                Launch&& launch) {
  // Dropped symmetric blocks are freed here once they add up to kDrainBytes (an atomic load
  // unless so), but not while the stream is captured: the device synchronize would break
  // the capture. Nor in a coalesced block, whose staged ops may read them.
  if (windows_.drain_due() && !ring_.block_open()) {
    int capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    CtxGuard guard(cu_, ctx_);
    if (cu_.stream_is_capturing(c.stream, &capturing) == CUDA_SUCCESS &&
        capturing == CU_STREAM_CAPTURE_STATUS_NONE)
      drain_retired();
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (direct_ && direct_->status()) check_direct_locked();  // a direct kernel failed
  usable_locked();
  ring_.note_collective(c.coll_seq);
  host_timers::mark(host_timers::kLocked);
  CtxGuard guard(cu_, ctx_);
  CUstream user = c.stream;
  int capture = CU_STREAM_CAPTURE_STATUS_NONE;
  // In a block, a stream's capture state is asked once (end_block checks it did not change).
  if (ring_.staged_last_on(user))
    capture = ring_.block_captured() ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                     : CU_STREAM_CAPTURE_STATUS_NONE;
  else if (CUresult cr = cu_.stream_is_capturing(user, &capture); cr != CUDA_SUCCESS)
    throw InvalidArgument(str_cat(what, " on ", where(), ": cuStreamIsCapturing failed on the "
                                  "caller's stream: ", cu_.error_text(cr),
                                  " (a stream of another device, or destroyed?)"));
  const bool captured = capture != CU_STREAM_CAPTURE_STATUS_NONE;
  host_timers::mark(host_timers::kCaptured);
  if (ring_.block_open())
    return stage_locked(lock, c, what, host_blocking, captured,
                        OpRing::Staged{std::forward<Launch>(launch), user, c.async});
  const bool async = c.async && !captured;
  const Millis t = c.timeout.count() < 0 ? timeout_ : c.timeout;
  // One clock reading per op: the enqueue's and the completion's deadline are the same.
  Deadline d(t, Clock::now());
  if (!captured) claim_slot_locked(lock, d);
  const CUstream exec = exec_stream_locked(user, async);
  host_timers::mark(host_timers::kPrepared);
  {
    // Only this launch may pick a direct kernel (not end_block's staged ones), even if it throws.
    struct Eager {
      bool& on;
      ~Eager() { on = false; }
    } eager{launch_eager_};
    launch_eager_ = !captured;
    launched_direct_ = 0;
    guarded_locked(d, what, [&] {
      launch(exec, d);
      return ncclSuccess;
    });
  }
  host_timers::mark(host_timers::kLaunched);
  if (captured)
    return c.want_work ? std::make_shared<NcclWork>(shared_from_this(), 0, 0, user, false,
                                                    true, host_blocking)
                       : nullptr;
  const uint64_t seq = ring_.issue(exec, OpRing::Call{what, c.coll_seq, c.p2p, c.desc}, d.at(),
                                   t.count(), launched_direct_, async ? &c.keep : nullptr);
  if (launched_direct_) direct_last_done_ = ring_.slot(seq).event;
  if (!c.want_work) return nullptr;
  return std::make_shared<NcclWork>(shared_from_this(), seq, ring_.last_collective(), user, async,
                                    false, host_blocking);
}

CUstream NcclComm::exec_stream_locked(CUstream user, bool async) {
  if (!async) return user;
  cu_.check(cu_.event_record(order_event_, user), "cuEventRecord (caller's stream)");
  cu_.check(cu_.stream_wait_event(internal_, order_event_, 0), "cuStreamWaitEvent");
  return internal_;
}

// Note [Coalesced blocks on NCCL]
// ProcessGroup.coalesced() (Note [Coalesced blocks] in comm/backend.h) on NCCL: the ops
// issued in the block are checked, described and agreed on at their call as any op, then
// staged here (the launch, copied: it captures by value; a slot each, filled but not yet
// issued), and end_block() enqueues them all in one ncclGroupStart/End under the lock:
// NCCL fuses them into as few kernel launches as it can. Not ncclGroupStart at begin_block:
// NCCL's group is per thread, so every NCCL call of the thread until the end would join it,
// other groups' ops included (whose completion events would then be recorded before their
// kernels were launched), and an abort from the watchdog or the agreement check while the
// group is open would leave NCCL holding tasks of a freed communicator. Staged, nothing
// reaches NCCL before end_block, whose group opens and closes inside one lock hold, as an
// uneven all_gather's does.
// After the launch, one event recorded on the last op's stream marks every op of the block
// complete (NCCL orders all the block's streams after its kernels): the slots take it as
// their `done` event and become issued together. Each op's deadline counts from the end of
// the block, when it was enqueued. The block holds the arrays of its calls until it is
// enqueued (comm::Backend's block_keep_), synchronous ones too: a tensor dropped inside the
// block could otherwise be reused by the caching allocator, written by work enqueued before
// the block's kernels, and read or written by them. From there a synchronous op's stream
// orders any later use of that memory, as after any synchronous call, and an async op's
// slot holds its arrays until it completes. A staged op's Work cannot be waited on before
// the block ends (InvalidArgument: the wait would never end). Ops captured into a CUDA graph
// and ops not captured cannot share a block (NCCL would refuse the group); a stream's
// capture state is asked at its first op in the block and checked again at the end.
NcclComm::WorkPtr NcclComm::stage_locked(std::unique_lock<std::mutex>& lock, const CallOpts& c,
                                         const char* what, bool host_blocking, bool captured,
                                         OpRing::Staged op) {
  const size_t staged = ring_.staged().size();
  if (staged && captured != ring_.block_captured())
    throw InvalidArgument(str_cat(
        what, " on ", where(), ": this op's stream is ", captured ? "" : "not ",
        "being captured into a CUDA graph but the coalesced block's earlier ops' ", captured ?
        "were not" : "were", "; begin or end the capture outside the block"));
  if (staged >= OpRing::kMaxBlockOps)
    throw InvalidArgument(str_cat(what, " on ", where(), ": a coalesced block holds at most ",
                                  OpRing::kMaxBlockOps, " ops; end it and begin another"));
  const Millis t = c.timeout.count() < 0 ? timeout_ : c.timeout;
  if (!captured) claim_slot_locked(lock, Deadline(t), staged);  // the block's slots follow
  const CUstream user = op.user;
  const uint64_t seq = ring_.stage(std::move(op), captured,
                                   OpRing::Call{what, c.coll_seq, c.p2p, c.desc}, t.count(),
                                   c.async ? &c.keep : nullptr);
  if (!c.want_work) return nullptr;
  return std::make_shared<NcclWork>(shared_from_this(), seq, ring_.last_collective(), user,
                                    c.async && !captured, captured, host_blocking);
}

void NcclComm::begin_block() {
  std::lock_guard<std::mutex> lock(mu_);
  usable_locked();
  ring_.open_block();
}

void NcclComm::end_block(Millis timeout, std::exception_ptr cancel) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ring_.block_open()) return;
  // No op of it may run: fail, as a mismatch does.
  if (cancel && !failure_.failed()) fail_locked(cancel);
  const std::vector<OpRing::Staged>& staged = ring_.staged();
  if (staged.empty() || failure_.failed() || !comm_) {
    // A failed or destroyed communicator runs nothing more: the staged ops (their Works
    // too) report its failure, which usable_locked raises here.
    ring_.drop_block();
    usable_locked();
    return;
  }
  CtxGuard guard(cu_, ctx_);
  const Millis t = timeout.count() < 0 ? timeout_ : timeout;
  const Deadline d(t, Clock::now());
  const bool captured = ring_.block_captured();
  std::vector<CUstream> execs(staged.size());
  try {
    for (size_t i = 0; i < staged.size(); ++i) {  // a capture begun or ended in the block
      if (i > 0 && staged[i].user == staged[i - 1].user) continue;
      int capture = CU_STREAM_CAPTURE_STATUS_NONE;
      cu_.check(cu_.stream_is_capturing(staged[i].user, &capture), "cuStreamIsCapturing");
      if ((capture != CU_STREAM_CAPTURE_STATUS_NONE) != captured)
        throw InvalidArgument(str_cat(
            "the coalesced block on ", where(), ": a stream's CUDA graph capture began or "
            "ended inside the block; its ops were not run. Begin or end captures outside "
            "coalesced blocks"));
    }
    guarded_locked(d, "coalesced block", [&] {
      auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
      grouped(nc_, check, [&] {
        for (size_t i = 0; i < staged.size(); ++i) {
          execs[i] = exec_stream_locked(staged[i].user, staged[i].async && !captured);
          staged[i].launch(execs[i], d);
        }
      });
      return ncclSuccess;
    });
    ring_.issue_block(execs.back());  // closes the block
  } catch (...) {
    // The block did not run here (or cannot be watched), and peers that ran it wait for
    // this rank: the communicator is failed, so the staged ops' Works report why (slots
    // never issued are taken by later ops).
    fail_locked(std::current_exception());
    ring_.drop_block();
    throw;
  }
}

NcclComm::WorkPtr NcclComm::all_reduce(const CallOpts& c, const void* in, void* out,
                                       size_t count, DType dt, RedOp op) {
  const auto ndt = nccl_dtype(dt, true, nc_);
  const auto nop = nccl_redop(op, dt, nc_);
  const uint32_t fp = c.fingerprint;
  const bool direct = c.direct, only = c.direct_only;
  return run(c, "all_reduce", false, [=](CUstream s, const Deadline& d) {
    if (try_direct_locked(direct, DirectPath::Kind::kAllReduce, dt, op, in, out, count, fp, only,
                          s, d))
      return;
    check_nccl_locked(nc_.all_reduce(in, out, count, ndt, nop, comm_, s), "ncclAllReduce", d);
  });
}

NcclComm::WorkPtr NcclComm::reduce(const CallOpts& c, const void* in, void* out, size_t count,
                                   DType dt, RedOp op, int root) {
  const auto ndt = nccl_dtype(dt, true, nc_);
  const auto nop = nccl_redop(op, dt, nc_);
  return run(c, "reduce", false, [=](CUstream s, const Deadline& d) {
    check_nccl_locked(nc_.reduce(in, out, count, ndt, nop, root, comm_, s), "ncclReduce", d);
  });
}

NcclComm::WorkPtr NcclComm::broadcast(const CallOpts& c, void* buf, size_t count, DType dt,
                                      int root) {
  const auto ndt = nccl_dtype(dt, false, nc_);
  return run(c, "broadcast", false, [=](CUstream s, const Deadline& d) {
    check_nccl_locked(nc_.broadcast(buf, buf, count, ndt, root, comm_, s), "ncclBroadcast", d);
  });
}


NcclComm::WorkPtr NcclComm::all_gather(const CallOpts& c, const void* in, void* out,
                                       const std::vector<size_t>& counts, DType dt) {
  MC_CHECK_EQ(counts.size(), static_cast<size_t>(size_), "all_gather counts");
  const auto ndt = nccl_dtype(dt, false, nc_);
  const size_t es = dtype_size(dt);
  if (all_equal(counts)) {  // captures the count, not the vector: no copy per call
    const size_t n = counts[0];
    const uint32_t fp = c.fingerprint;
    const bool direct = c.direct, only = c.direct_only;
    return run(c, "all_gather", false, [=](CUstream s, const Deadline& d) {
      if (try_direct_locked(direct, DirectPath::Kind::kAllGather, dt, RedOp::kSum, in, out, n, fp,
                            only,
                            s, d))
        return;
      check_nccl_locked(nc_.all_gather(in, out, n, ndt, comm_, s), "ncclAllGather", d);
    });
  }
  // Uneven: rank r broadcasts its counts[r] elements into their place in every out.
  return run(c, "all_gather", false, [=](CUstream s, const Deadline& d) {
    auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
    grouped(nc_, check, [&] {
      size_t off = 0;
      for (int r = 0; r < size_; ++r) {
        auto* dst = static_cast<uint8_t*>(out) + off * es;
        if (counts[r])
          check(nc_.broadcast(r == rank_ ? in : dst, dst, counts[r], ndt, r, comm_, s),
                "ncclBroadcast (all_gather_v)");
        off += counts[r];
      }
    });
  });
}

NcclComm::WorkPtr NcclComm::reduce_scatter(const CallOpts& c, const void* in, void* out,
                                           const std::vector<size_t>& counts, DType dt,
                                           RedOp op) {
  MC_CHECK_EQ(counts.size(), static_cast<size_t>(size_), "reduce_scatter counts");
  const auto ndt = nccl_dtype(dt, true, nc_);
  const auto nop = nccl_redop(op, dt, nc_);
  const size_t es = dtype_size(dt);
  if (all_equal(counts)) {
    const size_t n = counts[0];
    const uint32_t fp = c.fingerprint;
    const bool direct = c.direct, only = c.direct_only;
    return run(c, "reduce_scatter", false, [=](CUstream s, const Deadline& d) {
      if (try_direct_locked(direct, DirectPath::Kind::kReduceScatter, dt, op, in, out, n, fp, only,
                            s,
                            d))
        return;
      check_nccl_locked(nc_.reduce_scatter(in, out, n, ndt, nop, comm_, s), "ncclReduceScatter",
                        d);
    });
  }
  // Uneven: one reduce per block, rooted at the rank that keeps it.
  return run(c, "reduce_scatter", false, [=](CUstream s, const Deadline& d) {
    auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
    grouped(nc_, check, [&] {
      size_t off = 0;
      for (int r = 0; r < size_; ++r) {
        if (counts[r])
          check(nc_.reduce(static_cast<const uint8_t*>(in) + off * es, r == rank_ ? out : nullptr,
                           counts[r], ndt, nop, r, comm_, s),
                "ncclReduce (reduce_scatter_v)");
        off += counts[r];
      }
    });
  });
}

NcclComm::WorkPtr NcclComm::all_to_all(const CallOpts& c, const void* in, void* out,
                                       const std::vector<size_t>& send_counts,
                                       const std::vector<size_t>& recv_counts, DType dt) {
  MC_CHECK_EQ(send_counts.size(), static_cast<size_t>(size_), "all_to_all send counts");
  MC_CHECK_EQ(recv_counts.size(), static_cast<size_t>(size_), "all_to_all recv counts");
  const auto ndt = nccl_dtype(dt, false, nc_);
  const size_t es = dtype_size(dt);
  return run(c, "all_to_all", false, [=](CUstream s, const Deadline& d) {
    auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
    grouped(nc_, check, [&] {
      size_t soff = 0, roff = 0;
      for (int p = 0; p < size_; ++p) {
        if (send_counts[p])
          check(nc_.send(static_cast<const uint8_t*>(in) + soff * es, send_counts[p], ndt, p,
                         comm_, s), "ncclSend (all_to_all)");
        if (recv_counts[p])
          check(nc_.recv(static_cast<uint8_t*>(out) + roff * es, recv_counts[p], ndt, p, comm_, s),
                "ncclRecv (all_to_all)");
        soff += send_counts[p];
        roff += recv_counts[p];
      }
    });
  });
}

NcclComm::WorkPtr NcclComm::gather(const CallOpts& c, const void* in, void* out,
                                   const std::vector<size_t>& counts, DType dt, int root) {
  MC_CHECK_EQ(counts.size(), static_cast<size_t>(size_), "gather counts");
  const auto ndt = nccl_dtype(dt, false, nc_);
  const size_t es = dtype_size(dt);
  return run(c, "gather", false, [=](CUstream s, const Deadline& d) {
    auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
    grouped(nc_, check, [&] {
      if (counts[rank_]) check(nc_.send(in, counts[rank_], ndt, root, comm_, s), "ncclSend (gather)");
      if (rank_ != root) return;
      size_t off = 0;
      for (int r = 0; r < size_; ++r) {
        if (counts[r])
          check(nc_.recv(static_cast<uint8_t*>(out) + off * es, counts[r], ndt, r, comm_, s),
                "ncclRecv (gather)");
        off += counts[r];
      }
    });
  });
}

NcclComm::WorkPtr NcclComm::scatter(const CallOpts& c, const void* in, void* out,
                                    const std::vector<size_t>& counts, DType dt, int root) {
  MC_CHECK_EQ(counts.size(), static_cast<size_t>(size_), "scatter counts");
  const auto ndt = nccl_dtype(dt, false, nc_);
  const size_t es = dtype_size(dt);
  return run(c, "scatter", false, [=](CUstream s, const Deadline& d) {
    auto check = [&](ncclResult_t r, const char* w) { check_nccl_locked(r, w, d); };
    grouped(nc_, check, [&] {
      if (rank_ == root) {
        size_t off = 0;
        for (int r = 0; r < size_; ++r) {
          if (counts[r])
            check(nc_.send(static_cast<const uint8_t*>(in) + off * es, counts[r], ndt, r, comm_, s),
                  "ncclSend (scatter)");
          off += counts[r];
        }
      }
      if (counts[rank_]) check(nc_.recv(out, counts[rank_], ndt, root, comm_, s), "ncclRecv (scatter)");
    });
  });
}

NcclComm::WorkPtr NcclComm::send(const CallOpts& c, const void* buf, size_t count, DType dt,
                                 int peer) {
  const auto ndt = nccl_dtype(dt, false, nc_);
  return run(c, "send", false, [=](CUstream s, const Deadline& d) {
    check_nccl_locked(nc_.send(buf, count, ndt, peer, comm_, s), "ncclSend", d);
  });
}

NcclComm::WorkPtr NcclComm::recv(const CallOpts& c, void* buf, size_t count, DType dt, int peer) {
  const auto ndt = nccl_dtype(dt, false, nc_);
  return run(c, "recv", false, [=](CUstream s, const Deadline& d) {
    check_nccl_locked(nc_.recv(buf, count, ndt, peer, comm_, s), "ncclRecv", d);
  });
}

NcclComm::WorkPtr NcclComm::barrier(const CallOpts& c) {
  return run(c, "barrier", true, [=](CUstream s, const Deadline& d) {
    void* w = reinterpret_cast<void*>(static_cast<uintptr_t>(barrier_buf_));
    check_nccl_locked(nc_.all_reduce(w, w, 1, ncclFloat32, ncclSum, comm_, s),
                      "ncclAllReduce (barrier)", d);
  });
}

void NcclComm::order_streams(CUstream producer, CUstream waiter) {
  std::lock_guard<std::mutex> lock(mu_);
  usable_locked();
  CtxGuard guard(cu_, ctx_);
  cu_.check(cu_.event_record(order_event_, producer), "cuEventRecord (array's stream)");
  cu_.check(cu_.stream_wait_event(waiter, order_event_, 0), "cuStreamWaitEvent (stream=)");
}

std::vector<uint8_t> NcclComm::host_all_gather(const void* data, size_t bytes, Millis timeout,
                                               uint64_t coll_seq) {
  if (ring_.block_open())
    throw InvalidArgument(str_cat("all_gather of a host (numpy) array on ", where(), " waits for "
                                  "its result, and a coalesced block's ops run when the block "
                                  "ends: call it outside the block"));
  std::vector<uint8_t> out(bytes * size_);
  if (bytes == 0) return out;
  CallOpts c;
  c.stream = meta_;
  c.timeout = timeout;
  c.coll_seq = coll_seq;
  // meta_ carries nothing but these exchanges, each finished before the next: the pageable
  // copies below (which synchronize their stream) never wait on user work.
  auto work = run(c, "host_all_gather", false, [=](CUstream s, const Deadline& d) {
    const size_t need = bytes * (size_ + 1);
    if (scratch_bytes_ < need) {
      CUdeviceptr p = 0;
      cu_.check(cu_.mem_alloc(&p, need), "cuMemAlloc (metadata scratch)");
      if (scratch_) cu_.mem_free(scratch_);
      scratch_ = p;
      scratch_bytes_ = need;
    }
    cu_.check(cu_.memcpy_htod_async(scratch_, data, bytes, s), "cuMemcpyHtoDAsync");
    auto* dev = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(scratch_));
    check_nccl_locked(nc_.all_gather(dev, dev + bytes, bytes, ncclUint8, comm_, s),
                      "ncclAllGather (metadata)", d);
  });
  work->synchronize(Millis(-1));  // bounded by the op's deadline (watchdog)
  std::lock_guard<std::mutex> lock(mu_);
  usable_locked();
  CtxGuard guard(cu_, ctx_);
  cu_.check(cu_.memcpy_dtoh_async(out.data(), scratch_ + bytes, bytes * size_, meta_),
            "cuMemcpyDtoHAsync");
  return out;
}

}  // namespace meshcoll::nccl
