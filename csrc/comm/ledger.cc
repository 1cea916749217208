#include "comm/ledger.h"

#include "common/dtype.h"
#include "common/error.h"

namespace meshcoll::comm {

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
  }
  return "unknown";
}

std::string describe_op(const transport::OpDesc& d) {
  auto kind = static_cast<CollKind>(d.coll);
  if (kind == CollKind::kFail) return coll_name(kind);  // no data: count and dtype say nothing
  std::string s = str_cat(coll_name(kind), "(count=", d.count, ", ",
                          dtype_name(static_cast<DType>(d.dtype)));
  if (kind == CollKind::kAllReduce || kind == CollKind::kReduce ||
      kind == CollKind::kReduceScatter || kind == CollKind::kReduceScatterV)
    s += str_cat(", ", redop_name(static_cast<RedOp>(d.redop)));
  if (d.root >= 0) s += str_cat(", root=", d.root);
  // Codes of algo::Algorithm (the layer above cannot be included here).
  static const char* const kAlgorithms[] = {"auto", "ring", "tree", "halving_doubling", "direct", "shm"};
  if (d.algo) s += str_cat(", ", d.algo < 6 ? kAlgorithms[d.algo] : "?");
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
  static const char* const kStates[] = {"issued", "running", "done", "failed"};
  std::string s = describe_op(desc);
  if (seq) s += str_cat(" [seq ", seq, "]");
  if (peer >= 0) s += str_cat(" [peer ", peer, "]");
  s += str_cat(" ", kStates[static_cast<int>(state)]);
  if (state == CallState::kDone || state == CallState::kFailed)
    s += str_cat(" in ", std::chrono::duration_cast<std::chrono::microseconds>(finished - issued).count(),
                 " us");
  return s;
}

uint64_t Ledger::open_collective(const transport::OpDesc& d) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  CallRecord& r = slot(id);
  r.id = id;
  r.seq = next_seq_++;
  r.peer = -1;
  r.desc = d;
  r.state = CallState::kIssued;
  r.issued = Clock::now();
  return r.seq;
}

uint64_t Ledger::open_p2p(const transport::OpDesc& d, int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  CallRecord& r = slot(id);
  r.id = id;
  r.seq = 0;
  r.peer = peer;
  r.desc = d;
  r.state = CallState::kIssued;
  r.issued = Clock::now();
  return id;
}

void Ledger::set_state(uint64_t seq, CallState s) {
  std::lock_guard<std::mutex> lock(mu_);
  // The record is among the last kKeep calls unless that many were issued since.
  for (size_t i = 1; i <= kKeep && i < next_id_; ++i) {
    CallRecord& r = slot(next_id_ - i);
    if (r.seq == seq) {
      r.state = s;
      if (s == CallState::kDone || s == CallState::kFailed) r.finished = Clock::now();
      return;
    }
    if (r.seq && r.seq < seq) return;
  }
}

std::vector<CallRecord> Ledger::recent(size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CallRecord> out;
  const uint64_t have = std::min<uint64_t>(std::min(n, kKeep), next_id_ - 1);
  for (uint64_t id = next_id_ - have; id < next_id_; ++id) out.push_back(ring_[id % kKeep]);
  return out;
}

std::string Ledger::summary(size_t n) const {
  std::string s;
  for (const auto& r : recent(n)) s += (s.empty() ? "" : "; ") + r.describe();
  return s.empty() ? "no calls yet" : s;
}

uint64_t Ledger::last_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_seq_ - 1;
}

}  // namespace meshcoll::comm
