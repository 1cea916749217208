// Shared memory between the ranks of one host: every rank creates one segment (a control
// block it alone writes, then a data area) and maps every peer's. Same-host collectives
// (cpu/algo/shm_collectives.cc) read peers' data areas directly: no kernel copies.
//
// Note [Shared-memory lifetime]
// Segments are POSIX shm objects named /meshcoll-<nonce>-<rank>, where rank 0 makes the nonce
// (its pid, then a clock reading) and sends it to every rank in setup's first step: every
// rank knows every rank's name. Setup is a series of store barriers (host, created, mapped,
// cma), and however it ends for a rank that is still alive (success, a failed step, an
// error, a peer's death), that rank unlinks *every* rank's name on its way out (an absent
// name is no error). On success that is after the "mapped" barrier, when every rank has
// mapped every segment; the mappings then die with the processes, so a normal exit, a crash
// or kill -9 after setup leaves nothing in /dev/shm. A rank killed inside setup, between
// creating its segment and the end, never unlinks its own name: the survivors do, since they
// fail (or finish) setup too, and each one unlinks all names. Only a host where every rank
// of a setup dies inside it keeps names behind; the next setup on the host sweeps those whose
// rank 0 pid is gone. While waiting at a barrier, setup watches the TCP links, so a peer's
// death is a PeerError naming it at once, not a timeout. Space is reserved with
// posix_fallocate, so a too-small /dev/shm is a clear error at setup (naming the bytes
// needed) instead of SIGBUS on first touch, and a peer's segment must have this rank's size
// before it is mapped.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/rank_names.h"
#include "store/exchange.h"
#include "store/store.h"
#include "transport/transport.h"

namespace meshcoll::transport {

// Bytes of a small all_reduce vector that travel inside the round's slot, next to its flag.
constexpr size_t kShmInlineBytes = 1024 - 2 * sizeof(uint64_t) - sizeof(OpDesc);
// Steps of the dissemination barrier (Note [Dissemination signalling]): ceil(log2 n) of them,
// so up to 2^16 ranks on a host.
constexpr int kShmMaxSteps = 16;

// One round's announcement (Note [Shared-memory rounds]): the owner fills seq, desc and, for
// small vectors, payload, then stores `arrived`. A waiter spins on the line holding `arrived`
// and finds the OpDesc and the first payload bytes on the same line: an 8-byte all_reduce
// moves one cache line per peer.
struct alignas(64) ShmSlot {
  std::atomic<uint64_t> arrived;  // last round of this slot's parity whose data is in place
  uint64_t seq;                   // the round's collective, for the agreement check
  OpDesc desc;
  uint8_t payload[kShmInlineBytes];
};
static_assert(sizeof(ShmSlot) == 1024, "slot layout");

// One rank's control block, written by its owner only and read by all.
struct alignas(64) ShmControl {
  ShmSlot slot[2];  // indexed by round parity, like the halves of the data area
  std::atomic<uint64_t> reduced;  // last round whose reduced slice this rank has published
  char pad0[56];
  // Note [Futex wake-ups]: bumped on every publish; a waiter that has spun long enough sleeps
  // on it (a process-shared futex) after announcing itself in `sleepers`, so an idle or
  // oversubscribed host does not burn cores, and a publisher only pays for a wake-up
  // syscall when someone sleeps.
  std::atomic<uint32_t> epoch;
  std::atomic<uint32_t> sleepers;
  // Set at creation, for the cross-memory-attach probe (Note [Cross-memory attach]): the
  // owner's pid and the address of this block in the owner's address space.
  int64_t pid;
  uint64_t self_addr;
  // The first round of the last single-copy all_reduce this rank left by an error (Note
  // [Single-copy all_reduce]): its array may be reused, so what a peer read there is void.
  std::atomic<uint64_t> gave_up;
  // Note [Dissemination signalling]: flag k is raised in step k of arrive() and watched by
  // one peer only, rank + 2^k (mod n); each on its own cache line.
  struct alignas(64) StepFlag {
    std::atomic<uint64_t> value;  // 2 * round + phase of the last barrier that reached step k
  };
  StepFlag step[kShmMaxSteps];
};
static_assert(sizeof(ShmControl) % 64 == 0, "control block layout");

class ShmGroup {
 public:
  // Called every few ms while waiting, with the ranks not there yet: polls the TCP links for
  // a dead peer or an ABORT frame, and throws.
  using Check = store::WaitCheck;

  // Collective over the group: creates, exchanges and maps segments through `store`. Every
  // rank gets the same outcome: a group, or nullptr with the reason in *why (a rank's
  // /dev/shm too small, ranks on different hosts or IPC namespaces). A peer that dies or
  // never comes is an error: what `check` throws, or TimeoutError at `d`.
  static std::unique_ptr<ShmGroup> create(int rank, int size, store::Store& store,
                                          size_t data_bytes, const Deadline& d,
                                          const Check& check, std::string* why,
                                          const RankNames& names = {});
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // How messages name the ranks (common/rank_names.h).
  void set_rank_names(RankNames names) { global_ = std::move(names); }
  int global_rank(int r) const { return global_(r); }
  size_t data_bytes() const { return data_bytes_; }
  uint8_t* data(int r) { return data_[r]; }

