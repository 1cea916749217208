// The op ring of an NCCL communicator: each op's slot and completion event, and the Work
// handle that asks the communicator about its op. The slots live in NcclComm (nccl_comm.h);
// their code is op_ring.cc.
//
// Note [NCCL streams and Works]
// An op runs on the caller's stream (the array's stream, the stream= argument, or the
// legacy default stream), so a synchronous call costs one NCCL enqueue plus one event
// record and never blocks the host. With async=true it runs on this communicator's internal
// stream, ordered after the caller's stream through an event, so the caller's stream keeps
// computing meanwhile; Work::wait makes the caller's stream wait for the op's completion
// event (cuStreamWaitEvent: no host block) and Work::synchronize blocks the host, with a
// timeout. Every op's completion event sits in a fixed ring of kSlots slots, reused only
// after the watchdog has seen the op complete: the hot path allocates nothing but the Work.
// An op enqueued while its stream is being captured into a CUDA graph has no event and no
// deadline (it runs at each replay); its Work::wait is a no-op and synchronize refuses.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>

#include "comm/work.h"
#include "common/deadline.h"
#include "nccl/nccl_abi.h"

namespace meshcoll::nccl {

class NcclComm;

// Handle on one enqueued op (the backend contract's Work).
class NcclWork final : public comm::Work {
 public:
  // `coll_seq`: the group's last collective issued with or before this op, whose agreement
  // (and every earlier one's) a host synchronization waits for.
  NcclWork(std::shared_ptr<NcclComm> comm, uint64_t seq, uint64_t coll_seq,
           abi::CUstream issue_stream, bool async, bool captured, bool host_blocking)
      : comm_(std::move(comm)), seq_(seq), coll_seq_(coll_seq), issue_stream_(issue_stream),
        async_(async), captured_(captured), host_blocking_(host_blocking) {}
  // Orders `stream` (has_stream=false: the stream the op was issued from) after the op:
  // no host block, except for a barrier, which blocks the host (timeout < 0: the op's own
  // deadline). Raises the op's failure if it is known to have failed.
  void wait(Millis timeout, bool has_stream, comm::Stream stream) override;
  // Blocks the host until the op completes; TimeoutError if `timeout` (>= 0) passes first
  // (the op goes on and fails by its own deadline if it is stuck).
  void synchronize(Millis timeout) override;
  bool is_completed() override;
  std::exception_ptr exception() override;
  bool captured() const override { return captured_; }

 private:
  std::shared_ptr<NcclComm> comm_;
  uint64_t seq_, coll_seq_;
  abi::CUstream issue_stream_;
  bool async_, captured_, host_blocking_;
};

}  // namespace meshcoll::nccl
