#include "cpu/engine.h"

#include <sys/eventfd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

#include "common/check.h"
#include "common/cores.h"
#include "common/thread_name.h"
#include "store/exchange.h"
#include "transport/tcp/tcp_transport.h"

namespace meshcoll::cpu {


Comm::Comm(std::shared_ptr<store::Store> store, int rank, int size, const CommOptions& opts,
           uint64_t comm_id, comm::Ledger* ledger)
    : rank_(rank), size_(size), opts_(opts), store_(std::move(store)),
      spin_(threads_fit(2u * static_cast<unsigned>(size), process_cores())),  // Note [Spinning]
      ledger_(ledger) {
  MC_ARG_CHECK(size >= 1, "group size must be >= 1, got ", size);
  MC_ARG_CHECK(rank >= 0 && rank < size, "rank ", rank, " is out of range for a group of ", size);
  transport::TcpOptions topts;
  topts.bind_host = opts.bind_host.empty() ? "127.0.0.1" : opts.bind_host;
  topts.token = opts.token;
  topts.comm_id = comm_id;
  topts.global = opts.global;
  topts.stop = stop_;
  transport_ = std::make_unique<transport::TcpTransport>(rank, size, *store_, topts, &describe_op,
                                                         Deadline(opts.timeout));
  Deadline setup(opts.timeout);
  auto died = [this](const std::vector<int>& missing) {
    transport_->poll_once();
    for (int p : missing)
      if (transport_->peer_closed(p))
        throw PeerError(str_cat("rank ", rank_, ": rank ", p, " closed its connection while "
                                "this group was being set up: rank ", p, " exited or crashed"));
  };
  if (size > 1) store::agree_on_settings(*store_, rank, size, opts.shared, setup, died, opts.global);
  if (size > 1 && opts.transport != "tcp") {
    std::string why;
    shm_ = transport::ShmGroup::create(rank, size, *store_, opts.shm_bytes, setup, died, &why,
                                       opts.global);
    if (!shm_ && opts.transport == "shm")
      throw Error(str_cat("rank ", rank, ": MESHCOLL_TRANSPORT=shm but shared memory is not usable: ",
                          why));
    if (shm_) shm_->set_rank_names(opts.global);
    shm_status_ = shm_ ? "shm" : "tcp (shared memory unusable: " + why + ")";
  } else {
    shm_status_ = "tcp";
  }
  shm_check_ = [this](const std::vector<int>& missing) {
    transport_->poll_once();
    for (int p : missing)
      if (transport_->peer_closed(p))
        throw PeerError(str_cat("rank ", global_rank(rank_), ": rank ", global_rank(p),
                                " closed its connection while the group waited for it in shared "
                                "memory: rank ", global_rank(p), " exited, crashed or aborted"));
    transport_->check_unexpected();
  };
  p2p_send_seq_.assign(size, 0);
  p2p_recv_seq_.assign(size, 0);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw SystemError(str_cat("eventfd failed: ", errno_text(errno)));
  worker_ = named_thread("mc-worker", [this] { worker_loop(); });
}

Comm::~Comm() {
  shutdown();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Comm::fail(const std::string& message, std::exception_ptr like) {
  enqueue(make_desc(CollKind::kFail, DType::kUint8, 0), Millis(-1), [message, like](Comm&) {
    if (like) std::rethrow_exception(same_type(like, message));
    throw PeerError(message);
  });
}

void Comm::shutdown(bool farewell) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  // Note [Farewell]: a call whose part here only sent may have returned before its peers
  // disagreed; destroy() is the last place to hear of it. Not after a failure: it was raised.
  // Not in a group that serves another's steps: their failures are that group's, which
  // its ranks abort and whose own farewell reads.
  std::exception_ptr unmatched;
  if (farewell && size_ > 1 && transport_ && !failure_->failed() && !serves_steps_) {
    try {
      transport_->farewell(Deadline(opts_.timeout));
    } catch (...) {
      unmatched = std::current_exception();
    }
  }
  // Nothing runs on the group any more: close its connections now, not when the last Python
  // reference goes, so a peer still waiting for this rank on this group fails at once
  // (PeerError) instead of at its timeout; it then leaves too, which the store's host may be
  // waiting for (Note [Store teardown]).
  transport_.reset();
  // Its shared memory and eventfd too: a destroyed group held by Python (a variable, a
  // traceback) must not keep them until it is collected.
  shm_.reset();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
  if (unmatched) std::rethrow_exception(unmatched);
}

void Comm::check_open_locked(const OpDesc& d) const {
  if (stopping_)
    throw Aborted(str_cat("rank ", global_rank(rank_), ": ", describe_op(d),
                          " was called on a destroyed group"));
}

std::shared_ptr<CpuWork> Comm::push(Item item) {
  std::unique_lock<std::mutex> lock(mu_);
  check_open_locked(item.env.op);
  ledger_->pending().issued();  // Note [One issuing thread]: every item has a Work
  if (item.env.channel == transport::Channel::kCollective)
    item.env.seq = ledger_->open_collective(item.env.op);
  item.index = next_index_++;
  auto work = item.work;
  queue_.push_back(std::move(item));
  queued_.store(queue_.size(), std::memory_order_release);
  cv_.notify_all();
  if (polling_idle_.load()) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  return work;
}

bool Comm::try_claim(transport::Envelope& env, uint64_t* index, int peer, bool is_send) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open_locked(env.op);
  if (busy_ || !queue_.empty() || in_flight_count_ > 0) return false;
  busy_ = true;
  env.seq = peer < 0 ? ledger_->open_collective(env.op) : next_p2p_seq_locked(peer, is_send);
  *index = next_index_++;
  return true;
}

