#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cstdlib>
#include <cstring>
#include <functional>

#include "common/config.h"
#include "common/cores.h"
#include "common/error.h"
#include "common/host_identity.h"
#include "common/interrupt.h"
#include "store/exchange.h"

namespace meshcoll::transport {

namespace {
constexpr size_t kControlBytes = (sizeof(ShmControl) + 4095) / 4096 * 4096;
}  // namespace

// A process killed inside the setup window (between creating its segment and unlinking it)
// leaves the name behind. Names carry rank 0's pid: sweep the ones whose process is gone.
// (A pid from another pid namespace sharing /dev/shm may look dead; removing a name only
// makes a setup in progress there fall back to TCP, never breaks mapped memory.)
static void sweep_stale_segments() {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  while (dirent* e = readdir(d)) {
    const char* name = e->d_name;
    if (std::strncmp(name, "meshcoll-", 9) != 0) continue;
    long pid = std::strtol(name + 9, nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      shm_unlink((std::string("/") + name).c_str());
  }
  closedir(d);
}

ShmGroup::ShmGroup(int rank, int size, size_t data_bytes)
    : rank_(rank), size_(size), data_bytes_(data_bytes), seg_bytes_(kControlBytes + data_bytes) {
  maps_.assign(size, nullptr);
  ctrl_.assign(size, nullptr);
  data_.assign(size, nullptr);
  // Note [Dissemination signalling]: ceil(log2 size) steps, which must fit the flags.
  if (size > (1 << kShmMaxSteps))
    throw InvalidArgument(str_cat("shared memory: ", size, " ranks on one host; at most ",
                                  1 << kShmMaxSteps, " are supported"));
  while ((1 << steps_) < size) ++steps_;
  // Note [Shared-memory spin]
  // Oversubscribed (more ranks than cores, Note [Spinning]): the peer we wait for may need
  // our core to run, so the spin yields it (sched_yield) instead of pausing, for longer before
  // sleeping: a futex sleep and wake-up costs several context switches per round.
  // Room for two threads per rank (a caller and its group's worker each have a core): the
  // peer runs on its own core and spinning takes nobody's, so a wait spins for 2 ms before it
  // sleeps, as MPI's shared memory spins. A sleep costs the waiter a wake-up of 10-50 us
  // when its peer comes; on many ranks every barrier then waits for the latest wake-up, the
  // next call starts more ragged, and more waits sleep: calls of a few tens of microseconds
  // took hundreds (docs/performance.md). Between the two (ranks fit, their workers do not),
  // a group's worker spins 100 us: it runs asynchronous calls while its rank's own thread
  // computes, and may need the core. A caller blocked in its own synchronous call holds back
  // nothing of its own, so it spins 2 ms there too. With 100 us, two ranks on a host that
  // other processes kept busy fell into turns of sleeps: a rank descheduled for a moment made
  // its peer sleep, the wake-up then took longer than 100 us, so the woken rank's next wait
  // slept too, and so on: a small all_reduce took tens of times longer than with 2 ms
  // (docs/performance.md, "Shared-memory spin"). MESHCOLL_SHM_SPIN_US overrides both times.
  // Past its first half microsecond the spin yields the core (Note [Yielding spin]).
  const auto ranks = static_cast<unsigned>(size);
  yield_ = !threads_fit(ranks, host_cores());
  const long us = config().shm_spin_us;
  using us_t = std::chrono::microseconds;
  spin_ = us_t(us >= 0 ? us : yield_ ? 1000 : 2000);
  worker_spin_ = us >= 0 || yield_ || threads_fit(2 * ranks, host_cores()) ? spin_ : us_t(100);
}

std::unique_ptr<ShmGroup> ShmGroup::create(int rank, int size, store::Store& store,
                                           size_t data_bytes, const Deadline& d,
                                           const Check& check, std::string* why,
                                           const RankNames& names) {
  auto step = [&](const char* name, const std::string& mine) {
    return store::exchange(store, str_cat("shm/", name), rank, size, mine, d, check, names);
  };
  // Every rank publishes a verdict for each step and reads everyone's, so all ranks take the
  // same branch even when only one of them fails.
  auto agree = [&](const char* name, const std::string& my_error) {
    auto all = step(name, my_error.empty() ? "ok" : my_error);
    for (int r = 0; r < size; ++r) {
      if (all[r] != "ok") {
        *why = str_cat("rank ", r, ": ", all[r]);
        return false;
      }
    }
    return true;
  };

  // Same host and IPC namespace as rank 0? Rank 0's entry also carries, before a newline, a
  // nonce that makes segment names unique across concurrent jobs on the host.
  std::string id = host_identity();
  if (rank == 0) {
    sweep_stale_segments();
    id = str_cat(getpid(), "-", Clock::now().time_since_epoch().count(), "\n", id);
  }
  auto ids = step("host", id);
  const size_t cut = ids[0].find('\n');
  const std::string nonce = ids[0].substr(0, cut);
  for (int r = 1; r < size; ++r) {
    if (ids[r] != ids[0].substr(cut + 1)) {
      *why = str_cat("rank ", r, ": on another host or IPC namespace than rank 0");
      return nullptr;
    }
  }
  const std::string base = str_cat("/meshcoll-", nonce, "-");
  auto shm_name = [&](int r) { return str_cat(base, r); };
  // Note [Shared-memory lifetime]: however create() ends, every rank's name goes.
  struct UnlinkAll {
    std::function<std::string(int)> name;
    int size;
    ~UnlinkAll() {
      for (int r = 0; r < size; ++r) shm_unlink(name(r).c_str());
    }
  } unlink_all{shm_name, size};

  std::unique_ptr<ShmGroup> g(new ShmGroup(rank, size, data_bytes));
  std::string mine = shm_name(rank);
  std::string err;
  int fd = shm_open(mine.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    err = str_cat("cannot create shared memory ", mine, ": ", errno_text(errno));
  } else {
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(g->seg_bytes_));
    if (rc != 0) {
      err = str_cat("/dev/shm has no room for ", g->seg_bytes_, " bytes (", errno_text(rc),
                    "); the group needs ", size, " x ", g->seg_bytes_,
                    " bytes there: enlarge it (docker --shm-size), lower MESHCOLL_SHM_BYTES, "
                    "or set MESHCOLL_TRANSPORT=tcp");
    } else {
      void* m = mmap(nullptr, g->seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (m == MAP_FAILED) {
        err = str_cat("mmap of shared memory failed: ", errno_text(errno));
      } else {
        g->maps_[rank] = m;
        auto* ctrl = new (m) ShmControl();
        ctrl->pid = getpid();
        ctrl->self_addr = reinterpret_cast<uintptr_t>(ctrl);
        g->ctrl_[rank] = static_cast<ShmControl*>(m);
        g->data_[rank] = static_cast<uint8_t*>(m) + kControlBytes;
      }
    }
    ::close(fd);
  }
  if (!agree("created", err)) return nullptr;
  for (int r = 0; r < size && err.empty(); ++r) {
    if (r == rank) continue;
    int pfd = shm_open(shm_name(r).c_str(), O_RDWR, 0600);
    if (pfd < 0) {
      err = str_cat("cannot open rank ", r, "'s shared memory: ", errno_text(errno));
      break;
    }
    // Mapping past the end of a smaller segment would be SIGBUS on first touch.
    struct stat st {};
    if (fstat(pfd, &st) != 0 || static_cast<size_t>(st.st_size) != g->seg_bytes_) {
      err = str_cat("rank ", r, "'s shared memory holds ", st.st_size, " bytes, not the ",
                    g->seg_bytes_, " this rank's does: the ranks have different data sizes");
      ::close(pfd);
      break;
    }
    void* m = mmap(nullptr, g->seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
    ::close(pfd);
    if (m == MAP_FAILED) {
      err = str_cat("mmap of rank ", r, "'s shared memory failed: ", errno_text(errno));
      break;
    }
    g->maps_[r] = m;
    g->ctrl_[r] = static_cast<ShmControl*>(m);
    g->data_[r] = static_cast<uint8_t*>(m) + kControlBytes;
  }
  if (!agree("mapped", err)) return nullptr;

  // Note [Cross-memory attach]: read each peer's pid field through the kernel and compare
  // it with what the mapping shows. A failure only turns the feature off, on every rank.
  std::string cma_why;
  if (!config().cma) cma_why = "disabled by MESHCOLL_CMA=0";
  for (int r = 0; r < size && cma_why.empty(); ++r) {
    if (r == rank) continue;
    const ShmControl& peer = *g->ctrl_[r];
    int64_t seen = 0;
    try {
      const uint64_t pid_at =
          reinterpret_cast<uintptr_t>(&peer.pid) - reinterpret_cast<uintptr_t>(&peer);
      g->read_peer(r, peer.self_addr + pid_at, &seen, sizeof(seen));
      if (seen != peer.pid) cma_why = str_cat("rank ", r, "'s memory reads back wrong");
    } catch (const std::exception& e) {
      cma_why = e.what();
    }
  }
  // The step also carries MESHCOLL_SHM_ALL_REDUCE and MESHCOLL_SHM_SINGLE_COPY_BYTES: ranks
  // that chose all_reduce paths differently would wait for each other in different places.
  g->all_reduce_path_ = config().shm_all_reduce;
  g->single_copy_bytes_ = config().shm_single_copy_bytes;
  g->cma_ = true;
  const std::string settings[2] = {g->all_reduce_path_, std::to_string(g->single_copy_bytes_)};
  const char* variables[2] = {"MESHCOLL_SHM_ALL_REDUCE", "MESHCOLL_SHM_SINGLE_COPY_BYTES"};
  auto all =
      step("cma", str_cat(settings[0], "\n", settings[1], "\n", cma_why.empty() ? "ok" : cma_why));
  for (int r = 0; r < size; ++r) {
    const size_t cut = all[r].find('\n'), cut2 = all[r].find('\n', cut + 1);
    if (all[r].substr(cut2 + 1) != "ok") g->cma_ = false;
    const std::string theirs[2] = {all[r].substr(0, cut),
                                   all[r].substr(cut + 1, cut2 - cut - 1)};
    for (int k = 0; k < 2; ++k) {
      if (theirs[k] == settings[k]) continue;
      *why = str_cat("rank ", r, " has ", variables[k], "=", theirs[k], " but rank ", rank,
                     " has ", settings[k], "; set it the same on every rank (or unset it)");
      return nullptr;
    }
  }
  return g;
}

void ShmGroup::read_peer(int r, uint64_t remote, void* local, size_t bytes) {
  auto* at = static_cast<uint8_t*>(local);
  const auto pid = static_cast<pid_t>(ctrl_[r]->pid);
  while (bytes > 0) {  // the kernel may copy less than asked (a partial copy): go on
    iovec l{at, bytes};
    iovec p{reinterpret_cast<void*>(remote), bytes};
    ssize_t got = process_vm_readv(pid, &l, 1, &p, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == ESRCH)
      throw PeerError(str_cat("rank ", global_(rank_), ": rank ", global_(r), " (pid ", pid,
                              ") exited while this rank read its memory"));
    // The local side is this rank's own live array or scratch: a fault is on rank r's side,
    // which unmapped the array it published, so it has left the collective.
    if (got < 0 && errno == EFAULT)
      throw PeerError(str_cat("rank ", global_(rank_), ": rank ", global_(r), " left the "
                              "collective (the array it published is no longer mapped) while "
                              "this rank read it; see rank ", global_(r), "'s own error"));
    if (got <= 0)
      throw SystemError(str_cat("rank ", global_(rank_), ": process_vm_readv from rank ",
                                global_(r), " failed: ",
                                got < 0 ? errno_text(errno) : std::string("no progress")));
    at += got;
    remote += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
}

ShmGroup::~ShmGroup() {
  for (auto* m : maps_)
    if (m) munmap(m, seg_bytes_);
}

std::atomic<uint64_t>& ShmGroup::counter(int r, Phase p, uint64_t round) {
  return p == kArrived ? slot(r, round).arrived : ctrl_[r]->reduced;
}

namespace {
long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  // Process-shared (no FUTEX_PRIVATE_FLAG): the word lives in a MAP_SHARED mapping.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}
}  // namespace

void ShmGroup::wake() {
  ShmControl& me = *ctrl_[rank_];
  me.epoch.fetch_add(1, std::memory_order_seq_cst);
  if (me.sleepers.load(std::memory_order_seq_cst) > 0)
    futex(&me.epoch, FUTEX_WAKE, INT32_MAX, nullptr);
}

void ShmGroup::publish(Phase phase, uint64_t round) {
  ShmControl& me = *ctrl_[rank_];
  // Note [Dissemination signalling]: a rank in arrive() for this round gets past this rank.
  if (phase == kArrived)
    for (int k = 0; k < steps_; ++k) me.step[k].value.store(2 * round, std::memory_order_release);
  counter(rank_, phase, round).store(round, std::memory_order_seq_cst);
  wake();
}

struct ShmGroup::Wait {
  const Deadline& d;
  const Check& check;
  const char* what;
  // Who is not there yet (slow path only): with `barrier`, the ranks whose step flags are
  // below `target` (arrive); else those whose `phase` counter is below it (wait_all).
  bool barrier;
  Phase phase;
  uint64_t target;
  // The clock is read only once the first spins have failed: most waits end before that.
  Clock::time_point spin_start, next_check;
  bool timing = false;
};

std::vector<int> ShmGroup::missing_ranks(const Wait& w) {
  std::vector<int> out;
  if (!w.barrier) {
    for (int r = 0; r < size_; ++r)
      if (counter(r, w.phase, w.target).load(std::memory_order_acquire) < w.target)
        out.push_back(r);
    return out;
  }
  // The ranks that have not entered this barrier; if all have, those not through it yet (a
  // rank that died inside it is among them, the live ones are waiting).
  for (int k : {0, steps_ - 1}) {
    for (int r = 0; r < size_; ++r)
      if (ctrl_[r]->step[k].value.load(std::memory_order_acquire) < w.target) out.push_back(r);
    if (!out.empty()) break;
  }
  return out;
}

// Spin for a few microseconds (the peer is usually just behind), then sleep on the peer's
// futex in naps of at most 5 ms, checking (dead peer, ABORT, deadline) between.
//
// Note [Yielding spin]
// A wait pauses for about half a microsecond, then yields the core (sched_yield) after every
// 32 pauses until it sleeps, as Open MPI's polling loop yields when oversubscribed. A peer
// that is late past the first half microsecond is often not running at all: on a host where
// other processes keep every core busy it waits for a core, and it may be queued on this
// one; pausing there kept it off for the whole spin of Note [Shared-memory spin], and a
// 2-rank 8-byte all_reduce took milliseconds a call on the loaded 2-core VM (microseconds
// with the yield; docs/performance.md, "stamped lines and a yielding spin"). Where nothing
// else wants the core, sched_yield returns at once: a wait that has lasted half a
// microsecond sees its peer at most a syscall later.
void ShmGroup::wait_on(Wait& w, int r, const std::atomic<uint64_t>& counter, uint64_t target) {
  auto reached = [&] { return counter.load(std::memory_order_acquire) >= target; };
  auto periodic = [&] {
    std::vector<int> missing = missing_ranks(w);
    if (missing.empty() && !reached()) missing.push_back(r);  // there, but not this far yet
    if (w.check) w.check(missing);
    check_interrupt(global_(rank_), w.spin_start);
    if (w.d.expired()) {
      std::string list;
      for (int m : missing) list += str_cat(list.empty() ? "" : ", ", global_(m));
      throw TimeoutError(str_cat("rank ", global_(rank_), " timed out after ",
                                 w.d.timeout().count(), " ms in ", w.what,
                                 " (shared memory): rank(s) ", list,
                                 " had not arrived; they are slow, stuck in other code, or "
                                 "called another collective"));
    }
  };
  constexpr int kPauses = 32;  // about 0.5 us (Note [Yielding spin])
  for (int i = 0; !reached(); ++i) {
    if (i < kPauses) {
      if (yield_) {
        sched_yield();
        i += kPauses / 4;  // a yield is worth many pauses
      }
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    auto now = Clock::now();
    if (!w.timing) {
      w.timing = true;
      w.spin_start = now;
      w.next_check = now + Millis(5);
    }
    if (now >= w.next_check) {
      periodic();
      w.next_check = now + Millis(5);
    }
    if (now - w.spin_start < (on_worker_thread() ? worker_spin_ : spin_)) {
      sched_yield();  // Note [Yielding spin]
      i = 0;
      continue;
    }
    ShmControl& c = *ctrl_[r];
    uint32_t seen = c.epoch.load(std::memory_order_seq_cst);
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!reached()) {
      timespec nap{0, 5 * 1000 * 1000};
      futex(&c.epoch, FUTEX_WAIT, seen, &nap);
    }
    c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ShmGroup::wait_all(Phase phase, uint64_t round, const Deadline& d, const Check& check,
                        const char* what) {
  Wait w{d, check, what, false, phase, round};
  for (int r = 0; r < size_; ++r) wait_on(w, r, counter(r, phase, round), round);
}

void ShmGroup::arrive(Phase phase, uint64_t round, const Deadline& d, const Check& check,
                      const char* what) {
  ShmControl& me = *ctrl_[rank_];
  const uint64_t value = 2 * round + (phase == kArrived ? 0 : 1);
  // Announced in the slot too: a rank in a flat round for the same round waits on that.
  if (phase == kArrived) slot(rank_, round).arrived.store(round, std::memory_order_release);
  Wait w{d, check, what, true, phase, value};
  for (int k = 0, dist = 1; k < steps_; ++k, dist *= 2) {
    me.step[k].value.store(value, std::memory_order_seq_cst);
    wake();
    const int from = (rank_ - dist % size_ + size_) % size_;
    wait_on(w, from, ctrl_[from]->step[k].value, value);
  }
}

}  // namespace meshcoll::transport
