// The CPU backend: the backend contract (comm/backend.h) over its engine, a cpu::Comm (TCP
// between any hosts, shared memory within one), and the algorithms of cpu/algo. Each do_*
// method turns the checked call into an algorithm's args struct and runs it: synchronous
// calls inline when the group is idle (Note [Inline execution] in cpu/engine.h),
// asynchronous ones on the group's worker thread, in issue order.
#pragma once

#include <memory>
#include <string>

#include "comm/backend.h"
#include "cpu/engine.h"
#include "cpu/hierarchy.h"

namespace meshcoll::cpu {

class CpuBackend final : public comm::Backend {
 public:
  // Collective over the group `store` is namespaced for.
  CpuBackend(std::shared_ptr<store::Store> store, int rank, int size,
             const CommOptions& opts, uint64_t comm_id);
  ~CpuBackend() override;

  const char* name() const override { return "cpu"; }
  std::string transport() const override { return comm_->shm_status(); }
  Comm& comm() { return *comm_; }
  // Makes all_reduce (algorithm auto), broadcast and all_gather (equal counts) hierarchical
  // (Note [Hierarchy] in python/meshcoll/hierarchy.py): each call becomes one operation on
  // this group's Comm whose body runs the steps on `h`'s children. Set once, at
  // construction, before the group's first collective.
  // The children then serve only its steps (Comm::set_serves_steps).
  void set_hierarchy(std::shared_ptr<const Hierarchy> h);

 protected:
  void do_shutdown() override;
  void do_end_coalesced(Millis /*timeout*/) override { flush_staged(); }
  void check_reduction(DType dt, RedOp op) const override;
  void check_options(const char* what, const comm::CallOptions& o) const override;
  comm::WorkPtr do_all_reduce(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                              RedOp op) override;
  comm::WorkPtr do_reduce(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                          RedOp op, int root) override;
  comm::WorkPtr do_broadcast(Call& c, const comm::ArrayView& buf, int root) override;
  comm::WorkPtr do_all_gather(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                              const std::vector<size_t>& counts) override;
  comm::WorkPtr do_reduce_scatter(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                                  const std::vector<size_t>& counts, RedOp op) override;
  comm::WorkPtr do_all_to_all(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                              const std::vector<size_t>& send_counts,
                              const std::vector<size_t>& recv_counts) override;
  comm::WorkPtr do_gather(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                          const std::vector<size_t>& counts, int root) override;
  comm::WorkPtr do_scatter(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                           const std::vector<size_t>& counts, int root) override;
  comm::WorkPtr do_barrier(Call& c) override;
  comm::WorkPtr do_send(Call& c, const comm::ArrayView& buf, int peer, uint32_t tag) override;
  comm::WorkPtr do_recv(Call& c, const comm::ArrayView& buf, int peer, uint32_t tag) override;
  void do_fail(const std::string& message, std::exception_ptr like) override;

 private:
  // Runs `op` (a callable over the Comm holding its args by value) as call `c`, after the
  // staged all_reduces (Note [Fused all_reduces]).
  template <class Op>
  comm::WorkPtr run(Call& c, Op&& op);
  comm::WorkPtr run_all_reduce(Call& c, const comm::ArrayView& in, const comm::ArrayView& out,
                               RedOp op);
  // Note [Fused all_reduces]: runs the staged all_reduces, fused where they can be.
  void flush_staged();

  std::unique_ptr<Comm> comm_;
  bool dropped_ = false;  // shut down by the destructor, not destroy(): no farewell
  std::shared_ptr<const Hierarchy> hier_;  // null: flat collectives
  // Note [Fused all_reduces]: the open block's synchronous small all_reduces, not run yet.
  struct Staged {
    comm::ArrayView in, out;
    RedOp op;
    Millis timeout;
    comm::AllReduceTuning tuning;
    uint64_t block;
  };
  std::vector<Staged> staged_;
  size_t staged_bytes_ = 0;
  static constexpr size_t kFuseCallBytes = 64 << 10;  // larger calls run at their call
  static constexpr size_t kFuseBytes = 1 << 20;       // a fused call at most this big
};

}  // namespace meshcoll::cpu
