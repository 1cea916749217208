// The backend contract: every collective and point-to-point operation over array views and
// one CallOptions, returning a Work. The CPU backend (csrc/cpu/) and the NCCL backend
// (csrc/nccl/) implement it; csrc/python/bind_backend.cc binds it once; the Python
// ProcessGroup holds one and is not subclassed per backend.
//
// Note [Guarantees above the backends]
// The public entry points here are not virtual. Each one checks what every backend needs
// checked (ranks, roots and peers in range, dtypes equal, each array exactly the size the
// collective reads or writes, per-rank counts), describes the call (the OpDesc every rank
// compares) and opens its ledger record, then hands the call to the backend's do_* method.
// So a check added here holds on every backend and every transport, and no backend can
// skip one. No call state lives in fields between calls: every entry point is re-entrant,
// and calls on different groups may run on different threads at once.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/array_view.h"
#include "comm/ledger.h"
#include "comm/work.h"
#include "common/deadline.h"
#include "common/dtype.h"

namespace meshcoll::comm {

// How all_reduce picks its algorithm on the CPU backend (codes of algo::Algorithm; the NCCL
// backend takes 0, auto, only: NCCL picks its own).
struct AllReduceTuning {
  uint8_t algorithm = 0;
  size_t max_segment_bytes = 512 * 1024;
  size_t tree_threshold_bytes = 256 * 1024;
  size_t hd_threshold_bytes = 8 << 20;
};

struct CallOptions {
  Millis timeout{-1};        // < 0: the group's default
  Stream stream = nullptr;   // GPU backends: the caller's stream (nullptr: legacy default)
  Stream wait_for = nullptr; // GPU backends: a stream `stream` must first wait for (the
                             // array's own, when stream= named another); nullptr: none
  // false: the call returns when the operation is done (CPU) or enqueued on `stream` (GPU),
  // and returns no Work. true: it returns a Work at once.
  bool async = false;
  AllReduceTuning tuning;    // all_reduce only
};

class Backend {
 public:
  // `device_memory`: the backend takes CUDA arrays, not host memory.
  Backend(int rank, int size, bool device_memory)
      : rank_(rank), size_(size), device_memory_(device_memory) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual const char* name() const = 0;           // "cpu", "nccl"
  virtual std::string transport() const = 0;      // "shm", "tcp (...)", "nccl"
  bool device_memory() const { return device_memory_; }  // a field: asked on every call
  virtual int device() const { return -1; }       // the CUDA device of a GPU backend
  Ledger& ledger() { return ledger_; }

  // Each returns nullptr for a synchronous call (opts.async false).
  WorkPtr all_reduce(const ArrayView& in, const ArrayView& out, RedOp op, const CallOptions& o);
  WorkPtr reduce(const ArrayView& in, const ArrayView& out, RedOp op, int root,
                 const CallOptions& o);
  WorkPtr broadcast(const ArrayView& buf, int root, const CallOptions& o);
  // counts[r]: elements of rank r's block, placed in rank order. `uneven`: the _v form.
  WorkPtr all_gather(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                     bool uneven, const CallOptions& o);
  // counts[r]: elements rank r keeps.
  WorkPtr reduce_scatter(const ArrayView& in, const ArrayView& out,
                         const std::vector<size_t>& counts, RedOp op, bool uneven,
                         const CallOptions& o);
  WorkPtr all_to_all(const ArrayView& in, const ArrayView& out,
                     const std::vector<size_t>& send_counts,
                     const std::vector<size_t>& recv_counts, bool uneven, const CallOptions& o);
  WorkPtr gather(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                 int root, const CallOptions& o);
  WorkPtr scatter(const ArrayView& in, const ArrayView& out, const std::vector<size_t>& counts,
                  int root, const CallOptions& o);
  WorkPtr barrier(const CallOptions& o);
  // Point-to-point always returns a Work (it completes when the peer has matched it).
  WorkPtr send(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o);
  WorkPtr recv(const ArrayView& buf, int peer, uint32_t tag, const CallOptions& o);
  // Fails the group as an operation's failure would, after the pending operations: every
  // member raises. For operations composed over several groups (the hierarchy).
  void fail(const std::string& message);
  // Lets issued work finish (each operation's deadline bounds it), then closes the group.
  virtual void shutdown() = 0;

 protected:
  // A checked, described call: what the do_* methods receive.
  struct Call {
    transport::OpDesc desc;
    const CallOptions& opts;
    uint64_t seq = 0;  // the ledger's sequence number, once the backend opened the record
    // Owners of the arrays, held by the Work until the operation completed (async only:
    // a synchronous caller holds them itself).
    std::vector<std::shared_ptr<void>> keep;
  };
  // Backend-specific checks, called before anything is described or sent.
  virtual void check_reduction(DType dt, RedOp op) const = 0;
  virtual void check_options(const char* what, const CallOptions& o) const = 0;

  virtual WorkPtr do_all_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op) = 0;
  virtual WorkPtr do_reduce(Call& c, const ArrayView& in, const ArrayView& out, RedOp op,
                            int root) = 0;
  virtual WorkPtr do_broadcast(Call& c, const ArrayView& buf, int root) = 0;
  virtual WorkPtr do_all_gather(Call& c, const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& counts) = 0;
  virtual WorkPtr do_reduce_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                                    const std::vector<size_t>& counts, RedOp op) = 0;
  virtual WorkPtr do_all_to_all(Call& c, const ArrayView& in, const ArrayView& out,
                                const std::vector<size_t>& send_counts,
                                const std::vector<size_t>& recv_counts) = 0;
  virtual WorkPtr do_gather(Call& c, const ArrayView& in, const ArrayView& out,
                            const std::vector<size_t>& counts, int root) = 0;
  virtual WorkPtr do_scatter(Call& c, const ArrayView& in, const ArrayView& out,
                             const std::vector<size_t>& counts, int root) = 0;
  virtual WorkPtr do_barrier(Call& c) = 0;
  virtual WorkPtr do_send(Call& c, const ArrayView& buf, int peer, uint32_t tag) = 0;
  virtual WorkPtr do_recv(Call& c, const ArrayView& buf, int peer, uint32_t tag) = 0;
  virtual void do_fail(const std::string& message) = 0;

 private:
  Call open(CollKind kind, const transport::OpDesc& d, const CallOptions& o, const char* what,
            std::initializer_list<const ArrayView*> arrays);
  void check_root(int root, const char* what) const;
  void check_counts(const std::vector<size_t>& counts, const char* what) const;
  void check_arrays(const char* what, const ArrayView& in, const ArrayView& out) const;

  int rank_, size_;
  bool device_memory_;
  Ledger ledger_;
};

}  // namespace meshcoll::comm
