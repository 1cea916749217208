// Shared memory between the ranks of one host: every rank creates one segment (a control
// block it alone writes, then a data area) and maps every peer's. Same-host collectives
// (csrc/algo/shm_collectives.cc) read peers' data areas directly: no kernel copies.
//
// Note [Shared-memory lifetime]
// Segments are POSIX shm objects named from the job token, the group and the rank. Each is
// unlinked as soon as every peer has mapped it (a store barrier during setup), so a normal
// exit, a crash or kill -9 after setup leaves nothing in /dev/shm; the mappings die with the
// processes. Space is reserved with posix_fallocate, so a too-small /dev/shm is a clear error
// at setup (naming the bytes needed) instead of SIGBUS on first touch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "store/store.h"
#include "transport/transport.h"

namespace meshcoll::transport {

// One rank's control block. Each counter is written by its owner only and read by all; a
// counter holds the last round for which the owner finished that phase.
struct alignas(64) ShmControl {
  std::atomic<uint64_t> arrived;  // data for the round is in the data area
  char pad0[56];
  std::atomic<uint64_t> reduced;  // this rank's reduced slice is published
  char pad1[56];
  std::atomic<uint64_t> released;  // this rank finished reading peers' data areas
  char pad2[56];
  // The operation of the rounds in flight, for the agreement check: one per half of the data
  // area (Note [Shared-memory rounds]), indexed by round parity.
  OpDesc desc[2];
  uint64_t seq[2];
  // Note [Futex wake-ups]: bumped on every publish; a waiter that has spun long enough sleeps
  // on it (a process-shared futex) after announcing itself in `sleepers`, so an idle or
  // oversubscribed host does not burn cores, and a publisher only pays for a wake-up
  // syscall when someone sleeps.
  std::atomic<uint32_t> epoch;
  std::atomic<uint32_t> sleepers;
};
static_assert(sizeof(ShmControl) % 64 == 0, "control block layout");

class ShmGroup {
 public:
  // Collective over the group: creates, exchanges and maps segments through `store`. Every
  // rank gets the same outcome: a group, or nullptr with the reason in *why (a rank's
  // /dev/shm too small, ranks on different hosts or IPC namespaces).
  static std::unique_ptr<ShmGroup> create(int rank, int size, store::Store& store,
                                          size_t data_bytes, const Deadline& d, std::string* why);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t data_bytes() const { return data_bytes_; }
  ShmControl& control(int r) { return *ctrl_[r]; }
  uint8_t* data(int r) { return data_[r]; }

  enum Phase { kArrived, kReduced, kReleased };
  // Publishes this rank's `phase` counter for `round` and wakes sleeping waiters.
  void publish(Phase phase, uint64_t round);
  // Called every few ms while waiting, with the ranks not there yet: polls the TCP links for
  // a dead peer or an ABORT frame, and throws.
  using Check = std::function<void(const std::vector<int>& missing)>;
  // Waits until every rank's `phase` counter is >= round. On the deadline: TimeoutError
  // naming the ranks that had not reached the phase.
  void wait_all(Phase phase, uint64_t round, const Deadline& d, const Check& check,
                const char* what);
  // Same, for one rank only (broadcast waits on the root).
  void wait_one(int r, Phase phase, uint64_t round, const Deadline& d, const Check& check,
                const char* what);

  // Same-host groups only: the identity every rank publishes to decide (host, IPC namespace).
  static std::string host_identity();

 private:
  ShmGroup(int rank, int size, size_t data_bytes);
  std::atomic<uint64_t>& counter(int r, Phase p);
  void wait_until(const std::vector<int>& ranks, Phase phase, uint64_t round, const Deadline& d,
                  const Check& check, const char* what);
  int rank_, size_;
  size_t data_bytes_, seg_bytes_;
  std::vector<void*> maps_;
  std::vector<ShmControl*> ctrl_;
  std::vector<uint8_t*> data_;
  std::vector<int> all_ranks_;
  // How long a waiter spins before sleeping on the futex: long when every rank can have a core
  // (the peer is running and about to publish), short when ranks outnumber cores (spinning
  // would steal the core the awaited peer needs).
  std::chrono::microseconds spin_{100};
};

}  // namespace meshcoll::transport