uint64_t Comm::next_p2p_seq_locked(int peer, bool is_send) {
  return is_send ? p2p_send_seq_[peer]++ : p2p_recv_seq_[peer]++;
}

transport::Envelope Comm::p2p_envelope(uint32_t tag, const OpDesc& desc) {
  transport::Envelope env;
  env.channel = transport::Channel::kP2P;
  env.tag = tag;
  env.op = desc;
  return env;
}

void Comm::release_claim() {
  std::unique_lock<std::mutex> lock(mu_);
  busy_ = false;
  // Wake the worker only if work arrived meanwhile: a needless wake-up is a context switch
  // on every call.
  bool wake = !queue_.empty() || in_flight_count_ > 0 || stopping_;
  lock.unlock();
  if (wake) cv_.notify_all();
}

std::shared_ptr<CpuWork> Comm::enqueue(const OpDesc& desc, Millis timeout,
                                       std::function<void(Comm&)> run,
                                       std::vector<std::shared_ptr<void>> keep) {
  Item item;
  item.env.channel = transport::Channel::kCollective;  // push() takes the sequence number
  item.env.op = desc;
  item.timeout = timeout.count() < 0 ? opts_.timeout : timeout;
  item.run = std::move(run);
  item.work = std::make_shared<CpuWork>(global_rank(rank_), desc, stop_, failure_, spin_,
                                        &ledger_->pending());
  for (auto& k : keep) item.work->keep(std::move(k));
  return push(std::move(item));
}

std::shared_ptr<CpuWork> Comm::enqueue_p2p(bool is_send, int peer, uint32_t tag, ConstBytes src,
                                           MutBytes dst, const OpDesc& desc,
                                           Millis timeout, uint64_t record,
                                           std::vector<std::shared_ptr<void>> keep) {
  Item item;
  item.env = p2p_envelope(tag, desc);
  item.timeout = timeout.count() < 0 ? opts_.timeout : timeout;
  item.peer = peer;
  item.is_send = is_send;
  item.src = src;
  item.dst = dst;
  item.record = record;
  item.work = std::make_shared<CpuWork>(global_rank(rank_), desc, stop_, failure_, spin_,
                                        &ledger_->pending());
  for (auto& k : keep) item.work->keep(std::move(k));
  {
    std::lock_guard<std::mutex> lock(mu_);
    item.env.seq = next_p2p_seq_locked(peer, is_send);
  }
  return push(std::move(item));
}

