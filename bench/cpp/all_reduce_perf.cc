// all_reduce_perf: nccl-tests-style table for the CPU backend, ranks as forked processes.
//   all_reduce_perf -n 4 -b 8 -e 16M -f 2 -i 20 -w 5 -c 1 [-a ring|tree|...] [-t auto|shm|tcp] [-j out.jsonl]
// Same columns as meshcoll-bench: size count type redop time algbw busbw #wrong.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/algo/collectives.h"
#include "cpu/cpu_backend.h"
#include "store/tcp_store.h"
#include "bench_config.h"
#include "fork_ranks.h"

using namespace meshcoll;

namespace {

struct Options {
  int ranks = 4;
  size_t min_bytes = 8, max_bytes = 16 << 20;
  double factor = 2;
  int iters = 20, warmup = 5;
  bool check = true;
  std::string algo = "auto", transport = "auto", json;
};

size_t parse_size(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end && *end ? *end : ' ') {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<size_t>(v);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "-n") o.ranks = std::atoi(v);
    else if (k == "-b") o.min_bytes = parse_size(v);
    else if (k == "-e") o.max_bytes = parse_size(v);
    else if (k == "-f") o.factor = std::atof(v);
    else if (k == "-i") o.iters = std::atoi(v);
    else if (k == "-w") o.warmup = std::atoi(v);
    else if (k == "-c") o.check = std::atoi(v) != 0;
    else if (k == "-a") o.algo = v;
    else if (k == "-t") o.transport = v;
    else if (k == "-j") o.json = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

// Runs one synchronous in-place all_reduce of `count` floats through the backend contract.
void run_all_reduce(cpu::CpuBackend& b, float* buf, size_t count, Algorithm alg,
                    RedOp op = RedOp::kSum) {
  comm::ArrayView v;
  v.data = buf;
  v.count = count;
  v.dtype = DType::kFloat32;
  comm::CallOptions o;
  o.tuning.algorithm = static_cast<uint8_t>(alg);
  b.all_reduce(v, v, op, o);
}

int rank_main(int rank, int port, const Options& o) {
  auto store = std::make_shared<store::TcpStore>("127.0.0.1", port, rank == 0, Millis(60000), "");
  cpu::CommOptions copts;
  copts.timeout = Millis(60000);
  copts.bind_host = "127.0.0.1";
  copts.transport = o.transport;
  auto prefixed = std::make_shared<store::PrefixStore>("bench", store);
  cpu::CpuBackend c(prefixed, rank, o.ranks, copts, 42);
  Algorithm alg;
  if (!algorithm_from_name(o.algo, &alg)) {
    std::fprintf(stderr, "unknown algorithm %s\n", o.algo.c_str());
    return 2;
  }
  FILE* json = rank == 0 && !o.json.empty() ? std::fopen(o.json.c_str(), "w") : nullptr;
  const double bus = 2.0 * (o.ranks - 1) / o.ranks;  // all-reduce busbw factor
  if (rank == 0) {
    std::printf("# meshcoll all_reduce_perf  transport=%s  ranks=%d  iters=%d warmup=%d  algo=%s\n",
                c.transport().c_str(), o.ranks, o.iters, o.warmup, o.algo.c_str());
    std::printf("#%12s %10s %6s %6s %10s %8s %8s %7s\n", "size", "count", "type", "redop", "time",
                "algbw", "busbw", "#wrong");
    std::printf("#%12s %10s %6s %6s %10s %8s %8s %7s\n", "(B)", "(elems)", "", "", "(us)", "(GB/s)",
                "(GB/s)", "");
  }
  double bw_sum = 0;
  int bw_n = 0;
  std::vector<float> buf, timing(1);
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes;
       bytes = std::max(bytes + 4, static_cast<size_t>(bytes * o.factor))) {
    size_t count = std::max<size_t>(1, bytes / 4);
    buf.assign(count, 0);
    for (int i = 0; i < o.warmup; ++i) run_all_reduce(c, buf.data(), count, alg);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) run_all_reduce(c, buf.data(), count, alg);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
                o.iters;
    timing[0] = static_cast<float>(us);  // the slowest rank's time is the collective's
    run_all_reduce(c, timing.data(), 1, Algorithm::kAuto, RedOp::kMax);
    us = timing[0];
    size_t wrong = 0;
    if (o.check) {  // rank r contributes (r+1) * (i % 7 + 1): small integers, exact in f32
      for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>((rank + 1) * (i % 7 + 1));
      run_all_reduce(c, buf.data(), count, alg);
      const float tri = o.ranks * (o.ranks + 1) / 2.0f;
      for (size_t i = 0; i < count; ++i) wrong += buf[i] != tri * (i % 7 + 1);
    }
    double algbw = count * 4 / us / 1e3;
    if (rank == 0) {
      std::printf(" %12zu %10zu %6s %6s %10.2f %8.3f %8.3f %7zu\n", count * 4, count, "float", "sum",
                  us, algbw, algbw * bus, wrong);
      if (json)
        std::fprintf(json,
                     "{\"op\": \"all_reduce\", \"size\": %zu, \"count\": %zu, \"type\": \"float\", "
                     "\"redop\": \"sum\", \"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, "
                     "\"wrong\": %zu, \"ranks\": %d}\n",
                     count * 4, count, us, algbw, algbw * bus, wrong, o.ranks);
    }
    bw_sum += algbw * bus;
    ++bw_n;
  }
  if (rank == 0) std::printf("# Avg bus bandwidth : %.3f\n", bw_n ? bw_sum / bw_n : 0.0);
  if (json) std::fclose(json);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::config_from_env("all_reduce_perf");
  Options o = parse(argc, argv);
  return bench::fork_ranks(o.ranks, "all_reduce_perf",
                          [&](int r, int port) { return rank_main(r, port, o); });
}
