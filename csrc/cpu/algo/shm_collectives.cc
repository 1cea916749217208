// Same-host collectives over shared memory (csrc/transport/shm/segment.h): ranks read each
// other's data areas directly, with no kernel copies and no per-byte syscalls.
//
// Note [Shared-memory rounds]
// Work moves in rounds; every rank runs the same rounds in the same order (one counter per
// group). Each rank writes only its own segment. The data area is split in two halves, and
// the control block holds two slots, used by alternate rounds. A rank announces round R
// (slot R&1: its OpDesc and sequence number, then `arrived` = R) only after it has finished
// every read of round R-1, and it reads round R only after seeing every rank announce R. So
// a rank that starts round R has seen every rank announce R-1, hence finish reading R-2:
// the half and slot of R-2 are free to overwrite with no wait at all, and a round costs one
// synchronisation (two for a large all_reduce). Ranks compare the announced OpDescs before
// reading anything: the agreement check of the TCP path, in memory.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "cpu/algo/tree.h"
#include "common/check.h"
#include "reduce/kernels.h"
#include "transport/shm/segment.h"

namespace meshcoll::algo {

namespace {
using transport::ShmGroup;

const char* op_name(const cpu::Comm& comm) {
  return coll_name(static_cast<CollKind>(comm.current().op.coll));
}

// Round R begins: announce this rank's collective in slot R&1 (no wait: see the Note).
uint64_t begin_round(cpu::Comm& comm, ShmGroup& g) {
  uint64_t round = comm.next_shm_round();
  auto& slot = g.slot(g.rank(), round);
  slot.desc = comm.current().op;
  slot.seq = comm.current().seq;
  return round;
}

// Rank p's half of the data area for `round`, and its size.
uint8_t* area(ShmGroup& g, int p, uint64_t round) {
  return g.data(p) + (round & 1) * (g.data_bytes() / 2);
}
size_t area_bytes(const ShmGroup& g) { return g.data_bytes() / 2; }


// The peers' pointers of one fold of many (reduce::lookup_many, Note [Fold of many]): on the
// stack up to 64 ranks, so a small call allocates nothing.
class Sources {
 public:
  explicit Sources(size_t k) : k_(k) {
    if (k_ > kInline) heap_.resize(k_);
  }
  const void*& operator[](size_t j) { return k_ > kInline ? heap_[j] : inline_[j]; }
  const void* const* data() const { return k_ > kInline ? heap_.data() : inline_; }
  size_t size() const { return k_; }