transport::Request Comm::send(int peer, uint32_t tag, ConstBytes src) {
  transport::Envelope env = current_;
  env.tag = tag;
  used_tcp_ = true;
  return transport_->isend(peer, env, src);
}

transport::Request Comm::recv(int peer, uint32_t tag, MutBytes dst) {
  transport::Envelope env = current_;
  env.tag = tag;
  used_tcp_ = true;
  return transport_->irecv(peer, env, dst);
}

uint8_t* Comm::scratch(int slot, size_t bytes) {
  auto& buf = scratch_[slot];
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

void Comm::worker_loop() {
  mark_worker_thread();  // its shared-memory waits spin less (Note [Shared-memory spin])
  for (;;) {
    Item item;
    bool have = false;
    // Note [Brief spin] (cpu/cpu_work.cc), the worker's side: the next operation of a stream of
    // small asynchronous ones usually comes within microseconds; a sleep on cv_ would cost the
    // caller a futex wake-up and a context switch to hand it over. Not while point-to-point
    // transfers are in flight: the worker drives those instead (progress_in_flight).
    for (const auto idle_since = Clock::now();
         spin_ && in_flight_.empty() && queued_.load(std::memory_order_acquire) == 0 &&
         Clock::now() - idle_since < kBriefSpin;)
      std::this_thread::yield();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return !busy_ && (stopping_ || !queue_.empty() || in_flight_count_ > 0);
      });
      if (!queue_.empty()) {
        item = std::move(queue_.front());
        queue_.pop_front();
        queued_.store(queue_.size(), std::memory_order_release);
        have = true;
      } else if (in_flight_count_ == 0) {
        return;  // stopping, and everything issued has finished
      } else {
        polling_idle_ = true;  // from here on, push() wakes the poll below
      }
      busy_ = true;
    }
    if (have) {
      run_item(item);
    } else {
      progress_in_flight();
      polling_idle_ = false;
      uint64_t drained;
      while (::read(wake_fd_, &drained, sizeof(drained)) > 0) {
      }
    }
    reap_in_flight();
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
  }
}

void Comm::sync_in_flight_count() {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_count_ = in_flight_.size();
}

// Only posted point-to-point transfers are pending: drive them until one completes, new work
// is issued, or the earliest deadline passes (then that transfer times out).
void Comm::progress_in_flight() {
  std::vector<transport::Request> reqs;
  Deadline earliest = in_flight_.front().deadline;
  for (const auto& f : in_flight_) {
    reqs.push_back(f.req);
    int ms = f.deadline.poll_ms(), best = earliest.poll_ms();  // -1 means never
    if (ms >= 0 && (best < 0 || ms < best)) earliest = f.deadline;
  }
  try {
    if (!transport_->wait_any(reqs, earliest, wake_fd_)) {
      for (const auto& f : in_flight_) {
        if (!f.req->complete() && f.deadline.expired())
          std::rethrow_exception(p2p_timeout(f.is_send, f.peer, f.tag, f.deadline.timeout()));
      }
    }
  } catch (...) {
    std::exception_ptr e = std::current_exception();
    fail_group(e);
  }
}

void Comm::reap_in_flight() {
  for (size_t i = 0; i < in_flight_.size();) {
    if (in_flight_[i].req->complete()) {
      end_p2p(in_flight_[i], nullptr);
      in_flight_[i] = std::move(in_flight_.back());
      in_flight_.pop_back();
    } else {
      ++i;
    }
  }
  sync_in_flight_count();
}

const char* Comm::route() const {
  if (composed_) return "hierarchy";
  if (*algorithm_) return algorithm_;  // all_reduce, reduce, broadcast: the algorithm it chose
  if (size_ == 1) return "local";
  return used_tcp_ ? "tcp" : "shm";
}

void Comm::set_composed() {
  composed_ = true;
  current_.op.algo = kComposedAlgo;
  transport_->begin_collective(current_);  // frames of another call that came first disagree
}

