// all_to_all (and all_to_all_v) over TCP: pairwise exchange over per-rank block sizes, so the
// uneven variant is the same code. dispatch.cc decides when it runs (Note [Dispatch]).
#include <cstring>

#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"

namespace meshcoll::algo {

// Pairwise exchange: every receive and send is posted at once, sends in the order
// rank+1, rank+2, ... so that no single rank is everyone's first target.
void pairwise_all_to_all(cpu::Comm& comm, const AllToAllArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const auto soff = prefix_offsets(a.send_bytes);
  const auto roff = prefix_offsets(a.recv_bytes);
  std::vector<transport::Request> reqs;
  for (int s = 1; s < n; ++s) {
    int from = mod(r - s, n);
    reqs.push_back(comm.recv(from, 0, MutBytes(a.out.data + roff[from], a.recv_bytes[from])));
  }
  for (int s = 1; s < n; ++s) {
    int to = mod(r + s, n);
    reqs.push_back(comm.send(to, 0, ConstBytes(a.in.data + soff[to], a.send_bytes[to])));
  }
  if (a.send_bytes[r]) std::memmove(a.out.data + roff[r], a.in.data + soff[r], a.send_bytes[r]);
  comm.wait(reqs);
}

}  // namespace meshcoll::algo
