// The collectives: free functions over a Comm, each taking an args struct. The entry points
// (all_reduce, broadcast, ...) validate and pick the family or algorithm (Note [Dispatch] in
// dispatch.cc); the algorithm functions do the moving and may be called directly.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "cpu/engine.h"
#include "common/bytes.h"
#include "common/dtype.h"
#include "common/op_desc.h"

namespace meshcoll::algo {

inline constexpr size_t kMaxSegmentBytes = 512 * 1024;

// Thresholds for Algorithm::kAuto over TCP (on one host, shared memory wins at every size).
// Measured with bench/python/bench_algorithms.py on loopback, 2-8 ranks, float32 sum (tables
// in docs/performance.md): direct/tree win up to 256-512 KiB at every world size, halving-doubling beats
// ring by 7-40% from 1 to 8 MiB at 8 ranks, ring wins above.
struct SelectConfig {
  size_t direct_threshold_bytes = 64 * 1024;  // at or below (<= 8 ranks): direct, one round trip
  size_t tree_threshold_bytes = 256 * 1024;   // at or below: tree (fewest steps)
  size_t hd_threshold_bytes = 8 << 20;        // at or below, power-of-two worlds: halving-doubling
};
Algorithm select_all_reduce(size_t nbytes, int world_size, const SelectConfig& cfg);

struct AllreduceArgs {
  ConstBytes in;  // may alias out
  MutBytes out;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  SelectConfig select;
  size_t max_segment_bytes = kMaxSegmentBytes;  // tests shrink it to force many segments
};
void all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void ring_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void tree_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void halving_doubling_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void direct_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);
void shm_all_reduce(cpu::Comm& comm, const AllreduceArgs& a);  // same host only

struct BroadcastArgs {
  MutBytes buf;  // root: source; others: destination
  int root = 0;
  size_t max_segment_bytes = kMaxSegmentBytes;
};
void broadcast(cpu::Comm& comm, const BroadcastArgs& a);
void tcp_broadcast(cpu::Comm& comm, const BroadcastArgs& a);  // chain, or binomial when small
void shm_broadcast(cpu::Comm& comm, const BroadcastArgs& a);

// Reduce to root: out is written on root only (may alias in).
struct ReduceArgs {
  ConstBytes in;
  MutBytes out;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
};
void reduce(cpu::Comm& comm, const ReduceArgs& a);
void tree_reduce(cpu::Comm& comm, const ReduceArgs& a);  // the op only: reduce divides for avg
void shm_reduce(cpu::Comm& comm, const ReduceArgs& a);   // same host only; likewise

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
