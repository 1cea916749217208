// The collectives: free functions over a Comm, each taking an args struct. The entry points
// (all_reduce, broadcast, ...) validate and pick the family or algorithm (Note [Dispatch] in
// dispatch.cc); the algorithm functions do the moving and may be called directly.
#pragma once

#include <cstddef>
#include <vector>

#include "cpu/engine.h"
#include "common/bytes.h"
#include "common/dtype.h"
#include "common/op_desc.h"

namespace meshcoll::algo {

inline constexpr size_t kMaxSegmentBytes = kDefaultMaxSegmentBytes;

// The thresholds Algorithm::kAuto reads (Note [Selection table] in select.cc says where each
// came from); CollectiveConfig sets the first three per group.
struct SelectConfig {
  size_t direct_threshold_bytes = 64 * 1024;  // all_reduce, at or below (<= 8 ranks): direct
  size_t tree_threshold_bytes = kDefaultTreeThresholdBytes;  // all_reduce, at or below: tree
  size_t hd_threshold_bytes = kDefaultHdThresholdBytes;      // all_reduce, at or below, 2^k: h-d
  size_t broadcast_tree_bytes = 64 * 1024;    // broadcast over TCP, at or below: binomial tree
};

// The collectives whose algorithm is chosen (Note [Selection table]).
enum class Selects : uint8_t { kAllReduce, kReduce, kBroadcast, kAllGather, kReduceScatter };
const char* selects_name(Selects c);
struct Choice {
  Algorithm algorithm = Algorithm::kAuto;
  int arity = 0;  // a tree's (Note [Trees] in tree.h); 0: binomial
};
// What kAuto runs for a call of `nbytes` on `world_size` ranks, over shared memory (`shm`: a
// group of one host) or TCP: the first row of the selection table that fits.
Choice select_algorithm(Selects c, bool shm, size_t nbytes, int world_size,
                        const SelectConfig& cfg);
Algorithm select_all_reduce(size_t nbytes, int world_size, const SelectConfig& cfg);  // over TCP
// One row of the table, for meshcoll-bench and the tests: the collective, the family
// ("tcp", "shm"), the largest world it applies to (0: any), the threshold (a SelectConfig
// field's name, "" for any size), whether only on power-of-two worlds, the choice, and
// where the row came from.
struct SelectRow {
  Selects coll;
  bool shm;
  int max_ranks;
  const char* threshold;
  bool pow2_only;
  Choice choice;
  const char* source;
};
std::vector<SelectRow> selection_table();
// Whether `a` is a name the collective takes (all_reduce: every Algorithm; reduce: auto,
// tree, direct; broadcast: those and ring; the others: auto).
bool algorithm_allowed(Selects c, Algorithm a);

struct AllreduceArgs {
  ConstBytes in;  // may alias out
  MutBytes out;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  int arity = 0;  // the tree's (Note [Trees] in tree.h): 0 binomial, k >= 2 k-ary
  SelectConfig select;
  size_t max_segment_bytes = kMaxSegmentBytes;  // tests shrink it to force many segments
};
void all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void ring_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void tree_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void halving_doubling_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void direct_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
// Same host only. Returns whether it divided an average itself (the single-copy path).
bool shm_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);

// broadcast and reduce: the group's transport picks the family (shared memory or TCP,
// Note [Dispatch]), `algorithm` the shape within it: a tree of `arity` (Note [Trees]), direct
// (the flat tree: the root and every other rank), ring (broadcast over TCP: a pipelined
// chain) or auto (Note [Selection table]).
struct BroadcastArgs {
  MutBytes buf;  // root: source; others: destination
  int root = 0;
  size_t max_segment_bytes = kMaxSegmentBytes;
  Algorithm algorithm = Algorithm::kAuto;
  int arity = 0;
  SelectConfig select;
};
void broadcast(cpu::Comm& comm, const BroadcastArgs& a);
void chain_broadcast(cpu::Comm& comm, const BroadcastArgs& a);  // TCP, pipelined
void shm_broadcast(cpu::Comm& comm, const BroadcastArgs& a);    // flat: all read the root's
void shm_tree_broadcast(cpu::Comm& comm, const BroadcastArgs& a);  // level by level, a.arity
// Along the tree of `arity` rooted at `root`, over TCP, segment by segment (segments of at
// most max_segment_bytes pipeline down or up the levels). The reduce leaves the result in
// buf on the root (buf is clobbered elsewhere) and folds the op only (callers divide for avg).
void tree_broadcast(cpu::Comm& comm, MutBytes buf, int root, int arity, uint32_t tag,
                    size_t max_segment_bytes);
