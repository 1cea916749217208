// Direct kernels: meshcoll's own small all_reduce, all_gather and reduce_scatter among the
// GPUs of one host, launched in place of NCCL's where NCCL's fixed host cost dominates.
//
// Note [Direct kernels]
// Why: a small NCCL collective costs its host more to enqueue (plan, proxy and launch work
// inside ncclGroupEnd) than its kernel takes; back to back, a Python loop of 8-byte
// all_reduces runs at the host's pace. A direct kernel is one cuLaunchKernel, a fraction of
// that (see docs/performance.md, "2026-11-27 (1d6b19d, 2e69f9f): direct kernels against
// nccl-tests"): every rank copies its input into a staging buffer that its peers
// map through CUDA IPC, the ranks meet at a barrier of flags in the same buffers, and each
// reads every peer's staging buffer over NVLink (or PCIe peer access) and reduces (the
// one-shot algorithm; the kernel and its memory-ordering argument are in direct_kernels.cu).
// When: NCCL groups whose ranks all sit on one host, 2 to 8 of them, whose GPUs can map each
// other's memory, for calls whose staging bytes (all_reduce: the array; all_gather: this
// rank's input; reduce_scatter: the whole input) are at most config().nccl_direct_bytes
// (MESHCOLL_NCCL_DIRECT_BYTES, 0: never), eager (not captured into a CUDA graph, not in a
// coalesced block), of a dtype and op the kernels have (not float8, not bitwise, avg on
// floating types only) and equal counts. Everything else is NCCL's. The decision rests only
// on what every agreeing rank passes alike (never on alignment or streams), so agreeing
// ranks always pick the same path.
// Setup (collective, when the communicator is made): each rank compiles a kernel with NVRTC
// (found like NCCL: the nvidia wheels, then the system), allocates its staging buffer and
// exports it; the ranks exchange the handles and what stops any of them (host_all_gather),
// open each other's buffers and agree that all did. If any rank cannot, no rank uses direct
// kernels, and direct_status() says why, naming the rank. The byte limit is the smallest
// any rank set, so ranks with different environments still choose alike.
// Kernels are compiled per (collective, dtype, op) on first use, once per process and
// device: compiling all of them at setup takes too long (see docs/performance.md,
// "2026-11-27 (1d6b19d, 2e69f9f): direct kernels against nccl-tests").
// Trust: each op carries a token, its epoch (the count of direct ops on the communicator) and
// a fingerprint of its description and collective sequence number. A rank that meets another
// fingerprint at the barrier writes nothing and reports the peer in host-mapped memory; so
// does one that waits past the op's timeout, or sees the host's abort flag (set when the
// communicator fails: the watchdog's deadline, the agreement check, a peer's failure).
// NcclComm::check_direct_locked() turns a report into the communicator's failure
// (MismatchError or TimeoutError naming the peer), read when an op's completion is observed
// and before each call, so no Work reports success for an op that failed. A disagreement
// first waits up to 2 s for the agreement check, which names both calls (the kernel knows
// only that the fingerprints differ); ops from that one on report nothing meanwhile. So a
// disagreement is caught before any rank's data changes, which NCCL's own kernels cannot do
// (Note [Agreement on a side channel]).
// Ordering: direct ops of one communicator must run one after another on every rank (the
// parity argument in direct_kernels.cu). On one stream they do; an op on another stream than
// the last direct op first waits for that op's completion event.
// Teardown: a staging buffer may be freed only once no peer maps it (cuMemFree before the
// importers' cuIpcCloseMemHandle is undefined). shutdown() waits for this rank's direct ops,
// closes its mappings of the peers' buffers, meets the peers (host_all_gather) and then frees
// its own. A failed communicator cannot meet its peers: its buffer stays allocated until the
// process exits (4 KiB plus twice the byte limit of device memory).
//
// Note [Two-shot all_reduce]
// Above kOneShotBytes the one-shot kernel's reads grow as world x the array on every rank; the
// two-shot kernel (the reduce-scatter then all-gather of vLLM's and TensorRT-LLM's custom
// all-reduce) reads each element over the links twice instead: each rank stages its input,
// reduces its own 1/world slice from every rank's staging buffer into a result area, and
// after a second barrier copies the other slices from their owners' result areas. An op
// takes two epochs, one per barrier (flags of alternating parity, as any two consecutive
// barriers), and stages in the buffer of its first epoch's parity. No buffer needs more:
// the staging buffer is read by peers only before the op's second barrier, which this rank
// passes before it starts its next op; a result area is read by peers only after the second
// barrier, and rewritten only by this rank's next two-shot op after its first barrier, which
// every peer enters only after finishing the ops before it. A mismatch or timeout at the
// first barrier writes nothing; a peer lost between the two (a timeout at the second) leaves
// this rank's own slice reduced in `out`, and fails the communicator as any timeout does.
// The result area (limit bytes) is allocated only when the limit is above kOneShotBytes.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/dtype.h"
#include "common/rank_names.h"
#include "nccl/nccl_abi.h"
#include "nccl/nccl_api.h"

namespace meshcoll::nccl {

class DirectPath {
 public:
  // kAllReduceTwoShot is DirectPath's own choice for an all_reduce above kOneShotBytes
  // (callers ask for kAllReduce).
  enum class Kind : uint8_t { kAllReduce, kAllGather, kReduceScatter, kAllReduceTwoShot };
  static constexpr int kKinds = 4;
  static constexpr int kMaxRanks = 8;     // MC_MAX_RANKS in direct_kernels.cu
  static constexpr int kMaxBlocks = 64;   // the flags hold this many blocks per parity
  // The largest call of the one-shot kernels (every rank reads all of every peer's array);
  // all_reduce above it, up to the limit, runs the two-shot kernel (Note [Two-shot
  // all_reduce]); all_gather and reduce_scatter go to NCCL above it.
  static constexpr size_t kOneShotBytes = 256 << 10;
  static constexpr int kThreads = 512;    // MC_THREADS

