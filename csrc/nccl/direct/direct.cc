// Direct kernels (Note [Direct kernels] in direct.h): setup, launch, teardown; compilation is
// compile.cc.
#include "nccl/direct/direct.h"

#include <cstring>
#include <functional>

#include "common/check.h"
#include "common/config.h"
#include "common/error.h"
#include "common/host_identity.h"
#include "nccl/direct/compile.h"
#include "nccl/nccl_comm.h"
#include "nccl/nccl_internal.h"

namespace meshcoll::nccl {

using namespace abi;  // NOLINT: the ABI names read best unqualified here
using detail::backoff;
using detail::CtxGuard;

namespace {

constexpr size_t kFlagsBytes = size_t{DirectPath::kMaxBlocks} * DirectPath::kMaxRanks * 8;
constexpr size_t kDataOffset = 8192;  // two parities of flags, then the staging areas
static_assert(2 * kFlagsBytes <= kDataOffset, "flags overflow");

// Args in direct_kernels.cu, field for field.
struct DirectArgs {
  const void* in;
  void* out;
  uint64_t bufs[DirectPath::kMaxRanks];
  uint64_t flags[DirectPath::kMaxRanks];
  uint64_t n;
  uint64_t stride;
  uint64_t token;
  uint64_t timeout_ns;
  uint64_t status;
  uint64_t abort_flag;
  int32_t rank;
  int32_t world;
  uint64_t res[DirectPath::kMaxRanks];
  uint64_t flags2[DirectPath::kMaxRanks];
  uint64_t token2;
  uint64_t report_epoch;
};

// One rank's half of setup, as the others read it.
struct SetupRecord {
  uint64_t host = 0;   // hash of the host identity
  uint64_t limit = 0;  // its byte limit (0: it cannot take part)
  CUipcMemHandle handle{};
  char why[96] = {};   // why it cannot take part
};

const char* type_name(DType dt) {  // the kernels' C type for a dtype; nullptr: none
  switch (dt) {
    case DType::kInt8: return "signed char";
    case DType::kUint8: return "unsigned char";
    case DType::kInt32: return "int";
    case DType::kInt64: return "long long";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "float";
    case DType::kFloat64: return "double";
    default: return nullptr;
  }
}

const char* op_name(RedOp op, DType dt) {  // the kernels' reduction for an op; nullptr: none
  switch (op) {
    case RedOp::kSum: return "Sum";
    case RedOp::kProd: return "Prod";
    case RedOp::kMin: return "Min";
    case RedOp::kMax: return "Max";
    case RedOp::kAvg: return is_floating(dt) ? "Avg" : nullptr;
    default: return nullptr;
  }
}

std::string entry_of(DirectPath::Kind kind, DType dt, RedOp op) {
  const char* head =
      "extern \"C\" __global__ void __launch_bounds__(MC_THREADS) mc_kernel(Args a) { ";
  switch (kind) {
    case DirectPath::Kind::kAllGather: return str_cat(head, "all_gather(a); }");
    case DirectPath::Kind::kAllReduce:
      return str_cat(head, "all_reduce<", type_name(dt), ", ", op_name(op, dt), ">(a); }");
    case DirectPath::Kind::kReduceScatter:
      return str_cat(head, "reduce_scatter<", type_name(dt), ", ", op_name(op, dt), ">(a); }");
    case DirectPath::Kind::kAllReduceTwoShot:
      return str_cat(head, "all_reduce_two_shot<", type_name(dt), ", ", op_name(op, dt),
                     ">(a); }");
  }
  return {};
}

size_t round16(size_t b) { return (b + 15) / 16 * 16; }

}  // namespace

DirectPath::DirectPath(const CudaApi& cu, CUcontext ctx, int device, int rank, int size,
                       size_t limit)
    : cu_(cu), ctx_(ctx), device_(device), rank_(rank), size_(size), limit_(round16(limit)) {
  if (limit == 0) {
    local_why_ = "MESHCOLL_NCCL_DIRECT_BYTES=0";
    return;
  }
  if (size < 2 || size > kMaxRanks) {
    local_why_ = str_cat("a group of ", size, " (direct kernels serve 2 to ", kMaxRanks, ")");
    return;
  }
  CtxGuard guard(cu_, ctx_);
  try {
    const auto [major, minor] = compute_capability(cu_, device_);
    if (major < 7) {
      local_why_ = str_cat("compute capability ", major, ".", minor, " (the kernels need 7.0)");
      return;
    }
    arch_ = str_cat("sm_", major, minor);
    kernel(Kind::kAllGather, DType::kUint8, RedOp::kSum);  // NVRTC works here
    const size_t result_area = limit_ > kOneShotBytes ? limit_ : 0;
    cu_.check(cu_.mem_alloc(&mine_, kDataOffset + 2 * limit_ + result_area),
              "cuMemAlloc (direct staging)");
    cu_.check(cu_.memset_d8_async(mine_, 0, kDataOffset, nullptr), "cuMemsetD8Async");
    cu_.check(cu_.ctx_synchronize(), "cuCtxSynchronize");
    cu_.check(cu_.ipc_get_mem_handle(&handle_, mine_), "cuIpcGetMemHandle");
    cu_.check(cu_.mem_host_alloc(&host_, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
              "cuMemHostAlloc");
    std::memset(host_, 0, 64);
    status_ = host_;
    abort_ = static_cast<char*>(host_) + 8;
    cu_.check(cu_.mem_host_get_device_pointer(&host_dev_, host_, 0), "cuMemHostGetDevicePointer");
    bases_[rank_] = mine_;
  } catch (const std::exception& e) {
    local_why_ = e.what();
  }
}

DirectPath::~DirectPath() {
  // Teardown did not run (the communicator failed or was dropped): the buffer stays (Note
  // [Direct kernels]); the host words may go once no kernel runs, which a failed
  // communicator cannot promise either.
}

std::vector<uint8_t> DirectPath::record() const {
  SetupRecord r;
  const std::string id = host_identity();
  r.host = std::hash<std::string>()(id);  // every rank runs one build: one hash function
  r.limit = local_why_.empty() ? limit_ : 0;
  r.handle = handle_;
  std::strncpy(r.why, local_why_.c_str(), sizeof(r.why) - 1);
  std::vector<uint8_t> out(sizeof(r));
  std::memcpy(out.data(), &r, sizeof(r));
  return out;
}

std::string DirectPath::open_peers(const std::vector<uint8_t>& all, size_t record_bytes,
                                   const RankNames& names) {
  MC_CHECK_EQ(record_bytes, sizeof(SetupRecord), "direct setup record");
  std::vector<SetupRecord> rs(size_);
  for (int r = 0; r < size_; ++r) std::memcpy(&rs[r], all.data() + r * record_bytes, record_bytes);
  for (int r = 0; r < size_; ++r) {
    if (rs[r].limit == 0) return str_cat("rank ", names(r), ": ", rs[r].why);
    if (rs[r].host != rs[0].host)
      return str_cat("rank ", names(r), " is on another host than rank ", names(0));
    limit_ = std::min<size_t>(limit_, rs[r].limit);
  }
  CtxGuard guard(cu_, ctx_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    CUresult e =
        cu_.ipc_open_mem_handle(&bases_[r], rs[r].handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (e != CUDA_SUCCESS)
      return str_cat("rank ", names(rank_), " cannot map rank ", names(r), "'s memory "
                     "(cuIpcOpenMemHandle: ", cu_.error_text(e), "; no peer access between "
                     "the GPUs?)");
    opened_[r] = true;
  }
  return "";
}

void DirectPath::set_on(bool on, std::string why) {
  on_ = on;
  why_ = std::move(why);
  if (!on_) {
    close_peers();
    free_buffer();
  }
}

bool DirectPath::takes(Kind kind, DType dt, RedOp op, size_t count) const {
  if (!on_ || count == 0) return false;
  if (kind != Kind::kAllGather && (!type_name(dt) || !op_name(op, dt))) return false;
  const size_t bytes = count * dtype_size(dt);
  if (kind == Kind::kAllReduce) return bytes <= limit_;
  const size_t staged = kind == Kind::kReduceScatter ? size_ * round16(bytes) : bytes;
  return staged <= std::min(limit_, kOneShotBytes);
}

std::vector<std::string> DirectPath::entries() {
  std::vector<std::string> out{entry_of(Kind::kAllGather, DType::kUint8, RedOp::kSum)};
  for (int t = 0; t < kNumDTypes; ++t)
    for (int o = 0; o < kNumRedOps; ++o) {
      const auto dt = static_cast<DType>(t);
      const auto op = static_cast<RedOp>(o);
      if (!type_name(dt) || !op_name(op, dt)) continue;
      out.push_back(entry_of(Kind::kAllReduce, dt, op));
      out.push_back(entry_of(Kind::kReduceScatter, dt, op));
      out.push_back(entry_of(Kind::kAllReduceTwoShot, dt, op));
    }
  return out;
}

CUfunction DirectPath::kernel(Kind kind, DType dt, RedOp op) {
  if (kind == Kind::kAllGather) {
    dt = DType::kInt8;
    op = RedOp::kSum;
  }
  CUfunction& slot = fns_[static_cast<int>(kind)][static_cast<int>(dt)][static_cast<int>(op)];
  if (!slot) slot = load_direct_kernel(cu_, ctx_, arch_, entry_of(kind, dt, op));
  return slot;
}

void DirectPath::launch(Kind kind, DType dt, RedOp op, const void* in, void* out, size_t count,
                        uint32_t fingerprint, int64_t timeout_ms, CUstream stream,
                        CUevent last_done) {
  kind = route(kind, dt, count);
  const bool two_shot = kind == Kind::kAllReduceTwoShot;
  CUfunction fn = kernel(kind, dt, op);
  // Direct ops run one after another (Note [Direct kernels]): across streams, by an event.
  if (epoch_ != 0 && stream != last_stream_ && last_done)  // (nullptr: the legacy stream)
    cu_.check(cu_.stream_wait_event(stream, last_done, 0), "cuStreamWaitEvent (direct order)");
  // An epoch per barrier. 0 is the flags' initial value; after a wrap the parity must still
  // alternate.
  auto next_epoch = [this] {
    if (++epoch_ == 0) epoch_ = 2;
    return epoch_;
  };
  const uint32_t first = next_epoch();
  const uint32_t second = two_shot ? next_epoch() : first;
  const size_t parity = first & 1;
  const size_t es = dtype_size(dt);
  DirectArgs a{};
  a.in = in;
  a.out = out;
  for (int r = 0; r < size_; ++r) {
    a.bufs[r] = bases_[r] + kDataOffset + parity * limit_;
    a.flags[r] = bases_[r] + parity * kFlagsBytes;
    a.res[r] = bases_[r] + kDataOffset + 2 * limit_;
    a.flags2[r] = bases_[r] + (second & 1) * kFlagsBytes;
  }
  const size_t part_bytes = count * es;
  a.n = kind == Kind::kAllGather ? part_bytes : count;
  a.stride = round16(part_bytes);
  a.token = (uint64_t{first} << 32) | fingerprint;
  a.token2 = (uint64_t{second} << 32) | fingerprint;
  a.report_epoch = uint64_t{second} << 32;
  a.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  a.status = host_dev_;
  a.abort_flag = host_dev_ + 8;
  a.rank = rank_;
  a.world = size_;
  // One-shot: a block per 8 KiB of each rank's part, one for the smallest calls (at most 32:
  // the one-shot sizes end at kOneShotBytes). Two-shot: a block per 4 KiB of a slice.
  const size_t per_block = two_shot ? (part_bytes / size_ + 4095) / 4096
                                    : (part_bytes + 8191) / 8192;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>(kMaxBlocks, std::max<size_t>(1, per_block)));
  void* params[] = {&a};
  cu_.check(cu_.launch_kernel(fn, blocks, 1, 1, kThreads, 1, 1, 0, stream, params, nullptr),
            "cuLaunchKernel (direct kernel)");
  last_stream_ = stream;
}

void DirectPath::close_peers() {
  CtxGuard guard(cu_, ctx_);
  for (int r = 0; r < size_; ++r)
    if (opened_[r]) {
      cu_.ipc_close_mem_handle(bases_[r]);
      opened_[r] = false;
    }
}

void DirectPath::free_buffer() {
  CtxGuard guard(cu_, ctx_);
  if (mine_) cu_.mem_free(mine_);
  mine_ = 0;
  if (host_) cu_.mem_free_host(host_);
  host_ = nullptr;
  on_ = false;
}

std::string DirectPath::join(const Gather& gather, const RankNames& names) {
  const std::vector<uint8_t> mine = record();
  const std::vector<uint8_t> all = gather(mine.data(), mine.size());
  std::string why = open_peers(all, mine.size(), names);
  // Whether every rank opened every peer's buffer, and if not, why (fixed-size text).
  char mine_why[128] = {};
  std::strncpy(mine_why, why.c_str(), sizeof(mine_why) - 1);
  const std::vector<uint8_t> whys = gather(mine_why, sizeof(mine_why));
  std::string first;
  for (int r = 0; r < size_ && first.empty(); ++r)
    first.assign(reinterpret_cast<const char*>(whys.data()) + r * sizeof(mine_why),
                 strnlen(reinterpret_cast<const char*>(whys.data()) + r * sizeof(mine_why),
                         sizeof(mine_why)));
  if (first.empty()) {
    set_on(true, "");
    return first;
  }
  // Off. Some rank may have mapped this rank's buffer: it is freed only after every rank
  // closed its mappings (Note [Direct kernels]).
  close_peers();
  const uint8_t one = 1;
  gather(&one, 1);
  free_buffer();
  return first;
}

void DirectPath::close(bool healthy, Millis wait, CUstream stream, CUevent done,
                       CUevent last_done) {
  // The last direct op done, one more barrier-only op tells this rank that no peer touches
  // its buffer again (each peer's last access is its write of that op's token here).
  // A peer that does not come within `wait` (it is not destroying the group yet, or died)
  // costs this rank its buffer, not an error.
  if (healthy) {
    const Deadline d(wait);
    launch(Kind::kAllGather, DType::kUint8, RedOp::kSum, nullptr, nullptr, 0, 0xB7E0B7E0u,
           wait.count(), stream, last_done);
    CUresult q = CUDA_ERROR_NOT_READY;
    if (cu_.event_record(done, stream) == CUDA_SUCCESS) {
      int round = 0;
      while ((q = cu_.event_query(done)) == CUDA_ERROR_NOT_READY && !d.expired()) backoff(round);
    }
    if (q != CUDA_SUCCESS) abort();
    close_peers();
    if (q == CUDA_SUCCESS && status() == 0) free_buffer();
  } else {
    abort();
    close_peers();  // a failed communicator keeps its buffer (Note [Direct kernels])
  }
}

// ---- the communicator's side -----------------------------------------------------------------

void NcclComm::setup_direct(Millis timeout) {
  std::unique_ptr<DirectPath> dp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    usable_locked();
    dp = std::make_unique<DirectPath>(cu_, ctx_, device_, rank_, size_, config().nccl_direct_bytes);
  }
  std::string why = dp->join(
      [&](const void* data, size_t bytes) { return host_all_gather(data, bytes, timeout); },
      names_);
  std::lock_guard<std::mutex> lock(mu_);
  if (why.empty()) direct_ = std::move(dp);
  direct_why_ = std::move(why);
}

std::string NcclComm::direct_unavailable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return direct_ ? std::string() : direct_why_;
}

