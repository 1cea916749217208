// One step of a group's rendezvous: every rank publishes a value and reads every rank's.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/deadline.h"
#include "common/rank_names.h"
#include "store/store.h"

namespace meshcoll::store {

// Called every 100 ms or so while waiting, with the ranks not there yet; throws to give up
// (a peer whose connection closed has died: no need to wait for the deadline).
using WaitCheck = std::function<void(const std::vector<int>& missing)>;

// Every rank publishes `mine` under "<step>/<rank>" and gets every rank's value, in rank
// order. TimeoutError at `d` naming (by `names`: global ranks) the ranks that never published. Each store call that
// does not wait for keys gets at least 0.5 s, even at the deadline: a working store answers
// in microseconds, and a client-side timeout leaves a TCP store's connection unusable. Fault
// injection (Config::fault) point: "<step>", right after this rank published.
std::vector<std::string> exchange(Store& store, const std::string& step, int rank, int size,
                                  const std::string& mine, const Deadline& d,
                                  const WaitCheck& check, const RankNames& names = {});

// Note [Shared settings]
// Some settings must be the same on every rank of a group: a different shm_bytes maps a
// peer's shared memory past its end (SIGBUS); a different transport waits for a
// shared-memory setup the others never start; on an NCCL group, a different agreement check
// (MESHCOLL_CHECK) leaves the ranks that check waiting for a side channel the others never
// open, and their calls unpaired. The group's members come first: ranks whose new_group
// lists have the same length can pass the TCP handshake (which checks the group's name and
// size) with one rank standing in for another. The group's setup lists them as (the name
// users set it by, its value, as they write it); every rank publishes its list through the
// store, and rank 0 compares them all and publishes its verdict, which the others wait for
// (O(size) store operations: an NCCL parent agrees on each subgroup it splits off). This
// runs before anything else is set up (a CPU group: once its TCP links are up, so that a
// peer that dies meanwhile is named at once; an NCCL group: before NCCL's init). A
// disagreement is a MismatchError on every rank naming each setting that differs and each
// rank's value; rank 0's own failure (a rank that never came, or died) ends every rank's
// setup with it.
using Settings = std::vector<std::pair<std::string, std::string>>;
void agree_on_settings(Store& store, int rank, int size, const Settings& shared,
                       const Deadline& d, const WaitCheck& check, const RankNames& names = {});

}  // namespace meshcoll::store