 private:
  static constexpr size_t kInline = 64;
  size_t k_;
  const void* inline_[kInline];  // not zeroed: every caller sets all k before the fold reads
  std::vector<const void*> heap_;
};

// Whether `peer` announced the same call as this rank in round R's slot.
bool agrees(ShmGroup& g, int peer, uint64_t round) {
  const auto& mine = g.slot(g.rank(), round);
  const auto& theirs = g.slot(peer, round);
  return theirs.seq == mine.seq && theirs.desc == mine.desc;
}

void check_agreement(ShmGroup& g, int peer, uint64_t round) {
  if (agrees(g, peer, round)) return;
  const auto& mine = g.slot(g.rank(), round);
  const auto& theirs = g.slot(peer, round);
  throw MismatchError(str_cat(
      "collective mismatch: rank ", g.global_rank(peer), " called ", describe_op(theirs.desc),
      " [seq ", theirs.seq, "] but rank ", g.global_rank(g.rank()), " called ",
      describe_op(mine.desc),
      " [seq ", mine.seq, "]", theirs.desc.shape != mine.desc.shape ? " (their shapes, splits or block layouts differ)" : "",
      "; every rank of a group must call the same collectives, with the same count, dtype, op "
      "and root, in the same order"));
}

void check_all(ShmGroup& g, uint64_t round) {
  for (int p = 0; p < g.size(); ++p) check_agreement(g, p, round);
}

// This rank's part of round R is in place: announce it, wait until every rank has announced
// R, and compare what they called before reading anything (Note [Shared-memory rounds]).
// `scalable`: by a dissemination barrier (Note [Dissemination signalling]) instead of
// polling every peer.
void meet(cpu::Comm& comm, ShmGroup& g, uint64_t round, const char* what,
          bool scalable = false) {
  if (scalable) {
    g.arrive(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
    // A rank in a flat round (another collective: a disagreement) raises every step flag at
    // once, so the barrier can let this rank through before all have announced: before
    // judging, wait for every announcement, so the error names what each rank called.
    bool agree = true;
    for (int p = 0; p < g.size() && agree; ++p) agree = agrees(g, p, round);
    if (!agree) g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
  } else {
    g.publish(ShmGroup::kArrived, round);
    g.wait_all(ShmGroup::kArrived, round, comm.deadline(), comm.shm_check(), what);
  }
  check_all(g, round);
}

// all_reduce's second barrier of round R: every rank's reduced slice is in place.
void meet_reduced(cpu::Comm& comm, ShmGroup& g, uint64_t round, const char* what,
                  bool scalable) {
  if (scalable) {
    g.arrive(ShmGroup::kReduced, round, comm.deadline(), comm.shm_check(), what);
  } else {
    g.publish(ShmGroup::kReduced, round);
    g.wait_all(ShmGroup::kReduced, round, comm.deadline(), comm.shm_check(), what);
  }
}

// Note [Shared-memory all_reduce paths]
// Two paths carry an all_reduce on a shared-memory group, with the same data flow and
// different signalling. The flat one synchronises with wait_all: every rank polls every
// peer's flag, n(n-1) cache-line transfers a barrier, the likely reason it loses to Open MPI
// from 8 ranks up. The scalable one synchronises with arrive() (Note [Dissemination
// signalling]): ceil(log2 n) steps, each flag on its owner's cache line and watched by one peer. Data:
//  - small (vector x ranks <= fold_all_bytes): every rank puts its vector in its slot (up to
//    kShmInlineBytes, on the flag's own line) or its data area, one barrier, then every rank
//    reduces straight from the peers' slots or areas, in rank order (every rank gets the
//    same bits), no second barrier;
//  - larger, without cross-memory attach or below single_copy_from: reduce-scatter then
//    all-gather through the data areas, a chunk (half an area) per round. Each rank copies
//    its chunk in (all but its own slice), one barrier; rank r reduces slice r from every
//    area in 16 KiB pieces that stay in L1 (its own values first, then the peers), copying
//    each piece into its area while it is in cache; a second barrier; each rank copies the
//    other slices out (the copy-in is not overlapped with the folding: it would take
//    per-slice flags, n-1 dependent steps a round; measure before adding them);
//  - from single_copy_from, with cross-memory attach: the same reduce-scatter and
//    all-gather straight from the peers' vectors (Note [Single-copy all_reduce]), the
//    copy into shared memory avoided.
// The folds read every peer's piece in one call (reduce::lookup_many, Note [Fold of many] in
// reduce/kernels.cc): f16/bf16 are rounded once per element, not once per peer; the
// single-copy path folds one peer at a time through its scratch and rounds per peer.
// On the scalable path rank r visits its peers from r+1 on (mod n), in folding and in
// copying out, so that at any moment the n ranks read n different owners' memory (and NUMA
// nodes) instead of all reading rank 0's first; the fold order is still fixed for a given
// (n, r), and only rank r folds slice r, so results stay bitwise the same on every rank and
// run to run. NUMA: each rank allocates its segment (posix_fallocate) and writes it first,
// so its pages sit on the node where the launcher placed that rank; meshcoll pins nothing.
//
// Note [Out-of-place shared-memory all_reduce]
// Every path reads x where it is and writes out, so x != out costs no pass of its own (the
// other algorithms copy x into out first, all_reduce.cc): x is what the data areas are
// filled from, or what the peers read (single copy: a rank publishes both addresses, x for
// the reduce-scatter and out for the all-gather); this rank's own slice is read from x by
// the first fold (reduce::lookup_into: out = x OP the first peer's, the same bits as in
// place). x is never written. The data-parallel reducer's buckets rely on it: a gradient given
// elsewhere than its bucket slot is averaged straight into the slot (Note [In-place
// gradients] in reducer/reducer.h), saving the copy into the slot (6.7 ms for 33.6 MB on
// the 2-core VM).
//
// Which path takes a call is decided by kShmPaths below, by world size and bytes, the same
// on every rank (ranks that pass different sizes may take different paths: both paths'
// first barrier lets every rank reach the agreement check, Note [Dissemination
// signalling]). MESHCOLL_SHM_ALL_REDUCE=flat or =scalable overrides the table on every
// rank (agreed at setup), for bench/cpu/scaling.sh.
struct ShmPathRow {
  int ranks;                // the row holds from this many ranks up, to the next row
  size_t scalable_from;     // bytes: the scalable path from here, the flat one below
  size_t fold_all_bytes;    // at or below (bytes x ranks): every rank folds everything
  size_t single_copy_from;  // from here, with cross-memory attach: single copy
};
// Where the rows come from:
//  - 2 ranks: the flat path's limits, measured on a 2-core VM (Note [Single-copy all_reduce]);
//  - single_copy_from at 3 ranks and up: measured on a 16-core host at 4, 8 and 16 ranks,
//    both data paths forced in turn (MESHCOLL_CMA=0 / 1, MESHCOLL_SHM_SINGLE_COPY_BYTES): the
//    copy through the data areas wins below about 4 MiB at 4 ranks and below about 8 MiB at 8
//    and 16; above, single copy wins or ties (the tables: docs/performance.md). The kernel's
//    copy pins the peer's pages while n-1 other ranks read the same peer, which costs more
//    than the copy it saves until the vectors are large;
//  - scalable_from and fold_all_bytes: not measured against each other yet; the scalable
//    path is the one measured against Open MPI from 8 ranks up. The 8-rank row holds from 8
//    ranks up: measured at 8 and 16, not beyond.
// MESHCOLL_SHM_SINGLE_COPY_BYTES overrides single_copy_from on every rank (agreed at setup).
constexpr ShmPathRow kShmPaths[] = {
    // ranks  scalable from  fold all   single copy from
    {2, SIZE_MAX, 64 << 10, 16 << 10},  // 2 ranks: one flag either way
    {3, 0, 64 << 10, 4 << 20},
    {8, 0, 64 << 10, 8 << 20},
};
// The flat path's limits, whatever the world size (measured on 2 ranks).
constexpr ShmPathRow kFlatPath = {2, SIZE_MAX, 64 << 10, 16 << 10};

const ShmPathRow& shm_path_row(int n) {
  const ShmPathRow* row = &kShmPaths[0];
  for (const auto& r : kShmPaths)
    if (n >= r.ranks) row = &r;
  return *row;
}
}  // namespace

// Note [Single-copy all_reduce]
// With cross-memory attach (segment.h), vectors skip the data area: every rank publishes
// the addresses of its vector (x, and out: the same array in place), then rank r reduces
// slice r of its own vector piece by piece:
// it reads each peer's piece into an L2-sized scratch buffer and folds it in (own values
// first, then the others in a fixed order: deterministic). Once every rank has published its
// reduced slice (kReduced), each rank reads the other slices from their owners' vectors.
// A rank only ever *reads* a peer's memory and writes its own (Note [Cross-memory attach]:
// a peer that timed out and returned may already reuse its buffer, so writing into it
// would corrupt unrelated data). Reading a vector its owner gave up on can only bring
// garbage into this rank's own vector, and never silently: the owner never arrives at the
// closing empty round, so this rank's call fails too. Slice r of a vector is written by
// its owner only after every peer read its input there (the peers read slice r of rank r's
// vector in phase one; rank r overwrites its other slices only after kReduced, when every
// peer has finished phase one). Per rank each byte is read from memory twice and written
// twice (the copy path: about four times each), at three synchronisations. An average is
// divided piece by piece right after the fold, so that it costs no pass of its own over the
// vector (a separate pass cost a third of the all-reduce). Nor a pass over the piece: the
// last fold runs in parts of kSingleCopyDividePartBytes, each divided while it is still in
// L1 (dividing each 512 KiB piece after its fold, a pass from L2 and beyond, was 9% of the
// worker's CPU in the 2-rank training step with bucket views). The single copy beats the copy
// path from 16 KiB on (2 ranks), and pieces of 512 KiB beat 256 KiB and 1 MiB
// (docs/performance.md, "Single-copy all_reduce").
constexpr size_t kSingleCopyPieceBytes = 512 * 1024;
constexpr size_t kSingleCopyDividePartBytes = 16 * 1024;  // a multiple of every dtype's size

// Note [Reduced slices through the data areas]
// Phase two of the single copy reads n-1 reduced slices from their owners' vectors through
// the kernel. From 3 ranks, when the largest slice fits half a data area, each rank instead
// copies its reduced slice into its data area (the half of the call's first round) piece by
// piece while the piece is in cache, and phase two copies the slices out of the areas: plain
// loads from shared memory, with no syscall and no pinning of the peers' pages, which is what
// the kernel's copy costs beyond the bytes when n-1 ranks read one owner at once. The empty
// closing round keeps that half from being reused before every peer has read it (Note
// [Shared-memory rounds]). 2 ranks read one slice a call, and keep the kernel's single copy.

namespace {
// The peer rank r visits j-th (j = 1 .. n-1): from r+1 on when `spread` (Note [Shared-memory
// all_reduce paths]), else in rank order.
int peer_at(int r, int n, int j, bool spread) {
  if (spread) return (r + j) % n;
  return j - 1 < r ? j - 1 : j;
}
}  // namespace

// Returns with an average already divided.
void shm_all_reduce_single_copy(cpu::Comm& comm, const AllreduceArgs& a, bool scalable) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  auto fold = reduce::lookup(a.dtype, a.op);
  auto fold_into = reduce::lookup_into(a.dtype, a.op);
  const char* what = op_name(comm);
  const uint64_t first = begin_round(comm, g);
  // The peers read x (phase one) and the reduced slices (phase two) at these addresses.
  const uint64_t mine[2] = {reinterpret_cast<uintptr_t>(a.in.data),
                            reinterpret_cast<uintptr_t>(a.out.data)};
  static_assert(sizeof(mine) <= transport::kShmInlineBytes, "the slot's payload holds both");
  std::memcpy(g.slot(r, first).payload, mine, sizeof(mine));
  try {
    meet(comm, g, first, what, scalable);
  } catch (...) {
    g.give_up(first);  // a peer may have seen the address already
    throw;
  }
  auto vector_of = [&](int p, int which) {  // 0: its x, 1: its out
    uint64_t at[2];
    std::memcpy(at, g.slot(p, first).payload, sizeof(at));
    return at[which];
  };
  try {
    const Blocks slices(a.count, n);
    const size_t s = slices.offset(r) * esz, len = slices.length(r) * esz;
    const size_t piece = std::max<size_t>(1, kSingleCopyPieceBytes / esz) * esz;
    uint8_t* scratch = comm.scratch(0, std::min(piece, len));
    // Every rank decides alike: the largest slice is slice 0's.
    const bool via_area = n >= 3 && slices.length(0) * esz <= area_bytes(g);
    uint8_t* my_area = area(g, r, first);
    for (size_t k = 0; k < len; k += piece) {
      const size_t m = std::min(piece, len - k);
      for (int j = 1; j < n; ++j) {
        const int p = peer_at(r, n, j, scalable);
        g.read_peer(p, vector_of(p, 0) + s + k, scratch, m);
        // avg: the last fold goes in L1-sized parts, each divided right after it is folded
        // (Note [Single-copy all_reduce]).
        const bool divides = j == n - 1 && a.op == RedOp::kAvg;
        const size_t part = divides ? kSingleCopyDividePartBytes : m;
        for (size_t q = 0; q < m; q += part) {
          const size_t c = std::min(part, m - q);
          uint8_t* o = a.out.data + s + k + q;
          if (j == 1 && a.in.data != a.out.data)  // own values from x (Note [Out-of-place ...])
            fold_into(o, a.in.data + s + k + q, scratch + q, c / esz);
          else
            fold(o, scratch + q, c / esz);
          if (divides) reduce::divide_by(a.dtype, o, c / esz, n);
        }
      }
      if (via_area) std::memcpy(my_area + k, a.out.data + s + k, m);
    }
    meet_reduced(comm, g, first, what, scalable);
    for (int j = 1; j < n; ++j) {
      const int p = peer_at(r, n, j, scalable);
      const size_t off = slices.offset(p) * esz, bytes_p = slices.length(p) * esz;
      if (via_area)
        std::memcpy(a.out.data + off, area(g, p, first), bytes_p);
      else
        g.read_peer(p, vector_of(p, 1) + off, a.out.data + off, bytes_p);
    }
    // The empty round: every peer has finished reading this vector.
    const uint64_t last = begin_round(comm, g);
    meet(comm, g, last, what, scalable);
  } catch (...) {
    g.give_up(first);
    throw;
  }
  // A peer that left by an error (after announcing the last round, or while this rank read
  // its array) may have reused its array: what was read from it is void.
  for (int p = 0; p < n; ++p)
    if (p != r && g.gave_up(p, first))
      throw PeerError(str_cat("rank ", r, ": rank ", p, " left this all_reduce by an error while "
                              "this rank read its array, so the result is void; see rank ", p,
                              "'s own error"));
}

// All-reduce (Note [Shared-memory all_reduce paths]: which path, and the scalable one).
// Vectors of at most kShmInlineBytes take one round through the slots: every rank folds
// every rank's payload, in rank order. From single_copy_from, where the host allows
// cross-memory attach, see Note [Single-copy all_reduce]. Otherwise a chunk moves per round:
// every rank copies its chunk in. Small chunks: every rank folds the whole chunk from every
// area, in rank order. Large ones: rank r folds slice r of every area (deterministic) and
// publishes it, then every rank copies the other slices out. Per rank that reads and writes
// each byte about three times, against 2(n-1)/n sends plus kernel copies on each side for
// the TCP ring.
bool shm_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  const size_t bytes = a.count * esz;
  const std::string& forced = g.all_reduce_path();
  const ShmPathRow& row = shm_path_row(n);
  const bool scalable = forced == "auto" ? bytes >= row.scalable_from : forced == "scalable";
  const ShmPathRow& lim = scalable ? row : kFlatPath;
  auto fold_many = reduce::lookup_many(a.dtype, a.op);
  const char* what = op_name(comm);
  const bool in_place = a.in.data == a.out.data;
  Sources peers(n - 1);  // one fold of many: every peer's piece (Note [Fold of many])
  if (bytes <= transport::kShmInlineBytes) {
    uint64_t round = begin_round(comm, g);
    std::memcpy(g.slot(r, round).payload, a.in.data, bytes);
    meet(comm, g, round, what, scalable);
    // Rank 0's values first (on rank 0 in place they are still in out), then the others in
    // order.
    const void* first = r == 0 && in_place ? a.out.data : g.slot(0, round).payload;
    for (int p = 1; p < n; ++p) peers[p - 1] = g.slot(p, round).payload;
    fold_many(a.out.data, first, peers.data(), peers.size(), a.count);
    return false;
  }
  const size_t single_copy_from =
      g.single_copy_bytes() ? g.single_copy_bytes() : lim.single_copy_from;
  if (g.cma() && bytes >= single_copy_from) {
    shm_all_reduce_single_copy(comm, a, scalable);
    return a.op == RedOp::kAvg;
  }
  const size_t chunk = std::max<size_t>(1, area_bytes(g) / esz);
  // Folding proceeds in pieces that stay in L1, each copied to the shared area right after
  // it is folded: the copy reads from L1 instead of making a second pass over memory.
  const size_t piece = std::max<size_t>(1, 16 * 1024 / esz);
  size_t off = 0;
  do {
    const size_t c = std::min(chunk, a.count - off);
    uint8_t* out = a.out.data + off * esz;
    const uint8_t* in = a.in.data + off * esz;
    uint64_t round = begin_round(comm, g);
    const bool fold_all = c * esz * n <= lim.fold_all_bytes;
    const Blocks slices(c, n);
    const size_t s = slices.offset(r) * esz, len = slices.length(r);
    uint8_t* mine = area(g, r, round);
    if (fold_all) {
      std::memcpy(mine, in, c * esz);
    } else {  // every slice but my own: that one only I fold, straight from `in`
      std::memcpy(mine, in, s);
      std::memcpy(mine + s + len * esz, in + s + len * esz, (c - slices.offset(r) - len) * esz);
    }
    meet(comm, g, round, what, scalable);
    if (fold_all) {  // rank 0's values first (on rank 0 in place still in out)
      const void* first = r == 0 && in_place ? out : area(g, 0, round);
      for (int p = 1; p < n; ++p) peers[p - 1] = area(g, p, round);
      fold_many(out, first, peers.data(), peers.size(), c);
    } else {
      // Slice r: this rank's own values (read from `in`, which is `out` in place), then
      // every other rank's in a fixed order. Only this rank computes slice r, so all ranks
      // get the same bits.
      for (size_t k = 0; k < len; k += piece) {
        const size_t m = std::min(piece, len - k), at = s + k * esz;
        for (int j = 1; j < n; ++j)
          peers[j - 1] = area(g, peer_at(r, n, j, scalable), round) + at;
        fold_many(out + at, in + at, peers.data(), peers.size(), m);
        std::memcpy(mine + at, out + at, m * esz);
      }
      meet_reduced(comm, g, round, what, scalable);
      for (int j = 1; j < n; ++j) {
        const int p = peer_at(r, n, j, scalable);
        size_t ps = slices.offset(p) * esz;
        std::memcpy(out + ps, area(g, p, round) + ps, slices.length(p) * esz);
      }
    }
    off += c;
  } while (off < a.count);
  return false;
}

