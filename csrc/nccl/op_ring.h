// The op ring of an NCCL communicator (OpRing): each op's slot and completion event, the
// counts of ops issued and completed, and the coalesced block's staged ops; and the Work
// handle that asks the communicator about its op (NcclWork). OpRing is a member of NcclComm
// (nccl_comm.h); its code, and the communicator's side (waiting for a slot, the watchdog's
// poll, NcclWork's questions), are op_ring.cc.
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

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include "comm/work.h"
#include "common/deadline.h"
#include "common/op_desc.h"
#include "nccl/nccl_abi.h"
#include "nccl/nccl_api.h"

namespace meshcoll::nccl {

class NcclComm;

// The ops of one communicator, from their issue to their completion (Note [NCCL streams and
// Works]): a fixed ring of slots, each with its op's completion event, stream and deadline
// and what messages and the ledger need of it; the numbers of ops issued and completed
// (Note [Completion by bisection]); and the open coalesced block's staged ops, whose slots
// follow the issued ones (Note [Coalesced blocks on NCCL] in nccl_ops.cc). It answers the
// communicator's questions about ops; failing, aborting and the messages stay the
// communicator's.
// Guarded by the communicator's mutex, not one of its own: an op's completion, the failure
// that voids it and the abort change together under that one lock (Note [NCCL failure
// model] in nccl_comm.h), and a second mutex would be taken inside it on every op for nothing.
class OpRing {
 public:
  static constexpr size_t kSlots = 1024;  // ops in flight before an enqueue waits
  // The most ops one block holds (half the ring: the ops before it keep their slots).
  static constexpr size_t kMaxBlockOps = kSlots / 2;
  using Keep = std::vector<std::shared_ptr<void>>;  // owners of an async op's arrays
  // Told of every op that completed without error, in issue order (Note [Call totals]).
  using OnDone = std::function<void(uint64_t coll_seq, uint64_t p2p, const OpDesc&)>;

  // What a slot says of its op (from CallOpts).
  struct Call {
    const char* what = "";
    uint64_t coll_seq = 0;  // CallOpts::coll_seq
    uint64_t p2p = 0;       // CallOpts::p2p
    OpDesc desc{};          // CallOpts::desc
  };
  struct Slot {
    abi::CUevent event = nullptr;  // this slot's own, reused
    // The event that marks this op complete: `event`, or for an op of a coalesced block the
    // block's one event (the last op's), recorded after the group's launch.
    abi::CUevent done = nullptr;
    abi::CUstream stream = nullptr;  // the event's (Note [Completion by bisection])
    Clock::time_point deadline;
    int64_t timeout_ms = 0;
    Call call;
    uint32_t direct_epoch = 0;  // a direct kernel's epoch (Note [Direct kernels]); 0: NCCL's
    Keep keep;                  // CallOpts::keep, for an async op
  };
  // An op of the open block, waiting for its end (Note [Coalesced blocks on NCCL]).
  struct Staged {
    std::function<void(abi::CUstream, const Deadline&)> launch;
    abi::CUstream user;  // the caller's stream
    bool async;          // runs on the internal stream, ordered after `user`
  };

  explicit OpRing(const CudaApi& cu) : cu_(cu) {}
  OpRing(const OpRing&) = delete;
  OpRing& operator=(const OpRing&) = delete;
  // The communicator's destructor, its context current.
  void destroy_events();

  uint64_t issued() const { return issued_; }        // ops with a slot so far
  uint64_t completed() const { return completed_; }  // every op below this has completed
  bool pending() const { return completed_ < issued_; }
  // Whether one more op fits after `staged` staged ones (else it waits: claim_slot_locked).
  bool has_room(size_t staged = 0) const { return issued_ + staged - completed_ < kSlots; }
  const Slot& slot(uint64_t op) const { return slots_[op % kSlots]; }
  // Op `op`'s completion event, queried (CUDA_SUCCESS: complete).
  abi::CUresult query(uint64_t op) const { return cu_.event_query(slot(op).done); }

  // The last collective issued (CallOpts::coll_seq), which a Work's host synchronization
  // waits to see agreed.
  void note_collective(uint64_t coll_seq) {
    if (coll_seq) last_coll_seq_ = coll_seq;
  }
  uint64_t last_collective() const { return last_coll_seq_; }

  // Takes the next slot for an op just launched on `exec` (a slot is free: has_room) and
  // records its completion event there. `keep`: an async op's arrays, held to its completion.
  // Returns the op's number.
  uint64_t issue(abi::CUstream exec, const Call& call, Clock::time_point deadline,
                 int64_t timeout_ms, uint32_t direct_epoch, const Keep* keep);

  // Moves completed() past the ops whose events completed (Note [Completion by bisection]);
  // their slots let go of their arrays and `on_done` (null: none) hears of each. Returns the
  // first failed event query (its op in *at), or CUDA_SUCCESS.
  abi::CUresult advance(uint64_t* at, const OnDone* on_done);
  // The first op still running past its deadline, or UINT64_MAX.
  uint64_t overdue(Clock::time_point now) const;
  // The first op (a slot still in the ring) of collective `coll_seq` or later; UINT64_MAX
  // when none (or coll_seq is 0).
  uint64_t first_op(uint64_t coll_seq) const;
  // The op that ran direct kernel epoch `epoch`, or completed() when it left the ring.
  uint64_t op_of_epoch(uint32_t epoch) const;
  // Every slot lets go of its arrays (the communicator failed: nothing touches them any more).
  void release_all();

  // Note [Coalesced blocks on NCCL]: the open block.
  void open_block() { block_open_ = true; }
  bool block_open() const { return block_open_; }
  bool block_captured() const { return block_captured_; }
  const std::vector<Staged>& staged() const { return staged_; }
  // Whether the open block's last op is on `user` (its capture state is the block's).
  bool staged_last_on(abi::CUstream user) const {
    return block_open_ && !staged_.empty() && staged_.back().user == user;
  }
  // Stages `op` in the open block. Not captured: it takes the slot after the staged ones (a
  // slot is free: has_room(staged().size())), filled but not issued; returns its number
  // (0 when captured: no slot).
  uint64_t stage(Staged op, bool captured, const Call& call, int64_t timeout_ms,
                 const Keep* keep);
  // The staged ops were launched, the last on `last_exec`: one event recorded there marks
  // them all complete, and they count as issued (not when captured: no slots). The block
  // closes (if this throws, it is still open: drop_block).
  void issue_block(abi::CUstream last_exec);
  // Closes the block, dropping its staged ops; slots of ops that did not run let go of their
  // arrays.
  void drop_block();

 private:
  const CudaApi& cu_;
  std::array<Slot, kSlots> slots_{};
  uint64_t issued_ = 0;
  uint64_t completed_ = 0;
  uint64_t last_coll_seq_ = 0;
  // Note [Coalesced blocks on NCCL]: the open block's staged ops; their slots follow
  // issued_ and count as issued once issue_block() ran. block_open_ is read by the issuing
  // thread alone.
  bool block_open_ = false;
  bool block_captured_ = false;  // the block's ops are captured into a CUDA graph
  std::vector<Staged> staged_;
};

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