void Comm::set_algorithm(const char* name, uint8_t code, uint32_t arity) {
  algorithm_ = name;
  current_.op.algo = code;
  current_.op.arity = arity;
  transport_->begin_collective(current_);  // re-check buffered frames with the algorithm known
}

std::string Comm::InFlight::what(const Comm& c) const { return c.p2p_what(is_send, peer, tag); }

std::string Comm::p2p_what(bool is_send, int peer, uint32_t tag) const {
  return str_cat(is_send ? "send to rank " : "recv from rank ", global_rank(peer), " (tag ", tag,
                 ") on rank ", global_rank(rank_), ": ");
}

// `error` as a transfer's failure: prefixed with the transfer (`what`) unless it is that
// transfer's own (a timeout names it already).
std::exception_ptr Comm::about_p2p(const std::string& what, std::exception_ptr error) {
  const std::string msg = message_of(error);
  return msg.rfind(what, 0) == 0 ? error : same_type(error, what + msg);
}

std::exception_ptr Comm::p2p_timeout(bool is_send, int peer, uint32_t tag, Millis timeout) const {
  return std::make_exception_ptr(TimeoutError(str_cat(
      p2p_what(is_send, peer, tag), "timed out after ", timeout.count(),
      " ms: the peer never posted the matching ", is_send ? "recv" : "send",
      ", or it is stuck in other code")));
}

void Comm::run_p2p_blocking(bool is_send, int peer, uint32_t tag, ConstBytes src, MutBytes dst,
                            const OpDesc& desc, Millis timeout, uint64_t record) {
  transport::Envelope env = p2p_envelope(tag, desc);
  const Millis t = timeout.count() < 0 ? opts_.timeout : timeout;
  uint64_t index = 0;
  if (!try_claim(env, &index, peer, is_send)) {
    // Not idle: behind the pending operations, as isend/irecv would be.
    enqueue_p2p(is_send, peer, tag, src, dst, desc, timeout, record)->wait(Millis(-1));
    return;
  }
  transport::Request req;
  auto post = [&](Comm&) {
    req = is_send ? transport_->isend(peer, env, src) : transport_->irecv(peer, env, dst);
  };
  const InFlight f{nullptr, nullptr, Deadline(t), peer, tag, is_send, record, desc, Clock::now()};
  std::exception_ptr error = execute(env, t, index, OpRef(post), false);
  if (!error) {
    // Driven here as the worker would (progress_in_flight), in slices of kInterruptEvery so
    // that a Ctrl-C is the call's outcome (Note [Interrupts]).
    const auto since = Clock::now();
    try {
      while (!req->complete()) {
        const auto slice = std::min(deadline_.at(), Clock::now() + kInterruptEvery);
        if (!transport_->wait_any({req}, Deadline::until(slice, t), -1)) {
          if (deadline_.expired()) std::rethrow_exception(p2p_timeout(is_send, peer, tag, t));
          check_interrupt(global_rank(rank_), since);
        }
      }
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      fail_group(e);
      error = about_p2p(p2p_what(is_send, peer, tag), e);
    }
  }
  end_p2p(f, error);
  release_claim();
  if (error) {
    failure_->mark_reported();
    std::rethrow_exception(error);
  }
}

void Comm::start_p2p(Item& item) {
  transport::Request req = item.is_send ? transport_->isend(item.peer, item.env, item.src)
                                        : transport_->irecv(item.peer, item.env, item.dst);
  InFlight f{req, item.work, Deadline(item.timeout), item.peer, item.env.tag, item.is_send,
             item.record, item.env.op, Clock::now()};
  if (req->complete()) {
    end_p2p(f, nullptr);
  } else {
    in_flight_.push_back(std::move(f));
    sync_in_flight_count();
  }
}

namespace {
// The ABORT frame carries the error's kind, so every peer raises the same type.
transport::AbortKind abort_kind_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const MismatchError&) {
    return transport::AbortKind::kMismatch;
  } catch (const TimeoutError&) {
    return transport::AbortKind::kTimeout;
  } catch (const PeerError&) {
    return transport::AbortKind::kPeer;
  } catch (...) {
    return transport::AbortKind::kGeneric;
  }
}
}  // namespace

