// Recursive halving-doubling all-reduce (Rabenseifner): a reduce-scatter by recursive
// halving, then an all-gather by recursive doubling. 2 log2(p) steps moving 2(p-1)/p of the
// vector: bandwidth-optimal like the ring with log instead of linear latency, for p a power
// of two. Other sizes fold first: of the first 2*rem ranks (rem = n - p), each even rank
// hands its vector to the odd rank above it and sits out; the odd rank gets it back at the
// end.
#include "cpu/algo/collectives.h"
#include "cpu/algo/plan.h"
#include "reduce/kernels.h"

namespace meshcoll::algo {

void halving_doubling_all_reduce(cpu::Comm& comm, const AllreduceArgs& a) {
  const int n = comm.size(), r = comm.rank();
  const int p = pow2_floor(n), rem = n - p;
  const size_t esz = dtype_size(a.dtype);
  const size_t nbytes = a.count * esz;
  auto fold = reduce::lookup(a.dtype, a.op);
  uint8_t* tmp = comm.scratch(0, nbytes);
  uint32_t tag = 0;

  int me = r - rem;  // rank among the p participants, -1 when folded out
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      comm.wait(comm.send(r + 1, tag, ConstBytes(a.out.data, nbytes)));
      me = -1;
    } else {
      comm.wait(comm.recv(r - 1, tag, MutBytes(tmp, nbytes)));
      fold(a.out.data, tmp, a.count);
      me = r / 2;
    }
  }
  ++tag;
  auto real = [&](int v) { return v < rem ? 2 * v + 1 : v + rem; };
  const Blocks blocks(a.count, p);
  auto bytes_of = [&](size_t lo, size_t hi) {  // block range [lo, hi) as (offset, bytes)
    size_t off = blocks.offset(lo) * esz;
    size_t end = hi < static_cast<size_t>(p) ? blocks.offset(hi) * esz : nbytes;
    return std::pair<size_t, size_t>(off, end - off);
  };
  const int log_p = [&] { int k = 0; while ((1 << k) < p) ++k; return k; }();

  if (me >= 0) {
    // Halving: at distance `mask` partners share a block range; the one whose bit is clear
    // keeps the lower half. Afterwards this rank holds one fully reduced block, [lo, hi).
    size_t lo = 0, hi = p;
    for (int mask = p / 2; mask >= 1; mask >>= 1, ++tag) {
      int partner = real(me ^ mask);
      size_t mid = lo + (hi - lo) / 2;
      bool low = (me & mask) == 0;
      size_t klo = low ? lo : mid, khi = low ? mid : hi;
      size_t slo = low ? mid : lo, shi = low ? hi : mid;
      auto [soff, sbytes] = bytes_of(slo, shi);
      auto [koff, kbytes] = bytes_of(klo, khi);
      comm.wait({comm.send(partner, tag, ConstBytes(a.out.data + soff, sbytes)),
                 comm.recv(partner, tag, MutBytes(tmp, kbytes))});
      fold(a.out.data + koff, tmp, kbytes / esz);
      lo = klo;
      hi = khi;
    }
    // Doubling: exchange the owned range with the partner whose range adjoins it.
    for (int mask = 1; mask < p; mask <<= 1, ++tag) {
      int partner = real(me ^ mask);
      size_t width = hi - lo;
      bool low = (me & mask) == 0;
      size_t plo = low ? hi : lo - width, phi = low ? hi + width : lo;
      auto [moff, mbytes] = bytes_of(lo, hi);
      auto [poff, pbytes] = bytes_of(plo, phi);
      comm.wait({comm.send(partner, tag, ConstBytes(a.out.data + moff, mbytes)),
                 comm.recv(partner, tag, MutBytes(a.out.data + poff, pbytes))});
      lo = std::min(lo, plo);
      hi = std::max(hi, phi);
    }
  } else {
    tag += 2 * log_p;
  }
  if (r < 2 * rem) {
    if (r % 2 == 0)
      comm.wait(comm.recv(r + 1, tag, a.out));
    else
      comm.wait(comm.send(r - 1, tag, ConstBytes(a.out.data, nbytes)));
  }
}

}  // namespace meshcoll::algo
