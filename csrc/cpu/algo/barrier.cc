// barrier over TCP: dissemination. dispatch.cc decides when it runs (Note [Dispatch]).
#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"

namespace meshcoll::algo {

// Dissemination barrier: in round k every rank signals rank+2^k and waits for rank-2^k;
// after ceil(log2 n) rounds every rank has heard, transitively, from every other.
void dissemination_barrier(cpu::Comm& comm) {
  const int n = comm.size(), r = comm.rank();
  uint32_t round = 0;
  for (int k = 1; k < n; k <<= 1, ++round) {
    comm.wait({comm.send(mod(r + k, n), round, ConstBytes()),
               comm.recv(mod(r - k, n), round, MutBytes())});
  }
}

}  // namespace meshcoll::algo