// The group is dead after its first failure: record it, tell the peers (abort), and fail
// every posted point-to-point transfer with the same error.
void Comm::fail_group(std::exception_ptr error) {
  const bool first = failure_->record(error);
  if (first) {
    std::lock_guard<std::mutex> lock(mu_);
    failed_before_ = next_index_;
  }
  // Any failure mid-operation leaves peers waiting on us: abort so they fail fast.
  transport_->abort(abort_kind_of(error), message_of(error));
  if (first) on_group_failure(error);
  for (auto& f : in_flight_) end_p2p(f, about_p2p(f.what(*this), error));
  in_flight_.clear();
  sync_in_flight_count();
}

// Note [Timeout census]: a timeout names the peer this rank waited for, which may itself be
// waiting on the rank that never came. So every rank whose operation failed by a timeout
// (its own, or a peer's ABORT) reports in through the store, waits briefly for the others,
// and names the ranks that never reported: those never reached the operation, or are
// stopped or stuck in it. A group fails once, so there is one census per group, and each
// rank reports the sequence number of the operation it was in: ranks may be at different
// ones (an algorithm lets some finish a collective while others still wait in it, and those
// go on to the next call), so a rank that reported from a later operation had passed this
// one, and one that reported from an earlier operation was still there. A composed operation
// (the hierarchy's) takes it in its own group, over every rank of every host, not in the
// groups that run its steps (Comm::set_serves_steps): there a host's healthy leader, failed
// by the rank it waited for on its host, would be the rank the other hosts never heard from.
//
// It has its own deadlines, store calls included (Note [Store deadlines]): a stopped store host
// must not hold the timeout's error for the store's own timeout. The census waits 1.5 s for
// the others; a store call, answered in microseconds by a working store, gets 0.5 s (not
// less: a client-side timeout costs the connection, reopened at the next call).
//
// Note [Falling behind]: a rank stopped (SIGSTOP, a debugger, a starved VM) past the timeout
// comes back to peers that gave up on it: their ABORTs, or the next call finding them gone.
// Its own view would blame them (they are "at an earlier operation", or sent it nothing). So
// it looks first: if every other rank had reported in before it, and either its own deadline
// had passed a good while before it noticed (it was stopped inside the call) or every other
// rank had given up on it (failed in an earlier operation, which it then completed from what
// they had already written to shared memory; or in this one after waiting about the timeout
// while it had hardly waited: it was stopped before the call), the census says that this
// rank fell behind, and blames no peer.
std::string Comm::census(uint64_t seq) {
  const Deadline until(Millis(1500));
  const Millis call(500);
  constexpr Millis kFellBehind(1000);  // well past a poll's nap: this rank was not running
  try {
    const std::string base = "census/";
    // "seq:ms": the operation this rank was in and how long it had waited there. A rank that
    // came to the operation only after the others gave up (late by about the timeout) joins
    // the census too, but had waited almost nothing: it is named as late.
    const int64_t span = deadline_.timeout().count();
    const int left = deadline_.poll_ms();
    const int64_t waited = left < 0 ? 0 : std::max<int64_t>(0, span - left);
    const std::string mine = str_cat(seq, ":", waited);
    // Note [Falling behind]: before reporting, look whether every other rank reported first.
    std::vector<std::string> others;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) others.push_back(base + std::to_string(r));
    const bool others_first = store_->check(others, call);
    const int64_t overdue =
        deadline_.never() ? 0
                          : std::chrono::duration_cast<Millis>(Clock::now() - deadline_.at()).count();
    store_->set(base + std::to_string(rank_), store::Bytes(mine.begin(), mine.end()), call);
    std::vector<int> silent;
    for (;;) {
      silent.clear();
      for (int r = 0; r < size_; ++r)
        if (!store_->check({base + std::to_string(r)}, call)) silent.push_back(r);
      if (silent.empty() || until.expired()) break;
      std::this_thread::sleep_for(Millis(20));
    }
    std::string never, behind, late;
    bool all_ahead = true;  // every other rank had given up on this rank (below)
    for (int r : silent) never += str_cat(never.empty() ? "" : ", ", global_rank(r));
    for (int r = 0; r < size_; ++r) {
      if (std::find(silent.begin(), silent.end(), r) != silent.end()) continue;
      store::Bytes b = store_->get(base + std::to_string(r), call);
      const std::string v(b.begin(), b.end());
      const size_t colon = v.find(':');
      uint64_t theirs = std::stoull(v.substr(0, colon));
      const int64_t their_wait = colon == std::string::npos ? 0 : std::stoll(v.substr(colon + 1));
      // Ahead of this rank: failed in an earlier operation, or in this one after waiting
      // for it while this rank had not waited.
      if (r != rank_ && !(theirs < seq || (theirs == seq && their_wait >= span / 2 &&
                                           waited < span / 2)))
        all_ahead = false;
      if (theirs < seq)
        behind += str_cat(behind.empty() ? "" : ", ", global_rank(r), " (at seq ", theirs, ")");
      else if (theirs == seq && r != rank_ && waited >= span / 2 && their_wait < span / 2)
        late += str_cat(late.empty() ? "" : ", ", global_rank(r), " (it had waited ",
                        their_wait, " ms)");
    }
    const int me = global_rank(rank_);
    if (others_first && (overdue >= kFellBehind.count() || all_ahead))
      return str_cat("; every other rank had reported its failure of this group before rank ", me,
                     " did", overdue > 0 ? str_cat(", and rank ", me, "'s deadline had passed ",
                                                   overdue, " ms before it noticed") : "",
                     ": rank ", me, " fell behind (it was stopped, starved or busy in other code "
                     "past the timeout) and its peers timed out waiting for it; they are not at "
                     "fault");
    std::string out;
    if (!never.empty())
      out += str_cat("; rank(s) ", never, " never reported in: they never reached this "
                     "operation, or are stopped or stuck (every other rank reported in)");
    if (!behind.empty())
      out += str_cat("; rank(s) ", behind, " were still in an earlier operation of this group");
    if (!late.empty())
      out += str_cat("; rank(s) ", late, " reached this operation only as it failed: they "
                     "came late (after the others had waited ", waited, " ms)");
    return out;
  } catch (const std::exception& e) {
    return str_cat("; no census: ", e.what());  // the store's host is stopped or gone too
  }
}

