// Hierarchical all_reduce, broadcast and all_gather for a CPU group whose ranks sit on several
// hosts: shared memory inside each host (the `local` child), TCP between one leader per host
// (the `leaders` child). Note [Hierarchy] in python/meshcoll/hierarchy.py gives the steps and
// why they run here: each hierarchical call is ONE operation on the parent group's Comm, in
// the parent's issue order, and its body runs the steps as synchronous calls on the children
// (idle outside these calls, so each step runs inline on the parent's thread).
#pragma once

#include <memory>
#include <vector>

#include "comm/array_view.h"
#include "comm/backend.h"
#include "cpu/engine.h"

namespace meshcoll::cpu {

struct Hierarchy {
  std::shared_ptr<comm::Backend> local;    // this rank's host, shared memory
  std::shared_ptr<comm::Backend> leaders;  // lowest group rank of each host; null elsewhere
  std::vector<int> host;                   // host of each group rank, numbered by first rank
  // Derived once from `host`:
  std::vector<int> by_host;          // group ranks in host-block order (leaders' layout)
  bool in_place = true;              // by_host is the identity: hosts' ranks are contiguous
  std::vector<size_t> host_size;     // members of each host
  std::vector<size_t> block_offset;  // ranks before host h's block in leaders' layout
  std::vector<int> local_rank;       // each group rank's rank in its host's `local` group

  // Checks the children against `host` from group rank `rank`'s side (throws
  // InvalidArgument naming what disagrees) and derives the rest.
  static std::shared_ptr<const Hierarchy> make(std::shared_ptr<comm::Backend> local,
                                               std::shared_ptr<comm::Backend> leaders,
                                               std::vector<int> host, int rank);
};

// The bodies of the parent's operation, run with `parent` inside it (its deadline bounds
// every step). `tuning`: the parent call's; its local and global algorithms are the steps'.
void hier_all_reduce(cpu::Comm& parent, const Hierarchy& h, const comm::ArrayView& in,
                     const comm::ArrayView& out, RedOp op, const comm::AllReduceTuning& tuning);
void hier_broadcast(cpu::Comm& parent, const Hierarchy& h, const comm::ArrayView& buf, int root,
                    const comm::AllReduceTuning& tuning);
// Equal counts only: every rank's `in` has in.count elements.
void hier_all_gather(Comm& parent, const Hierarchy& h, const comm::ArrayView& in,
                     const comm::ArrayView& out);

}  // namespace meshcoll::cpu
