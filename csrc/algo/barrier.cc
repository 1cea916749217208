// barrier: dissemination over TCP; on one host it hands over to shm_barrier
// (shm_collectives.cc).
#include "algo/collectives.h"
#include "algo/plan.h"

namespace meshcoll::algo {

// Dissemination barrier: in round k every rank signals rank+2^k and waits for rank-2^k;
// after ceil(log2 n) rounds every rank has heard, transitively, from every other.
void barrier(comm::Comm& comm) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  if (comm.shm()) {
    shm_barrier(comm);
    return;
  }
  uint32_t round = 0;
  for (int k = 1; k < n; k <<= 1, ++round) {
    comm.wait({comm.send(mod(r + k, n), round, ConstBytes()),
               comm.recv(mod(r - k, n), round, MutBytes())});
  }
}

}  // namespace meshcoll::algo
