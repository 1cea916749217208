// Same-host collectives over shared memory (csrc/transport/shm/segment.h): ranks read each
// other's data areas directly, with no kernel copies and no per-byte syscalls.
//
// Note [Shared-memory rounds]
// Work moves in rounds; every rank runs the same rounds in the same order (one counter per
// group). Each rank writes only its own segment. The data area is split in two halves used
// by alternate rounds, so before writing round R a rank waits only until every rank has
// *released* round R-2 (finished reading that half): the wait is almost always already
// satisfied, and a round costs one or two synchronisations instead of three. A round
// publishes its OpDesc and sequence number (per half) with `arrived`, so ranks compare what
// they called before reading anything: the agreement check of the TCP path, in memory.
#include <cstring>

#include "algo/collectives.h"
#include "algo/plan.h"
#include "common/check.h"
#include "reduce/kernels.h"
#include "transport/shm/segment.h"

namespace meshcoll::algo {

namespace {
using transport::ShmGroup;

const char* op_name(const comm::Comm& comm) {
  return comm::coll_name(static_cast<comm::CollKind>(comm.current().op.coll));
}

// Round R begins: wait until every rank is done reading round R-2 (same half), then publish.
uint64_t begin_round(comm::Comm& comm, ShmGroup& g) {
  uint64_t round = comm.next_shm_round();
  if (round > 2)
    g.wait_all(ShmGroup::kReleased, round - 2, comm.deadline(), comm.shm_check(), op_name(comm));
  auto& me = g.control(g.rank());
  me.desc[round & 1] = comm.current().op;
  me.seq[round & 1] = comm.current().seq;
  return round;
}

// Rank p's half of the data area for `round`, and its size.
uint8_t* area(ShmGroup& g, int p, uint64_t round) {
  return g.data(p) + (round & 1) * (g.data_bytes() / 2);
}
size_t area_bytes(const ShmGroup& g) { return g.data_bytes() / 2; }

// At or below this many bytes read per rank, every rank folds the whole vector itself: one
// synchronisation (arrive) instead of two (arrive, reduced), for the cost of n reads.
constexpr size_t kFoldAllBytes = 64 * 1024;

void arrive(ShmGroup& g, uint64_t round) { g.publish(ShmGroup::kArrived, round); }

void check_agreement(ShmGroup& g, int peer, uint64_t round) {
  const int h = round & 1;
  const auto& mine = g.control(g.rank());
  const auto& theirs = g.control(peer);
  if (theirs.seq[h] == mine.seq[h] && theirs.desc[h] == mine.desc[h]) return;
  throw MismatchError(str_cat(
      "collective mismatch: rank ", peer, " called ", comm::describe_op(theirs.desc[h]),
      " [seq ", theirs.seq[h], "] but rank ", g.rank(), " called ",
      comm::describe_op(mine.desc[h]), " [seq ", mine.seq[h], "]",
      theirs.desc[h].shape != mine.desc[h].shape ? " (array shapes differ)" : "",
      "; every rank of a group must call the same collectives, with the same count, dtype, op "
      "and root, in the same order"));
}

void check_all(ShmGroup& g, uint64_t round) {
  for (int p = 0; p < g.size(); ++p) check_agreement(g, p, round);
}

void release(ShmGroup& g, uint64_t round) { g.publish(ShmGroup::kReleased, round); }
}  // namespace

// All-reduce of a chunk per round: every rank copies its chunk in. Small chunks: every rank
// folds the whole chunk from every area, in rank order. Large ones: rank r folds slice r of
// every area in rank order (deterministic) and publishes it, then every rank copies the other
// slices out. Per rank that reads and writes each byte about three times, against 2(n-1)/n
// sends plus kernel copies on each side for the TCP ring.
void shm_all_reduce(comm::Comm& comm, const AllreduceArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  const size_t chunk = std::max<size_t>(1, area_bytes(g) / esz);
  auto fold = reduce::lookup(a.dtype, a.op);
  const char* what = op_name(comm);
  size_t off = 0;
  do {
    const size_t c = std::min(chunk, a.count - off);
    uint8_t* out = a.out.data + off * esz;
    uint64_t round = begin_round(comm, g);
    const bool fold_all = c * esz * n <= kFoldAllBytes;
    const Blocks slices(c, n);
    const size_t s = slices.offset(r) * esz, len = slices.length(r);
    uint8_t* mine = area(g, r, round);
    if (fold_all) {
      std::memcpy(mine, out, c * esz);
    } else {  // every slice but my own: that one only I fold, straight from `out`
      std::memcpy(mine, out, s);
      std::memcpy(mine + s + len * esz, out + s + len * esz, (c - slices.offset(r) - len) * esz);
    }
    arrive(g, round);
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    check_all(g, round);
    if (fold_all) {
      if (c) {
        std::memcpy(out, area(g, 0, round), c * esz);
        for (int p = 1; p < n; ++p) fold(out, area(g, p, round), c);
      }
    } else {
      // Slice r: this rank's own values (still in `out`), then every other rank's in rank
      // order. Only this rank computes slice r, so all ranks get the same bits.
      if (len) {
        for (int p = 0; p < n; ++p)
          if (p != r) fold(out + s, area(g, p, round) + s, len);
        std::memcpy(mine + s, out + s, len * esz);
      }
      g.publish(ShmGroup::kReduced, round);
      g.wait_all(ShmGroup::kReduced, round, comm.deadline(), comm.shm_check(), what);
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        size_t ps = slices.offset(p) * esz;
        std::memcpy(out + ps, area(g, p, round) + ps, slices.length(p) * esz);
      }
    }
    release(g, round);
    off += c;
  } while (off < a.count);
}