  // kArrived is per round parity: slot(round).arrived (Note [Shared-memory rounds]).
  enum Phase { kArrived, kReduced };
  ShmSlot& slot(int r, uint64_t round) { return ctrl_[r]->slot[round & 1]; }
  // Publishes this rank's `phase` counter for `round` and wakes sleeping waiters.
  void publish(Phase phase, uint64_t round);
  // Waits until every rank's `phase` counter is >= round. On the deadline: TimeoutError
  // naming the ranks that had not reached the phase.
  void wait_all(Phase phase, uint64_t round, const Deadline& d, const Check& check,
                const char* what);

  // Note [Dissemination signalling]
  // wait_all has every rank poll every peer's flag: each flag's cache line is pulled by n-1
  // cores per round, n(n-1) transfers that queue at each owner, which is what slows the flat
  // rounds from 8 ranks up. arrive() is a dissemination barrier instead: in step k (of
  // ceil(log2 n)) a rank raises its own step-k flag and waits for the step-k flag of rank
  // r - 2^k (mod n). Every flag sits on its own cache line and is watched by one peer only.
  // After the last step a rank knows that every rank has arrived, and (release/acquire along
  // the chain of flags) sees everything each wrote before arriving, as after wait_all. Flags
  // hold 2 * round + phase: they only grow, so a barrier never resets anything. A rank in a
  // flat round (publish(kArrived)) raises all its step flags at once, and a rank in arrive()
  // announces the round in its slot too: ranks that disagree on the path (they called
  // different collectives or sizes) all get past their first wait and reach the agreement
  // check, a MismatchError instead of a hang. While waiting, the ranks reported as missing
  // (to the liveness check, and in a TimeoutError) are those that have not entered the
  // barrier at all, so a dead rank is named by every rank, not only by the one watching it.
  // Costs: ceil(log2 n) steps of one line each, against n-1 polled lines per rank.
  void arrive(Phase phase, uint64_t round, const Deadline& d, const Check& check,
              const char* what);

  // Note [Cross-memory attach]
  // process_vm_readv copies straight from a peer's private memory into this process's (one
  // copy, by the kernel), so all_reduce needs no staging through the data area (Note
  // [Single-copy all_reduce]). Ranks only ever read each other's memory, never write it: a
  // peer whose call timed out and returned may already hold unrelated data at that address,
  // and a write could corrupt it long after the peer's call returned (a stopped peer that
  // resumes). The kernel allows it only where this process may ptrace the peer (same user,
  // and Yama, seccomp or a container profile not in the way), so setup probes it: every
  // rank reads every peer's control block through it, and the group uses it only if every
  // probe succeeded (all ranks take the same algorithms). MESHCOLL_CMA=0 turns it off.
  bool cma() const { return cma_; }
  // MESHCOLL_SHM_ALL_REDUCE as every rank of the group has it (agreed in setup): "auto",
  // "flat" or "scalable" (Note [Shared-memory all_reduce paths] in shm_collectives.cc).
  const std::string& all_reduce_path() const { return all_reduce_path_; }
  // MESHCOLL_SHM_SINGLE_COPY_BYTES as every rank of the group has it (agreed in setup): the
  // smallest single-copy all_reduce, 0 for the table by world size.
  size_t single_copy_bytes() const { return single_copy_bytes_; }
  // Copies `bytes` from address `remote` in rank r's address space to `local`. PeerError if
  // rank r is gone or no longer has that memory (it left the collective), SystemError for
  // any other failure.
  void read_peer(int r, uint64_t remote, void* local, size_t bytes);
  // This rank leaves, by an error, the single-copy call that began at `round`; and whether
  // rank r did.
  void give_up(uint64_t round) { ctrl_[rank_]->gave_up.store(round, std::memory_order_seq_cst); }
  bool gave_up(int r, uint64_t round) const {
    return ctrl_[r]->gave_up.load(std::memory_order_seq_cst) == round;
  }

 private:
  ShmGroup(int rank, int size, size_t data_bytes);
  std::atomic<uint64_t>& counter(int r, Phase p, uint64_t round);
  // Bumps this rank's futex word, waking peers asleep on it (Note [Futex wake-ups]).
  void wake();
  struct Wait;  // one wait's deadline, liveness check and clock (segment.cc)
  std::vector<int> missing_ranks(const Wait& w);  // the ranks a slow wait reports
  // Waits until `counter` (rank r's) is >= target: spins, then sleeps on r's futex word.
  void wait_on(Wait& w, int r, const std::atomic<uint64_t>& counter, uint64_t target);
  int rank_, size_;
  RankNames global_;
  size_t data_bytes_, seg_bytes_;
  std::vector<void*> maps_;
  std::vector<ShmControl*> ctrl_;
  std::vector<uint8_t*> data_;
  bool cma_ = false;
  int steps_ = 0;  // of the dissemination barrier: ceil(log2 size)
  std::string all_reduce_path_ = "auto";
  size_t single_copy_bytes_ = 0;
  // How long a waiter spins before sleeping on the futex (Note [Shared-memory spin]): a
  // caller's wait, and a group worker's (shorter where the workers do not fit the cores).
  std::chrono::microseconds spin_{100}, worker_spin_{100};
  bool yield_ = false;  // more ranks than cores: spins yield the core (see the constructor)
};

}  // namespace meshcoll::transport
