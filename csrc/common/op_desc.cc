#include "common/op_desc.h"

#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace meshcoll {

bool exchange_kind(const std::string& of, CollKind* kind) {
  if (of == "all_gather_v") *kind = CollKind::kAllGatherVCounts;
  else if (of == "all_to_all_v") *kind = CollKind::kAllToAllVCounts;
  else if (of == "split") *kind = CollKind::kSplitTable;
  else return false;
  return true;
}

const char* coll_name(CollKind k) {
  switch (k) {
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduce: return "reduce";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kAllGatherV: return "all_gather_v";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kReduceScatterV: return "reduce_scatter_v";
    case CollKind::kAllToAll: return "all_to_all";
    case CollKind::kAllToAllV: return "all_to_all_v";
    case CollKind::kGather: return "gather";
    case CollKind::kScatter: return "scatter";
    case CollKind::kBarrier: return "barrier";
    case CollKind::kSendRecv: return "send/recv";
    case CollKind::kFail: return "relayed failure";
    case CollKind::kAllocSymmetric: return "empty(symmetric=True)";
    case CollKind::kAllGatherVCounts: return "all_gather_v's count exchange";
    case CollKind::kAllToAllVCounts: return "all_to_all_v's count exchange";
    case CollKind::kSplitTable: return "split's exchange of colors";
  }
  return "unknown";
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kHalvingDoubling: return "halving_doubling";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kShm: return "shm";
  }
  return "unknown";
}

bool algorithm_from_name(const std::string& name, Algorithm* out) {
  // "centralized" (reduce to a root, then broadcast from it) is what direct does.
  if (name == "centralized") {
    *out = Algorithm::kDirect;
    return true;
  }
  for (auto a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree,
                 Algorithm::kHalvingDoubling, Algorithm::kDirect, Algorithm::kShm}) {
    if (name == algorithm_name(a)) {
      *out = a;
      return true;
    }
  }
  return false;
}

std::string describe_op(const OpDesc& d) {
  auto kind = static_cast<CollKind>(d.coll);
  if (kind == CollKind::kFail) return coll_name(kind);  // no data: count and dtype say nothing
  if (kind == CollKind::kAllocSymmetric) return str_cat("empty(symmetric=True, ", d.count, " bytes)");
  std::string s = str_cat(coll_name(kind), "(count=", d.count, ", ",
                          dtype_name(static_cast<DType>(d.dtype)));
  if (kind == CollKind::kAllReduce || kind == CollKind::kReduce ||
      kind == CollKind::kReduceScatter || kind == CollKind::kReduceScatterV)
    s += str_cat(", ", redop_name(static_cast<RedOp>(d.redop)));
  if (d.root >= 0) s += str_cat(", root=", d.root);
  if (d.algo)
    s += str_cat(", ", d.algo < kComposedAlgo    ? algorithm_name(static_cast<Algorithm>(d.algo))
                       : d.algo == kComposedAlgo ? "hierarchy"
                                                 : "?");
  if (d.arity) s += str_cat(" of arity ", d.arity);  // a k-ary tree; none: binomial
  if (d.memory) s += str_cat(", symmetric buffers #", d.memory);
  if (d.block) s += str_cat(", in coalesced block ", d.block);
  // In a block, `shape` also holds the layout of fused calls (Note [Fused all_reduces]):
  // shown, so ranks whose fused calls split one total differently see where they differ.
  if (d.block && d.shape) {
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(d.shape));
    s += str_cat(", layout #", hex);
  }
  return s + ")";
}

OpDesc make_desc(CollKind k, DType dt, size_t count, RedOp op, int root) {
  OpDesc d;
  d.coll = static_cast<uint8_t>(k);
  d.dtype = static_cast<uint8_t>(dt);
  d.redop = static_cast<uint8_t>(op);
  d.root = root;
  d.count = count;
  return d;
}

uint32_t call_fingerprint(const OpDesc& d, uint64_t seq) {
  uint64_t words[sizeof(OpDesc) / 8];
  static_assert(sizeof(OpDesc) % 8 == 0, "the description hashes as whole words");
  std::memcpy(words, &d, sizeof(OpDesc));
  ShapeHash h;
  for (uint64_t w : words) h.mix(w);
  h.mix(seq);
  const uint64_t v = h.value();
  return static_cast<uint32_t>(v ^ (v >> 32)) | 1u;
}

}  // namespace meshcoll
