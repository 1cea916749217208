#include "comm/ledger.h"


#include "common/dtype.h"
#include "common/error.h"

namespace meshcoll::comm {

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

void Ledger::write(Slot& r, uint64_t tag, const OpDesc& d, int peer) {
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

uint64_t Ledger::open_collective(const OpDesc& d) {
  const uint64_t seq = next_seq_.load(std::memory_order_relaxed);
  write(coll_[seq % kKeep], seq, d, -1);
  next_seq_.store(seq + 1, std::memory_order_release);
  return seq;
}

uint64_t Ledger::open_p2p(const OpDesc& d, int peer) {
  const uint64_t n = next_p2p_.fetch_add(1, std::memory_order_relaxed);
  write(p2p_[n % kKeep], n, d, peer);
  return n;
}

void Ledger::p2p_state(uint64_t n, CallState s) {
  Slot& r = p2p_[n % kKeep];
  if (r.tag.load(std::memory_order_relaxed) != n) return;  // rewritten by a later transfer
  r.state.store(static_cast<uint8_t>(s), std::memory_order_release);
}

void Ledger::add_totals(const OpDesc& d, uint64_t ns) {
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
