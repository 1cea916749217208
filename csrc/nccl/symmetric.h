// Symmetric memory: ncclMemAlloc memory registered as a window every rank of a communicator
// shares, and what a call's description says about it (NcclComm::window_tag). The
// communicator's side (allocation, windows, retiring dropped blocks) is in symmetric.cc.
//
// Note [Symmetric memory]
// NCCL 2.27+ runs its symmetric kernels (lower latency: peers' buffers are read and written
// directly over NVLink) when a collective's buffers lie in windows registered with
// NCCL_WIN_COLL_SYMMETRIC and every rank passes the same offset into its window.
// alloc_symmetric() is collective: each rank takes `bytes` from ncclMemAlloc and registers it
// (ncclCommWindowRegister also exchanges with the peers, so it runs under the stuck-call
// deadline); windows are numbered in registration order, the same on every rank. A call's
// window_tag() names the windows and offsets of its buffers; the backend puts it in the call's
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

#include <cstddef>
#include <memory>

#include "common/deadline.h"
#include "nccl/nccl_abi.h"

namespace meshcoll::nccl {

class NcclComm;

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
