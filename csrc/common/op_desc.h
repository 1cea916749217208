// The call description: what a call is, as every rank compares it and as messages name it.
// One record (OpDesc) for every backend and transport: it travels in TCP frames and
// shared-memory slots on the CPU, and on NCCL's host side channel; the ledger keeps it
// (comm/ledger.h); errors render it (describe_op).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace meshcoll {

#pragma pack(push, 1)
struct OpDesc {
  uint8_t coll = 0;    // CollKind
  uint8_t dtype = 0;   // DType
  uint8_t redop = 0;   // RedOp
  uint8_t algo = 0;   // algorithm code when several exist (all_reduce, reduce, broadcast),
                      // so a rank running another algorithm is a mismatch, not a hang
  int32_t root = -1;
  uint64_t count = 0;  // elements (per rank, as the collective defines it)
  // A fingerprint of what else the result depends on (Note [Fingerprints]): the array's
  // shape (all_gather), a split's counts, a fused block's calls, a composed call's
  // description; 0 where nothing else.
  uint64_t shape = 0;
  // The coalesced block the call was issued in (Note [Coalesced blocks] in comm/backend.h):
  // the group's count of blocks so far, 0 outside one. Ranks must form the same blocks.
  uint64_t block = 0;
  // Where the buffers lie when the kernels depend on it, else 0: on NCCL, a tag of the
  // symmetric windows and offsets of the call's buffers (Note [Symmetric memory]), which
  // must be the same on every rank.
  uint32_t memory = 0;
  // The tree's arity when `algo` is a tree (0: binomial; Note [Trees] in cpu/algo/tree.h), so
  // ranks that build different trees disagree instead of waiting on each other; else 0.
  // (A whole 8-byte word keeps the shared-memory slot's payload 8-aligned, and NCCL hashes
  // the struct word by word.)
  uint32_t arity = 0;
  bool operator==(const OpDesc& o) const {
    return coll == o.coll && dtype == o.dtype && redop == o.redop && algo == o.algo &&
           root == o.root && count == o.count && shape == o.shape && memory == o.memory &&
           block == o.block && arity == o.arity;
  }
  bool operator!=(const OpDesc& o) const { return !(*this == o); }
};
#pragma pack(pop)
static_assert(sizeof(OpDesc) == 40, "OpDesc travels on the wire");

// Collective kinds, as they travel in OpDesc.coll.
enum class CollKind : uint8_t {
  kAllReduce = 1,
  kReduce,
  kBroadcast,
  kAllGather,
  kAllGatherV,
  kReduceScatter,
  kReduceScatterV,
  kAllToAll,
  kAllToAllV,
  kGather,
  kScatter,
  kBarrier,
  kSendRecv,  // point-to-point
  kFail,      // Backend::fail: the group is failed on purpose (a relayed failure)
  kAllocSymmetric,  // NCCL: a symmetric window allocated together (count: bytes)
  // Note [Internal exchanges]
  // The metadata rounds of composed calls: all_gather_v's and split's all_gather of a small
  // int64 array, all_to_all_v's all_to_all of its send counts. Described as a user's
  // all_gather / all_to_all they would pair with one (the same count and dtype): a rank
  // calling all_to_all_v against a rank calling all_to_all(np.array([7, 9])) would hand that
  // rank its counts as data, with no error. Each has its own kind instead
  // (CallOptions::exchange), so it pairs only with the same exchange of the same call, and
  // anything else is a MismatchError naming both calls on every rank.
  kAllGatherVCounts,
  kAllToAllVCounts,
  kSplitTable,
  kLast = kSplitTable,
};
const char* coll_name(CollKind k);
// The kind of the internal exchange of the call named `of` ("all_gather_v", "all_to_all_v",
// "split"; Note [Internal exchanges]); false when that call has none.
bool exchange_kind(const std::string& of, CollKind* kind);

// The CPU all_reduce algorithms a user may name (OpDesc.algo), chosen in cpu/algo/.
enum class Algorithm : uint8_t { kAuto = 0, kRing, kTree, kHalvingDoubling, kDirect, kShm };
// The defaults of the all_reduce tuning (Python's CollectiveConfig, the contract's
// AllReduceTuning, the CPU engine's SelectConfig; Note [Selection table] in
// cpu/algo/select.cc says where the thresholds came from): defined here only, and exposed to
// Python as _C.ALL_REDUCE_DEFAULTS.
inline constexpr size_t kDefaultMaxSegmentBytes = 512 * 1024;     // the pipelining segment
inline constexpr size_t kDefaultTreeThresholdBytes = 256 * 1024;  // at or below: a tree
inline constexpr size_t kDefaultHdThresholdBytes = size_t{8} << 20;  // at or below, 2^k: h-d
const char* algorithm_name(Algorithm a);
bool algorithm_from_name(const std::string& name, Algorithm* out);
// OpDesc.algo of a composed call (the hierarchy's: Comm::set_composed), past the codes of
// Algorithm, which a user may name: a rank that runs the call flat, with any algorithm,
// disagrees with the ranks that run it composed.
constexpr uint8_t kComposedAlgo = static_cast<uint8_t>(Algorithm::kShm) + 1;

// "all_reduce(count=1024, float32, sum)": for error messages and logs.
std::string describe_op(const OpDesc& d);
OpDesc make_desc(CollKind k, DType dt, size_t count, RedOp op = RedOp::kSum, int root = -1);

// Note [Fingerprints]
// What ranks must agree on beyond a call's count travels in its description (OpDesc.shape)
// as a 64-bit fingerprint of a sequence of whole words: an array's shape, a split's counts,
// the counts of the calls fused in a coalesced block, a composed call's whole description.
// Ranks compare fingerprints, not the layouts, so two layouts that collide pass as one and
// mix data with no error. Collisions must not happen by accident, and the inputs are
// structured (small integers, one total split a few ways), which is where weak mixing
// fails (a hash folded to 31 bits, FNV-1a, has colliding splits of one total into three
// counts that a search finds in seconds). So each word goes through splitmix64's finalizer
// (a bijection in which every input bit reaches every output bit) before it joins the
// state, and the state through it after: words that differ in a few low bits change the
// whole state, and two different sequences of one length collide only as two random 64-bit
// values do (about 2^-64 a pair). Callers whose sequences vary in length mix the length too
// (ShapeReader in python/array.cc). Four multiplies a word, a few words a call: a few
// nanoseconds.
class ShapeHash {
 public:
  void mix(uint64_t v) { h_ = scramble(h_ ^ scramble(v)); }
  uint64_t value() const { return h_ ? h_ : 1; }  // never 0: "not checked" on the wire

 private:
  static uint64_t scramble(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  uint64_t h_ = 0x9e3779b97f4a7c15ull;
};

// A call's whole description and collective sequence number folded to 32 bits (never 0),
// equal on ranks that agree on the call: NCCL's direct kernels compare it at their barrier
// (Note [Direct kernels] in nccl/direct/direct.h), whose token holds 32 bits beside the
// epoch. A chance collision there lets a disagreement run, but the agreement check still
// compares the whole descriptions (Note [Agreement on a side channel]).
uint32_t call_fingerprint(const OpDesc& d, uint64_t seq);

}  // namespace meshcoll