// Broadcast: the root copies a chunk in per round; the others copy it out.
void shm_broadcast(cpu::Comm& comm, const BroadcastArgs& a) {
  ShmGroup& g = *comm.shm();
  const int r = g.rank();
  const char* what = op_name(comm);
  size_t off = 0;
  do {
    const size_t c = std::min(area_bytes(g), a.buf.size - off);
    uint64_t round = begin_round(comm, g);
    if (r == a.root) std::memcpy(area(g, r, round), a.buf.data + off, c);
    // Every rank waits for all (not only the root) and compares every OpDesc, so ranks that
    // name different roots all raise MismatchError instead of silently diverging.
    meet(comm, g, round, what);
    if (r != a.root) std::memcpy(a.buf.data + off, area(g, a.root, round), c);
    off += c;
  } while (off < a.buf.size);
}

// Reduce to the root: in round k every other rank copies chunk k of its vector into its
// area; the root folds them into its own values, in rank order (deterministic).
void shm_reduce(cpu::Comm& comm, const ReduceArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  const char* what = op_name(comm);
  auto fold = reduce::lookup(a.dtype, a.op);  // avg folds as sum; reduce() divides
  if (r == a.root && a.out.data != a.in.data && a.count)
    std::memmove(a.out.data, a.in.data, a.count * esz);
  const size_t q = std::max<size_t>(1, area_bytes(g) / esz);  // elements per round
  size_t off = 0;
  do {
    const size_t len = std::min(q, a.count - std::min(a.count, off));
    uint64_t round = begin_round(comm, g);
    if (r != a.root && len) std::memcpy(area(g, r, round), a.in.data + off * esz, len * esz);
    meet(comm, g, round, what);
    if (r == a.root && len)
      for (int p = 0; p < n; ++p)
        if (p != r) fold(a.out.data + off * esz, area(g, p, round), len);
    off += q;
  } while (off < a.count);
}

