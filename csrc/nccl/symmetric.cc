// Symmetric memory of one NCCL communicator: ncclMemAlloc blocks registered as windows, the
// tag that lets the agreement check compare where each rank's buffers lie, and the blocks'
// release (Note [Symmetric memory] in symmetric.h).
#include "nccl/symmetric.h"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/thread_name.h"
#include "nccl/nccl_comm.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here
using detail::CtxGuard;

namespace {
// Note [Bounded device synchronize]
// Symmetric memory is freed only once the device is idle (it may still be read or written
// by work on any stream, as cudaFree waits for). But NCCL's symmetric kernels do not end at
// ncclCommAbort: after a peer died inside one, cuCtxSynchronize would never return, and
// neither would the call, destroy() or the array's deleter that waits for it. So the
// synchronize runs on a helper thread and is waited for up to a bound; past it the memory
// is never freed (a stuck kernel may still write it) and the helper is left behind, holding
// only its own state, until the kernel ends or the process exits.
bool device_idle(const CudaApi& cu, CUcontext ctx, Millis bound) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool ok = false;
  };
  auto st = std::make_shared<State>();
  named_thread("mc-nccl-sync", [st, &cu, ctx] {
    bool ok = false;
    try {
      CtxGuard guard(cu, ctx);
      ok = cu.ctx_synchronize() == CUDA_SUCCESS;
    } catch (...) {
    }
    std::lock_guard<std::mutex> lock(st->mu);
    st->done = true;
    st->ok = ok;
    st->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait_for(lock, bound, [&] { return st->done; });
  return st->done && st->ok;
}

// Frees a block's memory after the device is idle (never, if it does not become idle).
void free_block(const NcclApi& nc, const CudaApi& cu, CUcontext ctx, void* ptr, Millis bound) {
  if (device_idle(cu, ctx, bound)) nc.mem_free(ptr);
}

uint64_t mix(uint64_t h, uint64_t v) {  // FNV-1a over 8 bytes
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}
}  // namespace

std::string NcclComm::symmetric_unavailable() const {
  if (!nc_.has_windows())
    return str_cat("symmetric windows need NCCL 2.27 or later (ncclMemAlloc, "
                   "ncclCommWindowRegister); loaded ", nc_.describe());
  return "";
}