namespace {
uint64_t nanoseconds_since(Clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}
}  // namespace

void Comm::log_op(const transport::Envelope& env, Clock::time_point t0,
                  std::exception_ptr error) {
  log_line(describe_op(env.op), env.seq, *algorithm_ ? algorithm_ : (shm_ ? "shm" : "tcp"),
           env.op.count * dtype_size(static_cast<DType>(env.op.dtype)), t0, error);
}

void Comm::log_line(const std::string& what, uint64_t seq, const char* route, uint64_t bytes,
                    Clock::time_point t0, std::exception_ptr error) {
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  std::fprintf(stderr, "meshcoll[rank %d/%d] %s seq=%llu algo=%s bytes=%llu time=%lldus%s%s\n",
               rank_, size_, what.c_str(), static_cast<unsigned long long>(seq), route,
               static_cast<unsigned long long>(bytes), static_cast<long long>(us),
               error ? " FAILED: " : "", error ? message_of(error).c_str() : "");
}

void Comm::end_p2p(const InFlight& f, std::exception_ptr error) {
  ledger_->p2p_state(f.record, error ? comm::CallState::kFailed : comm::CallState::kDone);
  if (!error) ledger_->add_totals(f.desc, nanoseconds_since(f.started));
  if (opts_.debug) {
    // "send to rank 1 (tag 0) on rank 0" (p2p_what ends in ": " for an error's text).
    std::string what = p2p_what(f.is_send, f.peer, f.tag);
    what.resize(what.size() - 2);
    log_line(str_cat(what, " ", describe_op(f.desc)), f.record, "p2p",
             f.desc.count * dtype_size(static_cast<DType>(f.desc.dtype)), f.started, error);
  }
  if (f.work) f.work->finish(error);
}

