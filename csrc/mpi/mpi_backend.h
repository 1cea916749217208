// The MPI backend: the backend contract (comm/backend.h) over an MPI communicator of its own,
// on host memory. Each do_* method starts one nonblocking MPI call (MPI_Iallreduce, ...) and
// returns an MpiWork that completes it by a progress loop (MPI_Test), under the call's
// deadline; a synchronous call waits on it before returning.
//
// Note [MPI failure model]
// MPI cannot compare calls (ranks whose calls disagree may hang, or mix data), cannot bound a
// collective in time and cannot cancel one. So:
//  - Calls are compared on a side channel, as on NCCL (Note [Agreement on a side channel] in
//    comm/agreement.h): a CPU group of the same ranks, made by the Python layer. In strict
//    mode (MESHCOLL_CHECK=strict) a disagreement is a MismatchError on every rank before MPI is
//    called; in async mode (the default) it fails the group as soon as the check finds it:
//    a call still waiting raises MismatchError, and so does every later call (data of the
//    disagreeing call may already be wrong, as on NCCL).
//  - Every call has the group's deadline: the progress loop gives up at it with a TimeoutError
//    that names the ranks that never issued the call (the side channel's census).
//  - A failure that leaves an operation inside MPI (a deadline, a disagreement found while
//    MPI ran it) cannot be undone: MPI would still write into the buffers, and MPI_Finalize
//    would wait for it. The group is failed (every later call raises, with the failure's own
//    type as on NCCL), its Works' buffers are kept, and the job ends by MPI_Abort when the
//    group is destroyed or the process exits, which makes mpirun/srun end every rank. A
//    failure found before MPI was called (a strict disagreement, a bad argument) leaves MPI
//    clean: the group is failed, the job goes on.
//
// Note [Hierarchy on MPI]
// A world on MPI spanning hosts runs all_reduce, broadcast and all_gather as the CPU
// backend's hierarchy does (Note [Hierarchy] in python/meshcoll/hierarchy.py), reusing it
// whole: within a host the CPU backend's shared-memory algorithms, across hosts this
// backend among one leader per host. The hierarchy's steps run as ONE operation of a CPU
// group of the same ranks (the composer, whose children are a CPU group per host and the
// MPI group of the leaders): it keeps the steps of every call in one issue order, bounds
// them by the call's deadline, names the ranks that never came (its census) and fails both
// children on any step's failure. Its links carry no data, only that bookkeeping. This
// group opens the call (its ledger record, the agreement check: strict compares it before
// anything runs), hands it to the composer, and closes the record when the composer's
// operation ends; a failure there fails this group too, as any failed call does. A leaders'
// step left inside MPI by a failure ends the job as any MPI call does (above).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "comm/backend.h"
#include "comm/failure.h"

namespace meshcoll::mpi {

class MpiWork;
class ComposedWork;
class Schedule;

class MpiBackend final : public comm::Backend,
                         public std::enable_shared_from_this<MpiBackend> {
 public:
  // `comm`: the shim's communicator handle, owned from here on.
  MpiBackend(void* comm, int rank, int size, Millis timeout);
  ~MpiBackend() override;
  // The world: a duplicate of MPI_COMM_WORLD (MPI must be loaded: mpi_api.h).
  static std::shared_ptr<MpiBackend> world(Millis timeout);
  // MPI_Comm_split: collective over every rank of this group; color < 0 gets nullptr.
  std::shared_ptr<MpiBackend> split(int color, int key, Millis timeout);

  const char* name() const override { return "mpi"; }
  std::string transport() const override;
  // Turns on the agreement check over `channel` (a CPU backend among the same ranks). Once,
  // before the first call; messages name ranks as set_identity said (call it first).
  void set_agreement(std::shared_ptr<comm::Backend> channel, comm::Agreement::Mode mode);
  // Note [Hierarchy on MPI]: all_reduce, broadcast and all_gather (equal counts) go to
  // `composer`, a CPU group of the same ranks made hierarchical (shared memory inside each
  // host, this MPI group's leaders' subgroup between hosts). Once, before the first call.
  void set_hierarchy(std::shared_ptr<comm::Backend> composer);

 protected:
  friend class MpiWork;
  friend class ComposedWork;
  void do_shutdown() override;
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
  // What finishes a call once MPI completed it (avg's division, a copy out of a staging buffer).
  struct Finish;
  // Raises the group's failure if it failed; else opens the call's record and notes it to
  // the agreement check (strict: compared here, before MPI is called). After the call's own
  // checks (counts that fit MPI's ints): a refused call is never noted as issued.
  void open(Call& c);
  // Starts the MPI call (`start` returns its request through its argument, or an MPI error),
  // then makes its Work; a synchronous call waits for it here and returns nullptr.
  // `peer`: point-to-point's, for messages. `schedule`: the steps the call runs, the first
  // of which `start` started (Note [all_reduce over point-to-point] in mpi_backend.cc).
  template <class Start>
  comm::WorkPtr run(Call& c, Start&& start, Finish finish, int peer = -1,
                    std::optional<Schedule>&& schedule = std::nullopt);
  // Note [Hierarchy on MPI]: hands an opened call to the composer (`issue` makes its call
  // there) and closes this group's record of it when the composer's operation ends.
  template <class MakeCall>
  comm::WorkPtr composed(Call& c, MakeCall&& issue);
  // A composed call ended (`error` null: done): its record, totals, the group's failure.
  void end_composed(uint64_t seq, const OpDesc& desc, Clock::time_point start,
                    std::exception_ptr error);
  // Records the group's first failure; `relay`: tell the peers (not when the peers told us).
  void fail_group(std::exception_ptr error, bool relay);
  // The group's failure, for a call that finds it (nullptr: none).
  std::exception_ptr failure_for(const std::string& context) const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string where() const;  // "rank 1 (global) of group 'world' (MPI)"

  void* comm_;  // the shim's communicator (null once freed)
  const Millis timeout_;
  std::shared_ptr<comm::Agreement> agreement_;
  std::shared_ptr<comm::Backend> composer_;  // Note [Hierarchy on MPI]; null: flat calls
  mutable std::mutex mu_;  // failure_, abandoned_
  comm::Failure failure_;
  std::atomic<bool> failed_{false};
  std::atomic<int> inside_mpi_{0};  // operations MPI holds that no Work finished
  // Buffers of operations MPI still holds after the group failed (Note [MPI failure model]).
  std::vector<std::shared_ptr<void>> abandoned_;
  std::vector<std::weak_ptr<MpiWork>> live_;  // Works that may not have ended (under mu_)
  // Synchronous all_reduce's scratch space (Note [all_reduce over point-to-point]), kept
  // between calls; the issuing thread's (Note [One issuing thread]).
  std::shared_ptr<uint8_t> scratch_;
  size_t scratch_bytes_ = 0;
};

}  // namespace meshcoll::mpi
