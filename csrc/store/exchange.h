// One step of a group's rendezvous: every rank publishes a value and reads every rank's.
#pragma once

#include <functional>
#include <string>
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

}  // namespace meshcoll::store
