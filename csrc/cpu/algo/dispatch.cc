// The entry points of the CPU collectives (all but all_reduce): which family of algorithms
// carries a call is decided here, and only here.
//
// Note [Dispatch]
// A Comm has shared memory when every rank of its group sits on one host and the segments
// mapped: decided once, when the Comm was built (ShmGroup::create, under the group's
// transport option: auto, shm or tcp). Such a group runs the shm_* family
// (shm_collectives.cc); any other group the TCP family (one algorithm per file: ring
// all_gather and reduce_scatter, pairwise all_to_all, direct gather and scatter, chain
// broadcast, tree broadcast and reduce of any arity, dissemination barrier). Groups spanning
// hosts are routed one level up, by CpuBackend, to the hierarchy (cpu/hierarchy.cc).
// all_reduce has a selector of its own (all_reduce.cc), because it also chooses among the
// TCP algorithms by size, and shared memory is one of its choices (kShm). broadcast and
// reduce take an algorithm too, which picks the shape within the family: a tree of any
// arity, direct (the flat tree), the chain ("ring", broadcast over TCP) or auto (Note
// [Selection table] in select.cc). Steps both families share (size checks, this rank's own
// block, a group of one, the division of avg) run here, so each family's code does only
// what differs. The family a call took is written in its ledger record (Comm::route).
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "common/check.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

namespace {
bool on_shm(cpu::Comm& comm) { return comm.size() > 1 && comm.shm() != nullptr; }
}  // namespace

void all_gather(cpu::Comm& comm, const AllGatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const auto off = prefix_offsets(a.bytes);
  MC_CHECK_EQ(off[n], a.out.size);
  if (a.in.data != a.out.data + off[r] && a.bytes[r])
    std::memcpy(a.out.data + off[r], a.in.data, a.bytes[r]);
  if (n == 1) return;
  on_shm(comm) ? shm_all_gather(comm, a) : ring_all_gather(comm, a);
}

void reduce_scatter(cpu::Comm& comm, const ReduceScatterArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const size_t esz = dtype_size(a.dtype);
  size_t total = 0;
  for (size_t c : a.counts) total += c * esz;
  MC_CHECK_EQ(total, a.in.size);
  MC_CHECK_EQ(a.counts[r] * esz, a.out.size);
  if (n == 1) {
    if (a.out.data != a.in.data && a.out.size) std::memcpy(a.out.data, a.in.data, a.out.size);
  } else {
    on_shm(comm) ? shm_reduce_scatter(comm, a) : ring_reduce_scatter(comm, a);
  }
  if (a.op == RedOp::kAvg) reduce::divide_by(a.dtype, a.out.data, a.counts[r], n);
}

void all_to_all(cpu::Comm& comm, const AllToAllArgs& a) {
  const int n = comm.size(), r = comm.rank();
  MC_CHECK_EQ(prefix_offsets(a.send_bytes)[n], a.in.size);
  MC_CHECK_EQ(prefix_offsets(a.recv_bytes)[n], a.out.size);
  MC_CHECK_EQ(a.send_bytes[r], a.recv_bytes[r]);
  on_shm(comm) ? shm_all_to_all(comm, a) : pairwise_all_to_all(comm, a);
}

void gather(cpu::Comm& comm, const GatherArgs& a) {
  on_shm(comm) ? shm_gather(comm, a) : direct_gather(comm, a);
}

void scatter(cpu::Comm& comm, const GatherArgs& a) {
  on_shm(comm) ? shm_scatter(comm, a) : direct_scatter(comm, a);
}

namespace {
// The algorithm broadcast or reduce runs (kAuto: the selection table's), recorded for the
// agreement check before any data moves: ranks that build different trees get MismatchError.
// Direct is the flat tree over TCP (Note [Trees]); "ring" is refused on shared memory by the
// backend before the call is described (CpuBackend::check_options).
Choice resolve_rooted(cpu::Comm& comm, Selects c, Algorithm algorithm, int arity,
                      size_t nbytes, const SelectConfig& cfg) {
  Choice ch{algorithm, arity};
  if (algorithm == Algorithm::kAuto)
    ch = select_algorithm(c, on_shm(comm), nbytes, comm.size(), cfg);
  if (ch.algorithm != Algorithm::kTree) ch.arity = 0;
  comm.set_algorithm(algorithm_name(ch.algorithm), static_cast<uint8_t>(ch.algorithm),
                     static_cast<uint32_t>(ch.arity));
  if (ch.algorithm == Algorithm::kDirect && !on_shm(comm))
    ch = {Algorithm::kTree, comm.size() - 1};  // one level: the root and every other rank
  return ch;
}
}  // namespace

void broadcast(cpu::Comm& comm, const BroadcastArgs& a) {
  if (comm.size() == 1) return;
  BroadcastArgs b = a;
  const Choice ch =
      resolve_rooted(comm, Selects::kBroadcast, a.algorithm, a.arity, a.buf.size, a.select);
  b.arity = ch.arity;
  if (on_shm(comm)) {
    ch.algorithm == Algorithm::kTree ? shm_tree_broadcast(comm, b) : shm_broadcast(comm, b);
  } else if (ch.algorithm == Algorithm::kRing) {
    chain_broadcast(comm, b);
  } else {
    tree_broadcast(comm, b.buf, b.root, b.arity, 0, b.max_segment_bytes);
  }
}

void reduce(cpu::Comm& comm, const ReduceArgs& a) {
  if (comm.size() > 1) {
    ReduceArgs b = a;
    const Choice ch = resolve_rooted(comm, Selects::kReduce, a.algorithm, a.arity,
                                     a.count * dtype_size(a.dtype), SelectConfig{});
    b.arity = ch.arity;
    if (!on_shm(comm)) tcp_reduce(comm, b, b.arity);
    else ch.algorithm == Algorithm::kTree ? shm_tree_reduce(comm, b) : shm_reduce(comm, b);
  } else if (a.out.data != a.in.data && a.count) {  // the root alone: its own values
    std::memcpy(a.out.data, a.in.data, a.count * dtype_size(a.dtype));
  }
  if (a.op == RedOp::kAvg && comm.rank() == a.root)
    reduce::divide_by(a.dtype, a.out.data, a.count, comm.size());
}

void barrier(cpu::Comm& comm) {
  if (comm.size() == 1) return;
  on_shm(comm) ? shm_barrier(comm) : dissemination_barrier(comm);
}

}  // namespace meshcoll::algo
