// A communicator: one group's rank, size, transport, timeout, and the worker thread that
// runs the group's operations one at a time, in issue order (so every rank's transport
// sees the same sequence of collectives; see Note [Agreement check]).
//
// Its failures follow Note [Failure types] (comm/failure.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/failure.h"
#include "comm/ledger.h"
#include "cpu/cpu_work.h"
#include "common/deadline.h"
#include "common/dtype.h"
#include "common/rank_names.h"
#include "store/exchange.h"
#include "store/store.h"
#include "transport/shm/segment.h"
#include "transport/transport.h"

namespace meshcoll::cpu {

struct CommOptions {
  Millis timeout = kDefaultTimeout;
  // "auto": shared memory between the ranks when they are all on one host (falls back to TCP,
  // with a warning, if /dev/shm is too small); "shm": required; "tcp": never.
  std::string transport = "auto";
  size_t shm_bytes = 4u << 20;  // per-rank data area for same-host collectives
  std::string bind_host;  // interface to listen on; empty = the one that reaches the store
  std::string token;
  bool debug = false;  // MESHCOLL_DEBUG: one line per operation on stderr
  RankNames global;    // the members' global ranks, which messages name
  // The settings every rank must share (Note [Shared settings] in store/exchange.h),
  // compared once the TCP links are up.
  store::Settings shared;
};

class Comm;

// A non-owning reference to a `void(Comm&)` callable: lets the inline path run a collective
// without building a std::function (a heap allocation for most captures).
class OpRef {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, OpRef>>>
  OpRef(F& f)  // NOLINT: implicit, like std::function
      : obj_(&f), call_([](void* o, Comm& c) { (*static_cast<F*>(o))(c); }) {}
  void operator()(Comm& c) const { call_(obj_, c); }

 private:
  void* obj_;
  void (*call_)(void*, Comm&);
};

class Comm {
 public:
  // Connects to every peer through `store` (already namespaced for this group).
  // `ledger` (the backend's, Note [Call ledger]): every collective takes its sequence number
  // from it when it takes its place in this Comm's issue order (under mu_), and the ledger
  // learns here how each ended. It outlives the Comm.
  Comm(std::shared_ptr<store::Store> store, int rank, int size, const CommOptions& opts,
       uint64_t comm_id, comm::Ledger* ledger);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int global_rank(int group_rank) const { return opts_.global(group_rank); }  // for messages
  Millis timeout() const { return opts_.timeout; }
  const std::shared_ptr<store::Store>& store() const { return store_; }

  // Queues a collective; `run` executes on the worker thread. timeout < 0: the comm default.
  // The Work holds `keep` until the operation ends.
  std::shared_ptr<CpuWork> enqueue(const OpDesc& desc, Millis timeout,
                                   std::function<void(Comm&)> run,
                                   std::vector<std::shared_ptr<void>> keep = {});
  // Runs a collective and waits for it. Note [Inline execution]: when the group is idle
  // (nothing queued, running or in flight) it runs on the calling thread, with no Work and no
  // allocation, saving two thread hand-offs per call (the per-call cost of small blocking
  // collectives); otherwise it is queued behind the pending operations, then waited for.
  // Issue order is kept either way. Throws what the operation threw.
  template <class F>
  void run_blocking(const OpDesc& desc, Millis timeout, F&& run) {
    transport::Envelope env;
    env.op = desc;
    uint64_t index;
    if (!try_claim(env, &index)) {
      enqueue(desc, timeout, std::forward<F>(run))->wait(Millis(-1));
      return;
    }
    std::exception_ptr error =
        execute(env, timeout.count() < 0 ? opts_.timeout : timeout, index, OpRef(run), true);
    release_claim();
    if (error) {
      failure_->mark_reported();
      std::rethrow_exception(error);
    }
  }
  // Queues a point-to-point send or receive; the per-peer message count is its sequence.
  // Note [Point-to-point in flight]: the worker only *posts* it and moves on to the next
  // operation, so `irecv` then `isend` on both sides of a pair cannot deadlock; posted
  // transfers progress during every later wait and complete their Work when done.
  // `record`: the transfer's number in the ledger (Ledger::open_p2p), closed when it ends.
  std::shared_ptr<CpuWork> enqueue_p2p(bool is_send, int peer, uint32_t tag, ConstBytes src,
                                       MutBytes dst, const OpDesc& desc, Millis timeout,
                                       uint64_t record,
                                       std::vector<std::shared_ptr<void>> keep = {});
  // A send or receive the caller waits for (send/recv, not isend/irecv). Note [Inline
  // execution] for point-to-point: when the group is idle the transfer is posted and driven on
  // the calling thread, with no Work; otherwise it is queued and waited for. Throws its failure.
  void run_p2p_blocking(bool is_send, int peer, uint32_t tag, ConstBytes src, MutBytes dst,
                        const OpDesc& desc, Millis timeout, uint64_t record);
  // Stops accepting work, finishes what is queued (each op is bounded by its deadline).
  // `farewell` (destroy(), not a destructor): then says goodbye to the peers and throws what
  // was left unmatched (Note [Farewell] in transport/transport.h), bounded by the timeout.
  void shutdown(bool farewell = false);
  // Fails the group as an operation's failure would (every peer gets an ABORT and raises at
  // once), queued behind the pending operations. For operations composed over several
  // groups (Note [Hierarchy] in hierarchy.py): a failure in one group must reach the ranks
  // that wait in another, with its type (that of `like`; PeerError when null).
  void fail(const std::string& message, std::exception_ptr like = nullptr);