void tree_reduce(cpu::Comm& comm, MutBytes buf, size_t count, DType dtype, RedOp op, int root,
                 int arity, uint32_t tag, size_t max_segment_bytes);

// Reduce to root: out is written on root only (may alias in).
struct ReduceArgs {
  ConstBytes in;
  MutBytes out;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
  Algorithm algorithm = Algorithm::kAuto;
  int arity = 0;
  size_t max_segment_bytes = kMaxSegmentBytes;
};
void reduce(cpu::Comm& comm, const ReduceArgs& a);
// The op only (reduce divides for avg): over TCP along a tree (a.arity; direct: the flat one),
// or in shared memory flat (the root folds every rank's values) or level by level.
void tcp_reduce(cpu::Comm& comm, const ReduceArgs& a, int arity);
void shm_reduce(cpu::Comm& comm, const ReduceArgs& a);
void shm_tree_reduce(cpu::Comm& comm, const ReduceArgs& a);

// Gather-type collectives with per-rank byte counts (equal counts are the common case).
struct AllGatherArgs {
  ConstBytes in;                 // this rank's block (may alias its slot in out)
  MutBytes out;                  // concatenation of every rank's block, in rank order
  std::vector<size_t> bytes;     // bytes of each rank's block
  size_t max_segment_bytes = kMaxSegmentBytes;
};
void all_gather(cpu::Comm& comm, const AllGatherArgs& a);
void ring_all_gather(cpu::Comm& comm, const AllGatherArgs& a);  // own block already in place
void shm_all_gather(cpu::Comm& comm, const AllGatherArgs& a);

struct ReduceScatterArgs {
  ConstBytes in;              // the whole vector: every rank's block, in rank order
  MutBytes out;               // this rank's reduced block
  std::vector<size_t> counts; // elements of each rank's block
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  size_t max_segment_bytes = kMaxSegmentBytes;
};
void reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a);
// n > 1, the op only: reduce_scatter divides for avg.
void ring_reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a);
void shm_reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a);

struct AllToAllArgs {
  ConstBytes in;  // blocks for rank 0, 1, ... in order
  MutBytes out;   // blocks from rank 0, 1, ... in order
  std::vector<size_t> send_bytes, recv_bytes;
};
void all_to_all(cpu::Comm& comm, const AllToAllArgs& a);
void pairwise_all_to_all(cpu::Comm& comm, const AllToAllArgs& a);
void shm_all_to_all(cpu::Comm& comm, const AllToAllArgs& a);

struct GatherArgs {  // gather (in -> root's out) and scatter (root's in -> out)
  ConstBytes in;
  MutBytes out;
  std::vector<size_t> bytes;  // per-rank block bytes
  int root = 0;
};
void gather(cpu::Comm& comm, const GatherArgs& a);
void scatter(cpu::Comm& comm, const GatherArgs& a);
void direct_gather(cpu::Comm& comm, const GatherArgs& a);
void direct_scatter(cpu::Comm& comm, const GatherArgs& a);
void shm_gather(cpu::Comm& comm, const GatherArgs& a);   // same host only
void shm_scatter(cpu::Comm& comm, const GatherArgs& a);

void barrier(cpu::Comm& comm);
void dissemination_barrier(cpu::Comm& comm);
void shm_barrier(cpu::Comm& comm);

}  // namespace meshcoll::algo