std::shared_ptr<SymmetricBlock> NcclComm::alloc_symmetric(size_t bytes, bool zero,
                                                          Millis timeout) {
  drain_retired();
  if (!nc_.has_windows()) throw Error(symmetric_unavailable());
  bytes = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  {
    // Not under mu_: the device synchronize may wait for a stuck op that the watchdog or
    // the agreement check must be able to abort.
    CtxGuard guard(cu_, ctx_);
    if (ncclResult_t r = nc_.mem_alloc(&p, bytes); r != ncclSuccess)
      throw Error(str_cat("ncclMemAlloc(", bytes, " bytes) on ", where(), ": ",
                          nc_.error_text(r, nullptr)));
    CUresult cr = zero ? cu_.memset_d8_async(reinterpret_cast<CUdeviceptr>(p), 0, bytes, nullptr)
                       : CUDA_SUCCESS;
    if (cr != CUDA_SUCCESS) {
      nc_.mem_free(p);
      cu_.check(cr, "zeroing a symmetric block");
    }
    if (!device_idle(cu_, ctx_, timeout.count() < 0 ? timeout_ : timeout))
      throw TimeoutError(str_cat("symmetric allocation on ", where(), ": the device did not go "
                                 "idle within the timeout (a kernel that never ends?)"));
  }
  std::unique_lock<std::mutex> lock(mu_);
  CtxGuard guard(cu_, ctx_);
  ncclWindow_t win = nullptr;
  try {
    usable_locked();
    // Collective: NCCL exchanges the window with every peer (bounded by the watchdog).
    Deadline d(timeout.count() < 0 ? timeout_ : timeout);
    ncclResult_t r = guarded_locked(d, "ncclCommWindowRegister", [&] {
      return nc_.window_register(comm_, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
    });
    check_nccl_locked(r, "ncclCommWindowRegister", d);
  } catch (...) {
    nc_.mem_free(p);
    throw;
  }
  CUdevice dev = 0;
  CUcontext retained = nullptr;  // the block's own hold on the context (it may outlive us)
  cu_.check(cu_.device_get(&dev, device_), "cuDeviceGet");
  cu_.check(cu_.primary_ctx_retain(&retained, dev), "cuDevicePrimaryCtxRetain");
  if (win) windows_.add(p, bytes, win);
  return std::make_shared<SymmetricBlock>(weak_from_this(), p, bytes, win != nullptr, retained,
                                          device_, timeout_);
}

// ---- the books ---------------------------------------------------------------------------

void SymmetricWindows::add(void* base, size_t bytes, ncclWindow_t win) {
  std::lock_guard<std::mutex> wl(mu_);
  windows_[reinterpret_cast<uintptr_t>(base)] = Window{bytes, ++made_, win};
  count_.store(windows_.size(), std::memory_order_release);
}

uint32_t SymmetricWindows::tag(const void* in, size_t in_bytes, const void* out,
                               size_t out_bytes) const {
  if (count_.load(std::memory_order_acquire) == 0) return 0;
  const auto a = reinterpret_cast<uintptr_t>(in), b = reinterpret_cast<uintptr_t>(out);
  // The in-place forms (one buffer inside the other, Note [Overlapping buffers]) put x at a
  // rank's own offset: the outer buffer alone says where the call's data lies.
  // In, then out: the order is the call's, not the addresses' (windows may lie in another
  // order on another rank).
  const bool nested = a < b + out_bytes && b < a + in_bytes;
  const uintptr_t bufs[2] = {nested ? std::min(a, b) : a, b};
  const int nbufs = nested ? 1 : 2;
  std::lock_guard<std::mutex> wl(mu_);
  uint64_t h = 14695981039346656037ull;
  bool any = false;
  for (int k = 0; k < nbufs; ++k) {
    const uintptr_t p = bufs[k];
    auto it = windows_.upper_bound(p);
    if (it != windows_.begin() && p - std::prev(it)->first < std::prev(it)->second.bytes) {
      --it;
      h = mix(mix(h, it->second.number), p - it->first);
      any = true;
    } else {
      h = mix(h, 0);
    }
  }
  if (!any) return 0;
  const auto t = static_cast<uint32_t>(h ^ (h >> 32));
  return t ? t : 1;
}

bool SymmetricWindows::contains(const void* ptr, size_t bytes) const {
  std::lock_guard<std::mutex> wl(mu_);
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  auto it = windows_.upper_bound(a);
  if (it == windows_.begin()) return false;
  --it;
  return a - it->first < it->second.bytes && a - it->first + bytes <= it->second.bytes;
}

bool SymmetricWindows::retire(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> wl(mu_);
  if (closed_) return false;
  ncclWindow_t win = nullptr;
  if (auto it = windows_.find(reinterpret_cast<uintptr_t>(ptr)); it != windows_.end()) {
    win = it->second.win;
    windows_.erase(it);
    count_.store(windows_.size(), std::memory_order_release);
  }
  retired_[ptr] = win;
  retired_bytes_ += bytes;
  if (retired_bytes_ >= kDrainBytes) drain_due_.store(true, std::memory_order_release);
  return true;
}

SymmetricWindows::Retired SymmetricWindows::take_retired() {
  Retired ready;
  std::lock_guard<std::mutex> wl(mu_);
  ready.swap(retired_);
  retired_bytes_ = 0;
  drain_due_.store(false, std::memory_order_release);
  return ready;
}

std::pair<std::vector<ncclWindow_t>, SymmetricWindows::Retired> SymmetricWindows::close() {
  std::pair<std::vector<ncclWindow_t>, Retired> out;
  std::lock_guard<std::mutex> wl(mu_);
  closed_ = true;
  for (const auto& [base, w] : windows_) out.first.push_back(w.win);
  windows_.clear();
  out.second.swap(retired_);
  retired_bytes_ = 0;
  count_.store(0, std::memory_order_release);
  drain_due_.store(false, std::memory_order_release);
  return out;
}

// ---- the communicator's side ---------------------------------------------------------------

void NcclComm::drain_retired() {
  const SymmetricWindows::Retired ready = windows_.take_retired();
  if (ready.empty()) return;
  // Not under mu_: the watchdog may need it to abort an op of ours that never ends. A device
  // that stays busy past the timeout keeps the memory (Note [Bounded device synchronize]).
  if (!device_idle(cu_, ctx_, timeout_)) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_retired_locked(ready);
}

void NcclComm::free_retired_locked(const SymmetricWindows::Retired& retired) {
  for (const auto& [ptr, win] : retired) {
    if (win && comm_ && !failure_.failed()) nc_.window_deregister(comm_, win);
    nc_.mem_free(ptr);
  }
}

void NcclComm::close_windows_locked() {
  const auto [live, retired] = windows_.close();
  if (live.empty() && retired.empty()) return;
  CtxGuard guard(cu_, ctx_);  // shutdown's failed path comes here before setting it
  // A failed group's kernels may never end: a short bound, then the memory is kept.
  if (!device_idle(cu_, ctx_, failure_.failed() ? std::min(timeout_, kFailedSyncBound) : timeout_))
    return;
  for (ncclWindow_t win : live)
    if (comm_ && !failure_.failed()) nc_.window_deregister(comm_, win);
  free_retired_locked(retired);
}

SymmetricBlock::~SymmetricBlock() {
  try {
    const CudaApi& cu = cuda();
    CtxGuard guard(cu, ctx_);
    auto comm = comm_.lock();
    if (!(comm && comm->windows_.retire(ptr_, bytes_))) free_block(nccl(), cu, ctx_, ptr_, timeout_);
    CUdevice dev = 0;
    if (cu.device_get(&dev, device_) == CUDA_SUCCESS) cu.primary_ctx_release(dev);
  } catch (...) {
    // The driver is gone (process exit): so is the memory.
  }
}

}  // namespace meshcoll::nccl