// All-gather, or gather to `root` (>= 0): in round k every rank copies chunk k of its block
// in, then every rank (or the root alone) copies every other rank's chunk k out. Blocks may
// differ in size (the _v variant); every rank knows every block's size.
void shm_gather_blocks(cpu::Comm& comm, ConstBytes in, MutBytes out,
                       const std::vector<size_t>& bytes, int root) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const bool receives = root < 0 || root == r;
  const char* what = op_name(comm);
  const auto at = prefix_offsets(bytes);
  if (receives) {
    MC_CHECK_EQ(at[n], out.size);
    if (in.data != out.data + at[r] && bytes[r]) std::memmove(out.data + at[r], in.data, bytes[r]);
  }
  const size_t longest = max_of(bytes);
  const size_t S = area_bytes(g);
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    if (off < bytes[r] && (root < 0 || r != root))
      std::memcpy(area(g, r, round), in.data + off, std::min(S, bytes[r] - off));
    meet(comm, g, round, what);
    for (int p = 0; receives && p < n; ++p) {
      if (p == r || off >= bytes[p]) continue;
      std::memcpy(out.data + at[p] + off, area(g, p, round), std::min(S, bytes[p] - off));
    }
    off += S;
  } while (off < longest);
}

void shm_all_gather(cpu::Comm& comm, const AllGatherArgs& a) {
  shm_gather_blocks(comm, a.in, a.out, a.bytes, -1);
}

