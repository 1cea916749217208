// Ranks as forked processes, for the C++ perf tools: a free loopback port for the rank-0
// store, one child per rank, and the worst exit status.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

namespace meshcoll::bench {

// A port nobody listens on now (the kernel picks it); rank 0 binds the store to it.
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Forks `n` children running rank_main(rank, port) -> exit status; returns the largest
// status (1 for a child killed by a signal or one that threw).
template <class RankMain>
int fork_ranks(int n, const char* tool, RankMain rank_main) {
  const int port = free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = rank_main(r, port);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s rank %d: %s\n", tool, r, e.what());
      }
      std::fflush(stdout);
      _exit(rc);
    }
    kids.push_back(pid);
  }
  int worst = 0;
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    worst = std::max(worst, WIFEXITED(st) ? WEXITSTATUS(st) : 1);
  }
  return worst;
}

}  // namespace meshcoll::bench