  // ---- for algorithms, on the worker thread, inside `run` ----
  transport::Request send(int peer, uint32_t tag, ConstBytes src);
  transport::Request recv(int peer, uint32_t tag, MutBytes dst);
  void wait(const std::vector<transport::Request>& reqs) { transport_->wait_all(reqs, deadline_); }
  void wait(const transport::Request& r) { transport_->wait(r, deadline_); }
  transport::Transport& transport() { return *transport_; }
  // Same-host shared memory, or nullptr (ranks on several hosts, or MESHCOLL_TRANSPORT=tcp).
  transport::ShmGroup* shm() { return shm_.get(); }
  const std::string& shm_status() const { return shm_status_; }
  uint64_t next_shm_round() { return ++shm_round_; }
  const Deadline& deadline() const { return deadline_; }
  // An entry point that chooses among algorithms records its choice before moving data: it
  // travels in every frame's OpDesc (ranks that chose differently get MismatchError) and
  // names the algorithm in MESHCOLL_DEBUG=1 logs. `arity`: a tree's (OpDesc::arity).
  void set_algorithm(const char* name, uint8_t code, uint32_t arity = 0);
  // An operation whose steps run on other groups (Note [Hierarchy]) says so before running
  // them (its route is "hierarchy"). Its description takes the composed call's algorithm
  // code (kComposedAlgo), so a rank running the call flat, or another call, at its sequence
  // number disagrees with it in the agreement check.
  void set_composed();
  // Note [Steps watch their call's group] (common/interrupt.h): reads this group's links
  // while the running composed operation's steps wait on other groups; throws what it finds
  // (a frame or probe of another call: MismatchError; a peer's ABORT: its failure).
  void watch() { transport_->poll_once(); }
  // Note [Blame in a composed call's timeout] (cpu/hierarchy.cc): the timed-out step's own
  // message, which the operation's timeout shows only where the census names no rank.
  void set_step_timeout(std::string message) { step_timeout_ = std::move(message); }
  // This group only runs the steps of another group's composed operations (the hierarchy's
  // local and leaders groups). Its timeouts take no census: the composed operation's group
  // takes it over all its ranks, so a stopped rank on one host is named on every host,
  // not the healthy leader that stopped answering for it (Note [Timeout census]).
  void set_serves_steps() { serves_steps_ = true; }
  // For waits in shared memory: polls the TCP links, fails on a dead peer or an ABORT.
  const transport::ShmGroup::Check& shm_check() const { return shm_check_; }
  const transport::Envelope& current() const { return current_; }
  // Per-comm scratch memory, reused across operations (grown on demand, never shrunk).
  // Slots are independent buffers, so an algorithm may hold several at once.
  static constexpr int kScratchSlots = 3;
  uint8_t* scratch(int slot, size_t bytes);

