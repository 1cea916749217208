// Symmetric memory: ncclMemAlloc memory registered as a window every rank of a communicator
// shares, and what a call's description says about it (SymmetricWindows::tag). The
// communicator's side (allocation, registering, freeing dropped blocks) is in symmetric.cc.
//
// Note [Symmetric memory]
// NCCL 2.27+ runs its symmetric kernels (lower latency: peers' buffers are read and written
// directly over NVLink) when a collective's buffers lie in windows registered with
// NCCL_WIN_COLL_SYMMETRIC and every rank passes the same offset into its window.
// alloc_symmetric() is collective: each rank takes `bytes` from ncclMemAlloc and registers it
// (ncclCommWindowRegister also exchanges with the peers, so it runs under the stuck-call
// deadline); windows are numbered in registration order, the same on every rank. A call's
// tag() names the windows and offsets of its buffers; the backend puts it in the call's
// description, so ranks that disagree (one passes symmetric memory, another not, or another
// offset: NCCL would pick different kernels and hang or mix data) get MismatchError from the
// agreement check. The memory lives as long as its SymmetricBlock (the array's DLPack deleter
// holds it). Dropping it retires the window; the issuing thread frees retired blocks (NCCL is
// not thread-safe, and a deleter runs on any thread) at the next symmetric allocation, at
// shutdown, or at the next call once they add up to kDrainBytes: it synchronizes the device
// (the memory may still be read by other streams, as cudaFree would; bounded: Note [Bounded
// device synchronize] in symmetric.cc), then deregisters and frees them. Not at every next
// call: a dropped DataParallel would otherwise stall a later step's host until the device
// is idle. shutdown() deregisters every window; blocks
// still held then keep their memory until dropped. Where NCCL has no windows (older than
// 2.27, or symmetricSupport off on this communicator: ncclCommWindowRegister then returns no
// window) the block is ordinary ncclMemAlloc memory and symmetric() says so.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/deadline.h"
#include "nccl/nccl_abi.h"

namespace meshcoll::nccl {

class NcclComm;

// The books of one communicator's symmetric memory (Note [Symmetric memory]): its windows,
// numbered in registration order, and the dropped blocks waiting to be freed. Read on every
// call (tag) and changed by alloc_symmetric and by retire() from any thread: its own mutex,
// never held while taking the communicator's (retire may run under that one, when a slot
// drops an array's owner). The communicator does the NCCL and device work (registering,
// deregistering, freeing) on what these methods hand it.
class SymmetricWindows {
 public:
  using Retired = std::map<void*, abi::ncclWindow_t>;  // dropped blocks (window or nullptr)
  // Dropped blocks wait for the next symmetric allocation (which synchronizes anyway) or
  // shutdown, unless they add up to this much: then the next call frees them.
  static constexpr size_t kDrainBytes = size_t{1} << 30;

  // A block registered as window `win` at `base`.
  void add(void* base, size_t bytes, abi::ncclWindow_t win);
  // 0 when neither buffer lies in a window; else a tag of the windows' numbers and the
  // offsets into them, equal on every rank that passes the same ones.
  uint32_t tag(const void* in, size_t in_bytes, const void* out, size_t out_bytes) const;
  // Whether [p, p + bytes) lies in one window.
  bool contains(const void* p, size_t bytes) const;
  // A block was dropped: its window (if still registered) and memory wait for take_retired().
  // False once closed (the block frees its memory itself).
  bool retire(void* ptr, size_t bytes);
  // The dropped blocks, to free (the caller deregisters and frees them).
  Retired take_retired();
  // Whether the dropped blocks reached kDrainBytes (an atomic load: the hot path's test).
  bool drain_due() const { return drain_due_.load(std::memory_order_acquire); }
  // shutdown: every live window and dropped block, to deregister and free; later retires
  // are refused.
  std::pair<std::vector<abi::ncclWindow_t>, Retired> close();

 private:
  struct Window {
    size_t bytes = 0;
    uint64_t number = 0;  // registration order, the same on every rank
    abi::ncclWindow_t win = nullptr;
  };
  mutable std::mutex mu_;
  std::map<uintptr_t, Window> windows_;  // by base address
  std::atomic<size_t> count_{0};         // windows_.size(): the hot path's lock-free test
  uint64_t made_ = 0;
  bool closed_ = false;                  // shutdown deregistered them: retire() refuses
  Retired retired_;
  size_t retired_bytes_ = 0;
  std::atomic<bool> drain_due_{false};   // retired_bytes_ reached kDrainBytes
};

// One ncclMemAlloc allocation of a communicator, registered as a symmetric window where NCCL
// can (Note [Symmetric memory]). Freed when the last reference goes.
class SymmetricBlock {
 public:
  SymmetricBlock(std::weak_ptr<NcclComm> comm, void* ptr, size_t bytes, bool windowed,
                 abi::CUcontext ctx, int device, Millis timeout)
      : comm_(std::move(comm)), ptr_(ptr), bytes_(bytes), windowed_(windowed), ctx_(ctx),
        device_(device), timeout_(timeout) {}
  ~SymmetricBlock();
  SymmetricBlock(const SymmetricBlock&) = delete;
  SymmetricBlock& operator=(const SymmetricBlock&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  // Registered as a symmetric window (else ordinary ncclMemAlloc memory).
  bool windowed() const { return windowed_; }

 private:
  std::weak_ptr<NcclComm> comm_;
  void* ptr_;
  size_t bytes_;
  bool windowed_;
  abi::CUcontext ctx_;  // retained by the communicator at alloc; by us from then on
  int device_;
  Millis timeout_;  // the group's: how long a drop after its end waits for the device
};

}  // namespace meshcoll::nccl