size_t NcclComm::direct_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return direct_ ? direct_->limit() : 0;
}

bool NcclComm::direct_now(CUstream stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!direct_ || ring_.block_open()) return false;
  }
  CtxGuard guard(cu_, ctx_);
  int capture = CU_STREAM_CAPTURE_STATUS_NONE;
  return cu_.stream_is_capturing(stream, &capture) == CUDA_SUCCESS &&
         capture == CU_STREAM_CAPTURE_STATUS_NONE;
}

bool NcclComm::try_direct_locked(bool direct, DirectPath::Kind kind, DType dt, RedOp op,
                                 const void* in, void* out, size_t count, uint32_t fingerprint,
                                 bool direct_only, CUstream s, const Deadline& d) {
  if (!direct || !direct_ || !launch_eager_) {
    // Only another thread's capture begun on this stream in between can get here.
    if (direct_only)
      throw InvalidArgument(str_cat(
          "a call on symmetric memory on ", where(), ": its stream began a CUDA graph capture "
          "while the call was being issued; begin captures before issuing calls on the stream"));
    return false;
  }
  direct_->launch(kind, dt, op, in, out, count, fingerprint, d.timeout().count(), s,
                  direct_last_done_);
  launched_direct_ = direct_->epoch();
  return true;
}

void NcclComm::check_direct_locked(bool no_grace) {
  if (!direct_ || failure_.failed()) return;
  const uint64_t st = direct_->status();
  if (st == 0) return;
  const auto code = static_cast<DirectPath::Code>(st & 0xff);
  if (code == DirectPath::kAborted) return;  // the host set the abort flag: failed already
  const int peer = static_cast<int>((st >> 8) & 0xff);
  const auto epoch = static_cast<uint32_t>(st >> 32);
  const uint64_t op = ring_.op_of_epoch(epoch);
  const OpRing::Slot& s = ring_.slot(op);
  const uint64_t seq = s.call.coll_seq;
  const std::string call = str_cat(s.call.what, seq ? str_cat(" [seq ", seq, "]") : "", " (op ",
                                   op, ") on ", where());
  if (code == DirectPath::kMismatch) {
    // The agreement check, when on, finds the same disagreement within a round or two and
    // names both calls: it gets kMismatchGrace to do so. Meanwhile no op from this one on
    // reports success (op_done_locked).
    if (check_.census) {
      if (direct_grace_op_ == UINT64_MAX) {
        direct_grace_op_ = op;
        direct_grace_until_ = Clock::now() + kMismatchGrace;
      }
      if (!no_grace && Clock::now() < direct_grace_until_) return;
    }
    fail_locked(std::make_exception_ptr(MismatchError(str_cat(
        call, ": rank ", names_(peer), " issued a different call at this point (another "
        "collective, dtype, count or order); the direct kernel saw it at the ranks' barrier and "
        "wrote nothing. Every rank must issue the same collectives in the same order; the "
        "communicator was aborted"))), op);
    return;
  }
  const std::string who = seq && check_.census ? check_.census(seq) : "";
  fail_locked(std::make_exception_ptr(TimeoutError(str_cat(
      call, ": rank ", names_(peer), " did not reach it within ", s.timeout_ms, " ms (direct "
      "kernel); the communicator was aborted", who, "; rebuild the group"))), op);
}

void NcclComm::close_direct_locked() {
  if (!direct_) return;
  direct_->close(!failure_.failed() && comm_, std::min(timeout_, DirectPath::kByeWait), meta_,
                 order_event_, direct_last_done_);
  direct_.reset();
}

}  // namespace meshcoll::nccl
