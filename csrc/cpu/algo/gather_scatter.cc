// gather and scatter over TCP: direct to / from the root, over per-rank block sizes, so the
// uneven variants are the same code. dispatch.cc decides when they run (Note [Dispatch]).
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"

namespace meshcoll::algo {

void direct_gather(cpu::Comm& comm, const GatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  if (r != a.root) {
    comm.wait(comm.send(a.root, 0, a.in));
    return;
  }
  const auto off = prefix_offsets(a.bytes);
  std::vector<transport::Request> reqs;
  for (int p = 0; p < n; ++p)
    if (p != r) reqs.push_back(comm.recv(p, 0, MutBytes(a.out.data + off[p], a.bytes[p])));
  if (a.bytes[r]) std::memmove(a.out.data + off[r], a.in.data, a.bytes[r]);
  comm.wait(reqs);
}

void direct_scatter(cpu::Comm& comm, const GatherArgs& a) {
  const int n = comm.size(), r = comm.rank();
  if (r != a.root) {
    comm.wait(comm.recv(a.root, 0, a.out));
    return;
  }
  const auto off = prefix_offsets(a.bytes);
  std::vector<transport::Request> reqs;
  for (int p = 0; p < n; ++p)
    if (p != r) reqs.push_back(comm.send(p, 0, ConstBytes(a.in.data + off[p], a.bytes[p])));
  if (a.bytes[r]) std::memmove(a.out.data, a.in.data + off[r], a.bytes[r]);
  comm.wait(reqs);
}

}  // namespace meshcoll::algo