 private:
  struct Item {
    transport::Envelope env;
    Millis timeout;
    std::function<void(Comm&)> run;  // collectives
    int peer = -1;                   // point-to-point: post to/from this peer
    bool is_send = false;
    ConstBytes src;
    MutBytes dst;
    std::shared_ptr<CpuWork> work;
    uint64_t index = 0;  // position in issue order
    uint64_t record = 0;  // point-to-point: its number in the ledger
  };
  std::shared_ptr<CpuWork> push(Item item);
  // Note [Inline execution]: if the group is idle, takes the next sequence number (a
  // collective's from the ledger; a transfer's, `peer` >= 0, from its count with that peer)
  // and index for `env` and the transport for the calling thread; release_claim() gives it
  // back.
  bool try_claim(transport::Envelope& env, uint64_t* index, int peer = -1, bool is_send = false);
  uint64_t next_p2p_seq_locked(int peer, bool is_send);
  static transport::Envelope p2p_envelope(uint32_t tag, const OpDesc& desc);
  // Throws Aborted once the group is destroyed.
  void check_open_locked(const OpDesc& d) const;
  void release_claim();
  // Runs one operation on the thread that owns the transport; returns its error, if any.
  std::exception_ptr execute(const transport::Envelope& env, Millis timeout, uint64_t index,
                             const OpRef& run, bool collective);
  void sync_in_flight_count();
  struct InFlight {
    transport::Request req;
    std::shared_ptr<CpuWork> work;
    Deadline deadline;
    int peer;
    uint32_t tag;
    bool is_send;
    uint64_t record;  // its number in the ledger
    OpDesc desc;
    Clock::time_point started;
    std::string what(const Comm& c) const;  // for errors only
  };
  // A point-to-point transfer ended (`error` null: completed): closes its ledger record, adds
  // it to the totals (Note [Call totals]) and logs it (MESHCOLL_DEBUG), as execute() does
  // for collectives; then finishes its Work, if it has one.
  void end_p2p(const InFlight& f, std::exception_ptr error);
  void worker_loop();
  void run_item(Item& item);
  void log_op(const transport::Envelope& env, Clock::time_point t0, std::exception_ptr error);
  // One MESHCOLL_DEBUG line: what ran, its sequence number, route, bytes and time.
  void log_line(const std::string& what, uint64_t seq, const char* route, uint64_t bytes,
                Clock::time_point t0, std::exception_ptr error);
  // How the running operation was carried, for the ledger: "shm", "tcp", "hierarchy", the
  // algorithm an all_reduce, reduce or broadcast chose, or "local" (a group of one).
  const char* route() const;
  std::string census(uint64_t seq);
  void start_p2p(Item& item);
  // "send to rank 3 (tag 0) on rank 1: ", for a transfer's errors.
  std::string p2p_what(bool is_send, int peer, uint32_t tag) const;
  static std::exception_ptr about_p2p(const std::string& what, std::exception_ptr error);
  // The failure of a transfer its peer never matched by the deadline.
  std::exception_ptr p2p_timeout(bool is_send, int peer, uint32_t tag, Millis timeout) const;
  void progress_in_flight();
  void reap_in_flight();
  void fail_group(std::exception_ptr error);

  int rank_;
  int size_;
  CommOptions opts_;
  std::shared_ptr<store::Store> store_;
  // Set by an interrupted Work.wait (Note [Interrupts]); the transport's waits check it.
  std::shared_ptr<StopRequest> stop_ = std::make_shared<StopRequest>();
  // The group's first failure (Note [Failure types] in comm/failure.h), recorded by the thread
  // that runs operations; shared with the Works, which mark it reported.
  std::shared_ptr<comm::Failure> failure_ = std::make_shared<comm::Failure>();
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::ShmGroup> shm_;
  std::string shm_status_;
  transport::ShmGroup::Check shm_check_;
  uint64_t shm_round_ = 0;

  std::mutex mu_;  // guards queue_, stopping_, seq counters
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::atomic<size_t> queued_{0};  // queue_.size(), readable without mu_ (the worker's spin)
  // The worker and the callers' waits spin briefly (Note [Brief spin] in cpu/cpu_work.cc): the
  // caller and the worker of every rank can each have a core.
  const bool spin_;
  bool stopping_ = false;
  bool busy_ = false;  // a thread (worker or inline caller) owns the transport
  size_t in_flight_count_ = 0;  // in_flight_.size(), readable under mu_
  comm::Ledger* ledger_;
  uint64_t next_index_ = 0;
  uint64_t failed_before_ = 0;  // items issued before the first failure
  std::vector<uint64_t> p2p_send_seq_, p2p_recv_seq_;
  std::thread worker_;
  int wake_fd_ = -1;                     // eventfd: new work while polling in-flight p2p
  std::atomic<bool> polling_idle_{false};

  // Worker-thread state.
  transport::Envelope current_;
  Deadline deadline_;
  std::vector<uint8_t> scratch_[kScratchSlots];
  const char* algorithm_ = "";
  bool used_tcp_ = false;  // the running operation sent or received over TCP
  bool composed_ = false;  // the running operation called set_composed()
  std::string step_timeout_;  // set_step_timeout(), for the running operation
  bool serves_steps_ = false;  // set_serves_steps(): set once, before any operation
  std::vector<InFlight> in_flight_;
};

}  // namespace meshcoll::cpu
