#include "comm/ledger.h"

#include <cstdio>

#include "common/dtype.h"
#include "common/error.h"

namespace meshcoll::comm {

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

std::string describe_op(const transport::OpDesc& d) {
  auto kind = static_cast<CollKind>(d.coll);
  if (kind == CollKind::kFail) return coll_name(kind);  // no data: count and dtype say nothing
  if (kind == CollKind::kAllocSymmetric) return str_cat("empty(symmetric=True, ", d.count, " bytes)");
  std::string s = str_cat(coll_name(kind), "(count=", d.count, ", ",
                          dtype_name(static_cast<DType>(d.dtype)));
  if (kind == CollKind::kAllReduce || kind == CollKind::kReduce ||
      kind == CollKind::kReduceScatter || kind == CollKind::kReduceScatterV)
    s += str_cat(", ", redop_name(static_cast<RedOp>(d.redop)));
  if (d.root >= 0) s += str_cat(", root=", d.root);
  // Codes of algo::Algorithm (the layer above cannot be included here), then kComposedAlgo.
  static const char* const kAlgorithms[] = {"auto",   "ring", "tree",     "halving_doubling",
                                            "direct", "shm",  "hierarchy"};
  static_assert(sizeof(kAlgorithms) / sizeof(kAlgorithms[0]) == kComposedAlgo + 1);
  if (d.algo) s += str_cat(", ", d.algo <= kComposedAlgo ? kAlgorithms[d.algo] : "?");
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

transport::OpDesc make_desc(CollKind k, DType dt, size_t count, RedOp op, int root) {
  transport::OpDesc d;
  d.coll = static_cast<uint8_t>(k);
  d.dtype = static_cast<uint8_t>(dt);
  d.redop = static_cast<uint8_t>(op);
  d.root = root;
  d.count = count;
  return d;
}


std::string CallRecord::describe() const {
  std::string s = describe_op(desc);
  if (seq) s += str_cat(" [seq ", seq, "]");
  if (peer >= 0) s += str_cat(" [peer ", peer, "]");
  const std::string via = *route ? str_cat(" via ", route) : "";
  switch (state) {
    case CallState::kDone: return s + " done" + via;
    case CallState::kFailed: return s + " failed" + via;
    case CallState::kIssued: break;
  }
  return s + " pending";
}

void Ledger::write(Slot& r, uint64_t tag, const transport::OpDesc& d, int peer) {
  r.tag.store(0, std::memory_order_relaxed);  // being rewritten
  r.peer = peer;
  r.desc = d;
  r.state.store(static_cast<uint8_t>(CallState::kIssued), std::memory_order_relaxed);
  r.route.store("", std::memory_order_relaxed);
  r.tag.store(tag, std::memory_order_release);
}

void Ledger::read(const Slot& r, CallRecord* out) {
  out->peer = r.peer;
  out->desc = r.desc;
  out->state = static_cast<CallState>(r.state.load(std::memory_order_acquire));
  out->route = r.route.load(std::memory_order_relaxed);
}

uint64_t Ledger::open_collective(const transport::OpDesc& d) {
  const uint64_t seq = next_seq_.load(std::memory_order_relaxed);
  write(coll_[seq % kKeep], seq, d, -1);
  next_seq_.store(seq + 1, std::memory_order_release);
  return seq;
}

uint64_t Ledger::open_p2p(const transport::OpDesc& d, int peer) {
  const uint64_t n = next_p2p_.fetch_add(1, std::memory_order_relaxed);
  write(p2p_[n % kKeep], n, d, peer);
  return n;
}

void Ledger::p2p_state(uint64_t n, CallState s) {
  Slot& r = p2p_[n % kKeep];
  if (r.tag.load(std::memory_order_relaxed) != n) return;  // rewritten by a later transfer
  r.state.store(static_cast<uint8_t>(s), std::memory_order_release);
}

void Ledger::add_totals(const transport::OpDesc& d, uint64_t ns) {
  // Calls that move data only: not a relayed failure or a symmetric allocation.
  if (d.coll == 0 || d.coll > static_cast<uint8_t>(CollKind::kSendRecv)) return;
  Totals& t = totals_[d.coll];
  t.calls.fetch_add(1, std::memory_order_relaxed);
  t.bytes.fetch_add(d.count * dtype_size(static_cast<DType>(d.dtype)), std::memory_order_relaxed);
  t.ns.fetch_add(ns, std::memory_order_relaxed);
}

std::vector<KindTotals> Ledger::totals() const {
  std::vector<KindTotals> out;
  for (size_t k = 0; k < kKinds; ++k) {
    const Totals& t = totals_[k];
    KindTotals r{static_cast<CollKind>(k)};
    r.calls = t.calls.load(std::memory_order_relaxed);
    if (!r.calls) continue;
    r.bytes = t.bytes.load(std::memory_order_relaxed);
    r.nanoseconds = t.ns.load(std::memory_order_relaxed);
    out.push_back(r);
  }
  return out;
}

void Ledger::set_state(uint64_t seq, CallState s, const char* route) {
  Slot& r = coll_[seq % kKeep];
  if (r.tag.load(std::memory_order_relaxed) != seq) return;
  if (route) r.route.store(route, std::memory_order_relaxed);
  r.state.store(static_cast<uint8_t>(s), std::memory_order_release);
}

std::vector<CallRecord> Ledger::recent(size_t n) const {
  std::vector<CallRecord> out;
  n = std::min(n, kKeep);
  for (const auto* ring : {&coll_, &p2p_}) {
    const bool coll = ring == &coll_;
    const uint64_t next = (coll ? next_seq_ : next_p2p_).load(std::memory_order_acquire);
    const uint64_t have = std::min<uint64_t>(n, next - 1);
    for (uint64_t t = next - have; t < next; ++t) {
      const Slot& r = (*ring)[t % kKeep];
      if (r.tag.load(std::memory_order_acquire) != t) continue;  // being rewritten
      CallRecord c;
      c.seq = coll ? t : 0;
      read(r, &c);
      out.push_back(c);
    }
  }
  return out;
}

std::string Ledger::summary(size_t n) const {
  std::string s;
  for (const auto& r : recent(n)) s += (s.empty() ? "" : "; ") + r.describe();
  return s.empty() ? "no calls yet" : s;
}

}  // namespace meshcoll::comm
