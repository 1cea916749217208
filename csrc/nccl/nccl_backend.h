// The NCCL backend: the backend contract (comm/backend.h) over an NcclComm. Each do_* method
// turns the checked call into NCCL calls on the caller's stream (or, async, the group's
// internal stream): see Note [NCCL streams and Works] in op_ring.h.
#pragma once

#include <memory>
#include <string>

#include "comm/agreement.h"
#include "comm/backend.h"
#include "nccl/nccl_comm.h"
#include "nccl/span_copy.h"

namespace meshcoll::nccl {

class NcclBackend final : public comm::Backend {
 public:
  explicit NcclBackend(std::shared_ptr<NcclComm> comm);
  ~NcclBackend() override {
    comm_->set_on_done(nullptr);  // the communicator may outlive this (held by a Work)
    if (agreement_) agreement_->stop(true);  // dropped without destroy(): nothing to compare
  }
  // Collective over the group `store` is namespaced for.
  static std::shared_ptr<NcclBackend> create(std::shared_ptr<store::Store> store, int rank,
                                             int size, int device, Millis timeout);
  // ncclCommSplit: collective over every rank of this group; color < 0 gets nullptr.
  std::shared_ptr<NcclBackend> split(int color, int key, Millis timeout);

  const char* name() const override { return "nccl"; }
  std::string transport() const override { return "nccl"; }
  int device() const override { return comm_->device(); }
  NcclComm& comm() { return *comm_; }
  // Turns on the agreement check (Note [Agreement on a side channel]) over `channel`, a CPU
  // backend among the same ranks. Set once, before the group's first collective.
  // Messages name ranks as set_identity said (call it first).
  void set_agreement(std::shared_ptr<comm::Backend> channel, comm::Agreement::Mode mode);
  // Collective: `bytes` of symmetric memory on every rank (Note [Symmetric memory]). The
  // ranks agree on the size first, in every check mode: a disagreement is a MismatchError
  // before NCCL is asked.
  std::shared_ptr<SymmetricBlock> alloc_symmetric(size_t bytes, bool zero, Millis timeout);
  // Every rank's `bytes` of host memory, in rank order (blocks): a user's all_gather of a
  // numpy array, or an internal exchange of a composed call (Note [Internal exchanges] in
  // common/op_desc.h), described by `d` and agreed on as any call before it returns.
  std::vector<uint8_t> host_all_gather(const void* data, size_t bytes,
                                       const OpDesc& d, Millis timeout);
  // Note [Span copies]: one kernel launch for many device copies, on `stream`.
  void copy_spans(const std::vector<comm::CopySpan>& spans, comm::Stream stream) override {
    copier_.copy(spans, static_cast<abi::CUstream>(stream));
  }

 protected:
  // Stops the agreement check (comparing what remains), then lets issued work finish.
  void do_shutdown() override;
  void do_begin_coalesced() override { comm_->begin_block(); }
  // Agrees on the block's calls on symmetric memory (once, for all of them), then enqueues it.
  void do_end_coalesced(Millis timeout) override;
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
  void on_identity() override { comm_->set_rank_names(names()); }

 private:
  // Opens the call's record (and notes it to the agreement check); `in`/`out`: its buffers,
  // whose symmetric windows are part of its description. `direct`: a direct kernel takes the
  // call if it is eager (NcclComm::prepare_direct). True: the call skipped its agreement
  // before launch, which only a direct kernel may (CallOpts::direct_only).
  bool open(Call& c, const comm::ArrayView* in = nullptr, const comm::ArrayView* out = nullptr,
            bool direct = false);
  std::shared_ptr<NcclComm> comm_;
  SpanCopier copier_;
  std::shared_ptr<comm::Agreement> agreement_;
  // The open block's last call on symmetric memory, agreed before the block is enqueued
  // (Note [Agreement before launch] in comm/agreement.h); 0: none.
  uint64_t block_await_ = 0;
};

}  // namespace meshcoll::nccl