void shm_gather(cpu::Comm& comm, const GatherArgs& a) {
  shm_gather_blocks(comm, a.in, a.out, a.bytes, a.root);
}

// Scatter: in round k the root copies chunk k of every other rank's block into its area
// (block p at slot p); rank p then copies chunk k of slot p out. One synchronisation per round.
void shm_scatter(cpu::Comm& comm, const GatherArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const char* what = op_name(comm);
  const auto at = prefix_offsets(a.bytes);
  if (r == a.root && a.bytes[r]) std::memmove(a.out.data, a.in.data + at[r], a.bytes[r]);
  const size_t q = std::max<size_t>(1, area_bytes(g) / n);  // bytes per block per round
  const size_t longest = max_of(a.bytes);
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    if (r == a.root) {
      uint8_t* mine = area(g, r, round);
      for (int p = 0; p < n; ++p)
        if (p != r && off < a.bytes[p])
          std::memcpy(mine + p * q, a.in.data + at[p] + off, std::min(q, a.bytes[p] - off));
    }
    meet(comm, g, round, what);
    if (r != a.root && off < a.bytes[r])
      std::memcpy(a.out.data + off, area(g, a.root, round) + r * q, std::min(q, a.bytes[r] - off));
    off += q;
  } while (off < longest);
}