// Broadcast: the root copies a chunk in per round; the others copy it out.
void shm_broadcast(comm::Comm& comm, const BroadcastArgs& a) {
  ShmGroup& g = *comm.shm();
  const int r = g.rank();
  const char* what = op_name(comm);
  size_t off = 0;
  do {
    const size_t c = std::min(area_bytes(g), a.buf.size - off);
    uint64_t round = begin_round(comm, g);
    if (r == a.root) std::memcpy(area(g, r, round), a.buf.data + off, c);
    arrive(g, round);
    // Every rank waits for all (not only the root) and compares every OpDesc, so ranks that
    // name different roots all raise MismatchError instead of silently diverging.
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    check_all(g, round);
    if (r != a.root) std::memcpy(a.buf.data + off, area(g, a.root, round), c);
    release(g, round);
    off += c;
  } while (off < a.buf.size);
}

// All-gather: in round k every rank copies chunk k of its block in, then every rank copies
// every other rank's chunk k out. Blocks may differ in size (the _v variant).
void shm_all_gather(comm::Comm& comm, const AllGatherArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const char* what = op_name(comm);
  std::vector<size_t> at(n + 1, 0);
  for (int p = 0; p < n; ++p) at[p + 1] = at[p] + a.bytes[p];
  MC_CHECK_EQ(at[n], a.out.size);
  if (a.in.data != a.out.data + at[r] && a.bytes[r]) std::memmove(a.out.data + at[r], a.in.data, a.bytes[r]);
  const size_t longest = *std::max_element(a.bytes.begin(), a.bytes.end());
  const size_t S = area_bytes(g);
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    if (off < a.bytes[r])
      std::memcpy(area(g, r, round), a.in.data + off, std::min(S, a.bytes[r] - off));
    arrive(g, round);
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    check_all(g, round);
    for (int p = 0; p < n; ++p) {
      if (p == r || off >= a.bytes[p]) continue;
      std::memcpy(a.out.data + at[p] + off, area(g, p, round), std::min(S, a.bytes[p] - off));
    }
    release(g, round);
    off += S;
  } while (off < longest);
}

// Reduce-scatter: in round k every rank copies chunk k of every other rank's block into its
// area (block b at slot b); rank r then folds chunk k of its own block: its own values,
// straight from its input, then every other rank's in rank order. One synchronisation per
// round, and only the owner computes a block, so the result is deterministic.
void shm_reduce_scatter(comm::Comm& comm, const ReduceScatterArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  const char* what = op_name(comm);
  auto fold = reduce::lookup(a.dtype, a.op);
  std::vector<size_t> at(n + 1, 0);
  for (int p = 0; p < n; ++p) at[p + 1] = at[p] + a.counts[p];
  const size_t q = std::max<size_t>(1, area_bytes(g) / esz / n);  // elements per block per round
  const size_t longest = *std::max_element(a.counts.begin(), a.counts.end());
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    uint8_t* mine = area(g, r, round);
    for (int b = 0; b < n; ++b) {
      if (b == r || off >= a.counts[b]) continue;
      std::memcpy(mine + b * q * esz, a.in.data + (at[b] + off) * esz,
                  std::min(q, a.counts[b] - off) * esz);
    }
    arrive(g, round);
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    check_all(g, round);
    if (off < a.counts[r]) {
      const size_t len = std::min(q, a.counts[r] - off);
      uint8_t* dst = a.out.data + off * esz;
      std::memmove(dst, a.in.data + (at[r] + off) * esz, len * esz);
      for (int p = 0; p < n; ++p)
        if (p != r) fold(dst, area(g, p, round) + r * q * esz, len);
    }
    release(g, round);
    off += q;
  } while (off < longest);
}

// All-to-all with equal blocks: in round k every rank copies chunk k of each block it sends
// into its area (the block for rank p at slot p), then copies chunk k of slot r from every
// peer's area into its output. One synchronisation per round.
void shm_all_to_all(comm::Comm& comm, const AllToAllArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const char* what = op_name(comm);
  const size_t block = a.send_bytes[0];
  const size_t q = std::max<size_t>(1, area_bytes(g) / n);  // bytes per block per round
  size_t off = 0;
  do {
    const size_t len = std::min(q, block - std::min(block, off));
    uint64_t round = begin_round(comm, g);
    uint8_t* mine = area(g, r, round);
    for (int p = 0; p < n; ++p)
      if (p != r && len) std::memcpy(mine + p * q, a.in.data + p * block + off, len);
    arrive(g, round);
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    check_all(g, round);
    for (int p = 0; p < n; ++p) {
      if (!len) break;
      const uint8_t* src = p == r ? a.in.data + r * block + off : area(g, p, round) + r * q;
      std::memmove(a.out.data + p * block + off, src, len);
    }
    release(g, round);
    off += q;
  } while (off < block);
}

void shm_barrier(comm::Comm& comm) {
  ShmGroup& g = *comm.shm();
  uint64_t round = begin_round(comm, g);
  arrive(g, round);
  g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), "barrier");
  check_all(g, round);
  release(g, round);
}

}  // namespace meshcoll::algo