  // This rank's half of setup: compiles a kernel, allocates and exports the staging buffer.
  // Never throws: what went wrong is kept for record().
  DirectPath(const CudaApi& cu, abi::CUcontext ctx, int device, int rank, int size, size_t limit);
  ~DirectPath();
  DirectPath(const DirectPath&) = delete;
  DirectPath& operator=(const DirectPath&) = delete;

  // Setup's collective part, after the constructor: through `gather` (every rank's bytes, in
  // rank order: the communicator's host_all_gather) the ranks exchange their records, open
  // each other's buffers and agree that all did. Returns "" when the path is on; else why not
  // (the first rank's reason), once the teardown an unused path needs is done (every rank
  // closed its mappings before any frees its buffer).
  using Gather = std::function<std::vector<uint8_t>(const void* data, size_t bytes)>;
  std::string join(const Gather& gather, const RankNames& names);
  // Teardown at shutdown. `healthy` (the communicator neither failed nor was aborted): one
  // more barrier-only op on `stream` tells this rank that no peer touches its buffer again,
  // waited for (through `done`, an event of the caller's) at most `wait`; then the buffer is
  // freed. Else, or when the peers do not come, the buffer stays (Note [Direct kernels]).
  void close(bool healthy, Millis wait, abi::CUstream stream, abi::CUevent done,
             abi::CUevent last_done);
  // How long close() waits at most for the peers' last op.
  static constexpr Millis kByeWait{5000};

  // This rank's record for setup's first exchange (host_all_gather).
  std::vector<uint8_t> record() const;
  // Given every rank's record in rank order: opens the peers' buffers. Returns "" when this
  // rank can take part, else why not.
  std::string open_peers(const std::vector<uint8_t>& all, size_t record_bytes,
                         const RankNames& names);
  // After the second exchange: on = every rank opened every peer.
  void set_on(bool on, std::string why);
  bool on() const { return on_; }
  const std::string& why_off() const { return why_; }
  size_t limit() const { return limit_; }

  // Whether a call of these sizes goes direct (the same answer on every agreeing rank).
  bool takes(Kind kind, DType dt, RedOp op, size_t count) const;
  // Compiles (once per process) and loads the op's kernel; before the communicator's lock is
  // taken, so a first call's compilation (0.2-0.5 s) never holds it.
  void prepare(Kind kind, DType dt, RedOp op, size_t count) {
    kernel(route(kind, dt, count), dt, op);
  }
  // Launches one op on `stream` (the communicator's lock held). `fingerprint`: the call's.
  void launch(Kind kind, DType dt, RedOp op, const void* in, void* out, size_t count,
              uint32_t fingerprint, int64_t timeout_ms, abi::CUstream stream,
              abi::CUevent last_done);
  // The epoch of the last op launched (0: none).
  uint32_t epoch() const { return epoch_; }
  // A kernel's failure report: 0 when none. code | peer << 8 | epoch << 32.
  uint64_t status() const { return *static_cast<volatile uint64_t*>(status_); }
  // Ends every waiting kernel (the communicator failed).
  void abort() { *static_cast<volatile uint32_t*>(abort_) = 1; }
  // Teardown, the first half: closes this rank's mappings of its peers' buffers.
  void close_peers();
  // The second half, once every peer closed its mappings: frees the staging buffer.
  void free_buffer();

  enum Code : uint8_t { kOk = 0, kMismatch = 1, kTimeout = 2, kAborted = 3 };

  // Each kernel's entry point (one line that defines mc_kernel, which NVRTC compiles with
  // direct_kernels_source() of compile.h), for every kind, dtype and op the kernels have. For
  // tests that compile them without a GPU.
  static std::vector<std::string> entries();

 private:
  // The kernel that runs a call: the two-shot one for an all_reduce above kOneShotBytes.
  static Kind route(Kind kind, DType dt, size_t count) {
    return kind == Kind::kAllReduce && count * dtype_size(dt) > kOneShotBytes
               ? Kind::kAllReduceTwoShot : kind;
  }
  // This path's kernel for a call, from the process-wide cache (compile.h) on its first use.
  abi::CUfunction kernel(Kind kind, DType dt, RedOp op);

  const CudaApi& cu_;
  abi::CUcontext ctx_;
  int device_, rank_, size_;
  size_t limit_;            // staging bytes per parity (and of the two-shot result area)
  std::string local_why_;   // this rank cannot take part ("": it can)
  std::string arch_;        // "sm_90"
  bool on_ = false;
  std::string why_;
  abi::CUdeviceptr mine_ = 0;  // flags, two staging areas, the two-shot result area
  abi::CUipcMemHandle handle_{};
  std::array<abi::CUdeviceptr, kMaxRanks> bases_{};  // every rank's buffer (ours included)
  std::array<bool, kMaxRanks> opened_{};
  void* host_ = nullptr;       // host-mapped: status (8 bytes), abort flag (4 bytes)
  void* status_ = nullptr;
  void* abort_ = nullptr;
  abi::CUdeviceptr host_dev_ = 0;
  uint32_t epoch_ = 0;
  abi::CUstream last_stream_ = nullptr;
  // This communicator's kernels by kind, dtype and op (all_gather: [kAllGather][0][0]), so a
  // call finds its kernel without the process-wide cache's lock and string key.
  std::array<std::array<std::array<abi::CUfunction, kNumRedOps>, kNumDTypes>, kKinds> fns_{};
};

}  // namespace meshcoll::nccl