// Reduce-scatter: in round k every rank copies chunk k of every other rank's block into its
// area (block b at slot b); rank r then folds chunk k of its own block: its own values,
// straight from its input, then every other rank's in rank order. One synchronisation per
// round, and only the owner computes a block, so the result is deterministic.
void shm_reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype);
  const char* what = op_name(comm);
  auto fold_many = reduce::lookup_many(a.dtype, a.op);
  Sources peers(n - 1);
  const auto at = prefix_offsets(a.counts);
  const size_t q = std::max<size_t>(1, area_bytes(g) / esz / n);  // elements per block per round
  const size_t longest = max_of(a.counts);
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    uint8_t* mine = area(g, r, round);
    for (int b = 0; b < n; ++b) {
      if (b == r || off >= a.counts[b]) continue;
      std::memcpy(mine + b * q * esz, a.in.data + (at[b] + off) * esz,
                  std::min(q, a.counts[b] - off) * esz);
    }
    meet(comm, g, round, what);
    if (off < a.counts[r]) {
      const size_t len = std::min(q, a.counts[r] - off);
      // This rank's own values first, then the peers' in rank order (Note [Fold of many]).
      for (int p = 0, j = 0; p < n; ++p)
        if (p != r) peers[j++] = area(g, p, round) + r * q * esz;
      fold_many(a.out.data + off * esz, a.in.data + (at[r] + off) * esz, peers.data(),
                peers.size(), len);
    }
    off += q;
  } while (off < longest);
}

