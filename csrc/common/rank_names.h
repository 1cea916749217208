// How messages name a group's ranks: by their global rank (the rank in the job), which is
// what a user sees in launcher output and logs. Inside a group every index is the group rank;
// only the text of an error goes through this. A group built without the list (a C++ test
// of the core) names group ranks.
#pragma once

#include <vector>

namespace meshcoll {

class RankNames {
 public:
  RankNames() = default;
  explicit RankNames(std::vector<int> global) : global_(std::move(global)) {}
  int operator()(int group_rank) const {
    return group_rank >= 0 && group_rank < static_cast<int>(global_.size()) ? global_[group_rank]
                                                                            : group_rank;
  }

 private:
  std::vector<int> global_;
};

}  // namespace meshcoll