void Comm::run_item(Item& item) {
  if (item.peer < 0) {
    item.work->finish(execute(item.env, item.timeout, item.index, OpRef(item.run), true));
    return;
  }
  // A posted transfer completes its Work later (Note [Point-to-point in flight]).
  bool posted = false;
  auto post = [&](Comm&) {
    start_p2p(item);
    posted = true;
  };
  const auto t0 = Clock::now();
  std::exception_ptr error = execute(item.env, item.timeout, item.index, OpRef(post), false);
  if (!posted)
    end_p2p({nullptr, item.work, Deadline(item.timeout), item.peer, item.env.tag, item.is_send,
             item.record, item.env.op, t0}, error);
}

std::exception_ptr Comm::execute(const transport::Envelope& env, Millis timeout, uint64_t index,
                                 const OpRef& run, bool collective) {
  auto ctx = [&] {  // formatted only on failure
    const int me = global_rank(rank_);
    return str_cat(describe_op(env.op), " [seq ", env.seq, "] on rank ", me,
                   me == rank_ ? "" : str_cat(" (group rank ", rank_, ")"), " of ", size_, ": ");
  };
  if (failure_->failed()) {
    // Note [Failure types]: the failure's own type until it reached the caller, or for an
    // operation already queued when the group failed; Aborted afterwards.
    std::string msg = str_cat(ctx(), "not run: the group failed earlier (",
                              message_of(failure_->error()), "); destroy it and create a new one");
    if (collective) ledger_->set_state(env.seq, comm::CallState::kFailed);
    return failure_->for_call(msg, index < failed_before_);
  }
  current_ = env;
  const auto t0 = Clock::now();  // Note [Call totals]: every call is timed
  deadline_ = Deadline(timeout, t0);
  try {
    if (!collective) {
      run(*this);
      return nullptr;
    }
    algorithm_ = "";
    used_tcp_ = false;
    composed_ = false;
    step_timeout_.clear();
    // A relayed failure (fail()) is not compared with the peers' calls: it fails the group
    // with its own message, whatever they run at its sequence number.
    if (env.op.coll != static_cast<uint8_t>(CollKind::kFail)) transport_->begin_collective(current_);
    run(*this);
    // After an operation that used TCP, collect an ABORT or a stray frame now (a send-only
    // operation would otherwise learn of a failed peer only at its next wait), and progress
    // posted transfers. A shared-memory operation heard from every peer in its last round,
    // and its waits poll the links: a syscall per call saved.
    if (size_ > 1 && (used_tcp_ || !in_flight_.empty())) transport_->poll_once();
    ledger_->set_state(env.seq, comm::CallState::kDone, route());
    ledger_->add_totals(env.op, nanoseconds_since(t0));
    if (opts_.debug) log_op(env, t0, nullptr);
    return nullptr;
  } catch (...) {
    std::exception_ptr error =
        same_type(std::current_exception(), ctx() + message_of(std::current_exception()));
    if (abort_kind_of(error) == transport::AbortKind::kTimeout && !serves_steps_) {
      // Tell the peers first (they then join the census at once), then take it.
      transport_->abort(transport::AbortKind::kTimeout, message_of(error));
      std::string named = census(env.seq);
      // Note [Blame in a composed call's timeout]: the step's own wait, where the census
      // named nobody (every rank reported, none behind: a rank came late to a step but
      // finished the call) or could not be taken.
      if (!step_timeout_.empty() && (named.empty() || named.rfind("; no census", 0) == 0))
        named += str_cat("; the census named no rank; in the step, ", step_timeout_);
      error = same_type(error, str_cat(message_of(error), named, ". Rank ", global_rank(rank_),
                                       "'s last calls on this group: ", ledger_->summary(4)));
    }
    if (collective) ledger_->set_state(env.seq, comm::CallState::kFailed);
    if (opts_.debug) log_op(env, t0, error);  // the failed one is what a hang diagnosis needs
    fail_group(error);
    return error;
  }
}

}  // namespace meshcoll::cpu