// All-to-all: in round k every rank copies chunk k of each block it sends into its area (the
// block for rank p at slot p), then copies chunk k of slot r from every peer's area into its
// output. One synchronisation per round. Every rank must run as many rounds as the largest
// block anywhere needs: with equal blocks (all_to_all) every rank knows that size; with
// uneven ones (all_to_all_v) a rank knows only its own row and column of the size matrix, so
// one round first publishes each rank's largest outgoing block.
void shm_all_to_all(cpu::Comm& comm, const AllToAllArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const char* what = op_name(comm);
  const auto soff = prefix_offsets(a.send_bytes), roff = prefix_offsets(a.recv_bytes);
  size_t longest = max_of(a.send_bytes);
  if (comm.current().op.coll == static_cast<uint8_t>(CollKind::kAllToAllV)) {
    uint64_t round = begin_round(comm, g);
    std::memcpy(area(g, r, round), &longest, sizeof(longest));
    meet(comm, g, round, what);
    for (int p = 0; p < n; ++p) {
      size_t theirs;
      std::memcpy(&theirs, area(g, p, round), sizeof(theirs));
      longest = std::max(longest, theirs);
    }
  }
  const size_t q = std::max<size_t>(1, area_bytes(g) / n);  // bytes per block per round
  auto chunk = [&](size_t bytes, size_t off) { return off < bytes ? std::min(q, bytes - off) : 0; };
  size_t off = 0;
  do {
    uint64_t round = begin_round(comm, g);
    uint8_t* mine = area(g, r, round);
    for (int p = 0; p < n; ++p)
      if (size_t len = chunk(a.send_bytes[p], off); p != r && len)
        std::memcpy(mine + p * q, a.in.data + soff[p] + off, len);
    meet(comm, g, round, what);
    for (int p = 0; p < n; ++p) {
      const size_t len = chunk(a.recv_bytes[p], off);
      if (!len) continue;
      const uint8_t* src = p == r ? a.in.data + soff[r] + off : area(g, p, round) + r * q;
      std::memmove(a.out.data + roff[p] + off, src, len);
    }
    off += q;
  } while (off < longest);
}

void shm_barrier(cpu::Comm& comm) {
  ShmGroup& g = *comm.shm();
  uint64_t round = begin_round(comm, g);
  meet(comm, g, round, "barrier");
}

// Note [Shared-memory trees]
// reduce and broadcast along a tree (Note [Trees] in tree.h), one level per round of the
// chunk: a reduce's round hands the deepest remaining level's partial sums up (each such
// rank copies its chunk into its area; its parent folds its children's areas, in the tree's
// order, into its own partial sum), so a chunk takes `height` rounds and each rank folds at
// most its own children; a broadcast's round hands one level's chunk down (the level copies
// it into its area; its children copy it out). Every round is a full meeting of the group
// (Note [Shared-memory rounds]: every rank compares every rank's OpDesc, the tree's arity
// included), so a round costs one synchronisation whatever the level. The flat forms
// (shm_reduce, shm_broadcast) take one round per chunk, but the root folds or serves every
// rank alone: the trees spread that work over the levels, which pays where one rank's
// memory bandwidth is the bound (many ranks, long vectors).
void shm_tree_reduce(cpu::Comm& comm, const ReduceArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const size_t esz = dtype_size(a.dtype), nbytes = a.count * esz;
  const char* what = op_name(comm);
  auto fold = reduce::lookup(a.dtype, a.op);  // avg folds as sum; reduce() divides
  const TreeNode t = tree_node(mod(r - a.root, n), n, a.arity);
  const int height = tree_height(n, a.arity);
  // The partial sum: out on the root, scratch on the other inner ranks; a leaf's is its input.
  const uint8_t* partial = a.in.data;
  uint8_t* acc = nullptr;
  if (!t.children.empty()) {
    acc = r == a.root ? a.out.data : comm.scratch(2, nbytes);
    if (acc != a.in.data && nbytes) std::memmove(acc, a.in.data, nbytes);
    partial = acc;
  }
  const size_t q = std::max<size_t>(1, area_bytes(g) / esz);  // elements per round
  size_t off = 0;
  do {
    const size_t len = std::min(q, a.count - std::min(a.count, off));
    for (int level = height; level >= 1; --level) {
      uint64_t round = begin_round(comm, g);
      if (t.depth == level && len)
        std::memcpy(area(g, r, round), partial + off * esz, len * esz);
      meet(comm, g, round, what);
      if (t.depth == level - 1 && len)
        for (int c : t.children)
          fold(acc + off * esz, area(g, mod(c + a.root, n), round), len);
    }
    off += q;
  } while (off < a.count);
}

void shm_tree_broadcast(cpu::Comm& comm, const BroadcastArgs& a) {
  ShmGroup& g = *comm.shm();
  const int n = g.size(), r = g.rank();
  const char* what = op_name(comm);
  const TreeNode t = tree_node(mod(r - a.root, n), n, a.arity);
  const int height = tree_height(n, a.arity);
  size_t off = 0;
  do {
    const size_t c = std::min(area_bytes(g), a.buf.size - off);
    for (int level = 0; level < height; ++level) {
      uint64_t round = begin_round(comm, g);
      if (t.depth == level && !t.children.empty() && c)
        std::memcpy(area(g, r, round), a.buf.data + off, c);
      meet(comm, g, round, what);
      if (t.depth == level + 1 && c)
        std::memcpy(a.buf.data + off, area(g, mod(t.parent + a.root, n), round), c);
    }
    off += c;
  } while (off < a.buf.size);
}

}  // namespace meshcoll::algo
