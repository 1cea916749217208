// nccl_perf: nccl-tests-style tables for NCCL itself, through meshcoll's runtime-loaded NCCL and
// CUDA driver (csrc/nccl/nccl_api.h: no CUDA headers or toolkit needed to build). One forked
// process per GPU; rank 0's ncclUniqueId travels through meshcoll's TCP store.
//
//   nccl_perf [-N ranks] [-p all_reduce,all_gather,reduce_scatter,broadcast|all] [-b 8] [-e 128M]
//             [-f 2] [-n 20] [-w 5] [-c 1] [-d float] [-o sum] [-r 0] [-j out.jsonl] [-s 0]
//
// Options as meshcoll-bench: -N ranks (default: every visible GPU), -n timed iterations, -w
// warm-up iterations, -c check, -b/-e/-f the size sweep (K, M, G: powers of 1024), -d dtype
// (float, double, half, bfloat16, int8, uint8, int32, int64), -o reduction (sum, prod, min, max,
// avg), -r root of broadcast, -j one JSON record per row, -s 1 time each call with a
// synchronize after it (the median; for per-call latency). Columns as nccl-tests (out-of-place):
// size count type redop time algbw busbw #wrong; time is the slowest rank's mean per call over
// -n back-to-back calls on one stream, host clock, after a barrier and up to a stream
// synchronize. Check (-c 1): one call on the patterns meshcoll-bench uses (small integers, exact
// in every dtype; avg of floats within (n+1) ulps), compared on the host. Exit status 1 when an
// element was wrong, 2 when NCCL or CUDA is not available.
//
// Processes are forked before anything touches CUDA: the parent learns whether NCCL and a GPU
// are there from a forked probe, so it never initialises the driver itself.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "nccl/nccl_api.h"
#include "reduce/half.h"
#include "store/tcp_store.h"
#include "bench_config.h"
#include "fork_ranks.h"

using namespace meshcoll;
namespace abi = meshcoll::nccl::abi;

namespace {

// ---- options --------------------------------------------------------------------------------

const char* const kOps[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};

struct Options {
  int ranks = 0;  // 0: every visible GPU
  std::vector<std::string> ops = {"all_reduce"};
  size_t min_bytes = 8, max_bytes = 128 << 20;
  size_t factor = 2;
  int iters = 20, warmup = 5;
  bool check = true;
  bool sync_each = false;  // -s 1: host-time each call up to its synchronize; report the median
  std::string dtype = "float", redop = "sum", json;
  int root = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "nccl_perf: %s\nusage: nccl_perf [-N ranks] [-p op[,op...]|all] [-b minbytes] "
               "[-e maxbytes] [-f factor] [-n iters] [-w warmup] [-c 0|1] [-s 0|1] [-d dtype] [-o redop] "
               "[-r root] [-j file.jsonl]\n",
               why.c_str());
  std::exit(2);
}

size_t parse_size(const std::string& s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) usage("not a size: " + s);
  switch (*end) {
    case 'K': case 'k': v <<= 10; break;
    case 'M': case 'm': v <<= 20; break;
    case 'G': case 'g': v <<= 30; break;
    case '\0': break;
    default: usage("not a size: " + s);
  }
  return static_cast<size_t>(v);
}

std::vector<std::string> split_ops(const std::string& s) {
  if (s == "all") return std::vector<std::string>(std::begin(kOps), std::end(kOps));
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    std::string op = s.substr(a, b - a);
    if (std::find(std::begin(kOps), std::end(kOps), op) == std::end(kOps))
      usage("unknown op '" + op + "'; use all_reduce, all_gather, reduce_scatter, broadcast or all");
    out.push_back(op);
    a = b + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage("time NCCL collectives");
    if (i + 1 >= argc) usage("option " + k + " needs a value");
    const std::string v = argv[i + 1];
    if (k == "-N") o.ranks = std::atoi(v.c_str());
    else if (k == "-p") o.ops = split_ops(v);
    else if (k == "-b") o.min_bytes = parse_size(v);
    else if (k == "-e") o.max_bytes = parse_size(v);
    else if (k == "-f") o.factor = parse_size(v);
    else if (k == "-n") o.iters = std::atoi(v.c_str());
    else if (k == "-w") o.warmup = std::atoi(v.c_str());
    else if (k == "-c") o.check = std::atoi(v.c_str()) != 0;
    else if (k == "-d") o.dtype = v;
    else if (k == "-o") o.redop = v;
    else if (k == "-r") o.root = std::atoi(v.c_str());
    else if (k == "-j") o.json = v;
    else if (k == "-s") o.sync_each = std::atoi(v.c_str()) != 0;
    else usage("unknown option " + k);
  }
  if (o.min_bytes == 0 || o.min_bytes > o.max_bytes) usage("need 0 < -b <= -e");
  if (o.factor < 2) usage("-f must be >= 2");
  if (o.iters < 1 || o.warmup < 0 || o.ranks < 0) usage("need -n >= 1, -w >= 0, -N >= 0");
  return o;
}

// ---- dtypes: host <-> device bytes ----------------------------------------------------------

struct Type {
  const char* name;  // as nccl-tests prints it
  abi::ncclDataType_t nccl;
  size_t size;
  bool integer;
  double eps;  // one ulp at 1.0 (floats)
};

const Type kTypes[] = {
    {"float", abi::ncclFloat32, 4, false, 0x1p-23}, {"double", abi::ncclFloat64, 8, false, 0x1p-52},
    {"half", abi::ncclFloat16, 2, false, 0x1p-10},  {"bfloat16", abi::ncclBfloat16, 2, false, 0x1p-7},
    {"int8", abi::ncclInt8, 1, true, 0},            {"uint8", abi::ncclUint8, 1, true, 0},
    {"int32", abi::ncclInt32, 4, true, 0},          {"int64", abi::ncclInt64, 8, true, 0},
};

const Type& find_type(const std::string& name) {
  for (const auto& t : kTypes)
    if (name == t.name) return t;
  usage("unknown dtype '" + name + "'; use float, double, half, bfloat16, int8, uint8, int32 or int64");
}

abi::ncclRedOp_t find_redop(const std::string& name) {
  if (name == "sum") return abi::ncclSum;
  if (name == "prod") return abi::ncclProd;
  if (name == "min") return abi::ncclMin;
  if (name == "max") return abi::ncclMax;
  if (name == "avg") return abi::ncclAvg;
  usage("unknown reduction '" + name + "'; use sum, prod, min, max or avg");
}

template <class T>
void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <class T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void store_value(const Type& t, uint8_t* p, double v) {
  switch (t.nccl) {
    case abi::ncclFloat32: put(p, static_cast<float>(v)); break;
    case abi::ncclFloat64: put(p, v); break;
    case abi::ncclFloat16: put(p, reduce::float_to_half(static_cast<float>(v))); break;
    case abi::ncclBfloat16: put(p, reduce::float_to_bfloat16(static_cast<float>(v))); break;
    case abi::ncclInt8: put(p, static_cast<int8_t>(v)); break;
    case abi::ncclUint8: put(p, static_cast<uint8_t>(v)); break;
    case abi::ncclInt32: put(p, static_cast<int32_t>(v)); break;
    default: put(p, static_cast<int64_t>(v)); break;
  }
}

double load_value(const Type& t, const uint8_t* p) {
  switch (t.nccl) {
    case abi::ncclFloat32: return get<float>(p);
    case abi::ncclFloat64: return get<double>(p);
    case abi::ncclFloat16: return reduce::half_to_float(get<uint16_t>(p));
    case abi::ncclBfloat16: return reduce::bfloat16_to_float(get<uint16_t>(p));
    case abi::ncclInt8: return get<int8_t>(p);
    case abi::ncclUint8: return get<uint8_t>(p);
    case abi::ncclInt32: return get<int32_t>(p);
    default: return static_cast<double>(get<int64_t>(p));
  }
}

// ---- patterns (meshcoll-bench's, python/meshcoll/bench.py) ------------------------------------
// Reductions: v_r(i) = b(i) + n*[i mod n == r], b(i) = (3i+1) mod 5; prod: 2 on one rank per
// element. Data movement: m_r(i) = (i + 7r) mod 13. Every value and result is a small integer.

double b_of(size_t i) { return static_cast<double>((3 * i + 1) % 5); }

double reduce_input(int r, int n, size_t i, abi::ncclRedOp_t op) {
  if (op == abi::ncclProd) return i % (n + 1) == static_cast<size_t>(r) ? 2 : 1;
  return b_of(i) + (i % n == static_cast<size_t>(r) ? n : 0);
}

double reduce_expected(int n, size_t i, abi::ncclRedOp_t op) {
  switch (op) {
    case abi::ncclProd: return i % (n + 1) < static_cast<size_t>(n) ? 2 : 1;
    case abi::ncclSum: return n * b_of(i) + n;
    case abi::ncclAvg: return b_of(i) + 1;
    case abi::ncclMax: return b_of(i) + n;
    default: return b_of(i) + (n == 1 ? n : 0);  // min
  }
}

double move_input(int r, size_t i) { return static_cast<double>((i + 7 * static_cast<size_t>(r)) % 13); }

constexpr double kSentinel = 100;  // written into outputs before a check; never expected

// ---- one rank -------------------------------------------------------------------------------

struct Rank {
  const nccl::NcclApi& nc;
  const nccl::CudaApi& cu;
  int rank, n;
  abi::ncclComm_t comm = nullptr;
  abi::CUcontext ctx = nullptr;
  abi::CUdevice dev = 0;
  abi::CUstream stream = nullptr;
  abi::CUevent done = nullptr;
  abi::CUdeviceptr send = 0, recv = 0, scratch = 0;

  void check(abi::ncclResult_t r, const char* what) {
    if (r != abi::ncclSuccess) throw Error(str_cat(what, " on rank ", rank, ": ", nc.error_text(r, comm)));
  }
  void sync() {  // host waits for everything enqueued on the stream
    cu.check(cu.event_record(done, stream), "cuEventRecord");
    cu.check(cu.event_synchronize(done), "cuEventSynchronize");
  }
  void upload(abi::CUdeviceptr dst, const std::vector<uint8_t>& src) {
    if (src.empty()) return;
    cu.check(cu.memcpy_htod_async(dst, src.data(), src.size(), stream), "cuMemcpyHtoDAsync");
    sync();
  }
  void download(std::vector<uint8_t>* dst, abi::CUdeviceptr src) {
    if (dst->empty()) return;
    cu.check(cu.memcpy_dtoh_async(dst->data(), src, dst->size(), stream), "cuMemcpyDtoHAsync");
    sync();
  }
  // One value per rank through NCCL itself: the max (times) or the sum (wrong counts).
  double all_reduce_host(double v, abi::ncclRedOp_t op) {
    std::vector<uint8_t> b(8);
    put(b.data(), v);
    upload(scratch, b);
    check(nc.all_reduce(reinterpret_cast<void*>(scratch), reinterpret_cast<void*>(scratch), 1,
                        abi::ncclFloat64, op, comm, stream),
          "ncclAllReduce");
    download(&b, scratch);
    return get<double>(b.data());
  }
};

struct Shape {
  size_t count;      // elements of the larger buffer (what `size` measures)
  size_t in, out;    // elements of the send and receive buffers
};

Shape shape_of(const std::string& op, size_t bytes, size_t es, int n) {
  size_t count = std::max<size_t>(bytes / es, 1);
  if (op == "all_gather" || op == "reduce_scatter") count = std::max<size_t>(count / n, 1) * n;
  if (op == "all_gather") return {count, count / n, count};
  if (op == "reduce_scatter") return {count, count, count / n};
  return {count, count, count};
}

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

void launch(Rank& R, const std::string& op, const Shape& s, const Type& t, abi::ncclRedOp_t red,
            int root) {
  void* in = reinterpret_cast<void*>(R.send);
  void* out = reinterpret_cast<void*>(R.recv);
  if (op == "all_reduce")
    R.check(R.nc.all_reduce(in, out, s.in, t.nccl, red, R.comm, R.stream), "ncclAllReduce");
  else if (op == "all_gather")
    R.check(R.nc.all_gather(in, out, s.in, t.nccl, R.comm, R.stream), "ncclAllGather");
  else if (op == "reduce_scatter")
    R.check(R.nc.reduce_scatter(in, out, s.out, t.nccl, red, R.comm, R.stream), "ncclReduceScatter");
  else
    R.check(R.nc.broadcast(in, out, s.in, t.nccl, root, R.comm, R.stream), "ncclBroadcast");
}

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// Mean host time per call over -n back-to-back calls, up to a synchronize after the last.
template <class Call>
double back_to_back_us(Rank& R, const Options& o, Call&& call) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) call();
  R.sync();
  return us_since(t0) / o.iters;
}

// Median host time of one call followed by a synchronize (-s 1): the per-call cost when the
// result is needed at once, as compare_nccl.py times torch and meshcoll.
template <class Call>
double synced_median_us(Rank& R, const Options& o, Call&& call) {
  std::vector<double> ts(o.iters);
  for (double& t : ts) {
    auto t0 = std::chrono::steady_clock::now();
    call();
    R.sync();
    t = us_since(t0);
  }
  std::nth_element(ts.begin(), ts.begin() + ts.size() / 2, ts.end());
  return ts[ts.size() / 2];
}

// Fills the inputs, runs once, and counts this rank's wrong elements.
size_t verify(Rank& R, const std::string& op, const Shape& s, const Type& t, abi::ncclRedOp_t red,
              int root) {
  const int r = R.rank, n = R.n;
  const bool reducing = op == "all_reduce" || op == "reduce_scatter";
  std::vector<uint8_t> in(s.in * t.size), out(s.out * t.size);
  for (size_t i = 0; i < s.in; ++i)
    store_value(t, &in[i * t.size], reducing ? reduce_input(r, n, i, red) : move_input(r, i));
  for (size_t i = 0; i < s.out; ++i) store_value(t, &out[i * t.size], kSentinel);
  R.upload(R.send, in);
  R.upload(R.recv, out);
  launch(R, op, s, t, red, root);
  R.sync();
  R.download(&out, R.recv);
  const bool inexact = red == abi::ncclAvg && reducing && !t.integer;
  size_t wrong = 0;
  for (size_t i = 0; i < s.out; ++i) {
    double want;
    if (op == "all_reduce") want = reduce_expected(n, i, red);
    else if (op == "reduce_scatter") want = reduce_expected(n, r * s.out + i, red);
    else if (op == "all_gather") want = move_input(static_cast<int>(i / s.in), i % s.in);
    else want = move_input(root, i);
    if (t.integer && reducing) {  // integers wrap as the device's do
      uint8_t w[8];
      store_value(t, w, want);
      want = load_value(t, w);
    }
    const double got = load_value(t, &out[i * t.size]);
    const bool ok = inexact ? std::fabs(got - want) <= (n + 1) * t.eps * std::max(1.0, std::fabs(want))
                            : got == want;
    wrong += !ok;
  }
  return wrong;
}

int rank_main(int rank, int port, const Options& o, int n) {
  auto store = std::make_shared<store::TcpStore>("127.0.0.1", port, rank == 0, Millis(120000), "");
  Rank R{nccl::nccl(), nccl::cuda(), rank, n};
  const auto& cu = R.cu;
  const auto& nc = R.nc;
  const Type& t = find_type(o.dtype);
  const abi::ncclRedOp_t red = find_redop(o.redop);
  if (t.nccl == abi::ncclBfloat16 && !nc.has_bf16()) usage("bfloat16 needs NCCL 2.10 or later; loaded " + nc.describe());
  if (red == abi::ncclAvg && !nc.has_avg()) usage("avg needs NCCL 2.10 or later; loaded " + nc.describe());

  cu.check(cu.device_get(&R.dev, rank), "cuDeviceGet");
  cu.check(cu.primary_ctx_retain(&R.ctx, R.dev), "cuDevicePrimaryCtxRetain");
  cu.check(cu.ctx_set_current(R.ctx), "cuCtxSetCurrent");

  abi::ncclUniqueId id;
  if (rank == 0) {
    R.check(nc.get_unique_id(&id), "ncclGetUniqueId");
    store->set("nccl_perf/id", store::Bytes(id.internal, id.internal + sizeof(id.internal)));
  } else {
    store::Bytes b = store->get("nccl_perf/id", Millis(120000));
    if (b.size() != sizeof(id.internal)) throw Error("nccl_perf: bad unique id in the store");
    std::memcpy(id.internal, b.data(), sizeof(id.internal));
  }
  R.check(nc.comm_init_rank(&R.comm, n, id, rank), "ncclCommInitRank");
  cu.check(cu.stream_create(&R.stream, abi::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  cu.check(cu.event_create(&R.done, abi::CU_EVENT_DISABLE_TIMING), "cuEventCreate");

  // Buffers for the largest size (split ops round up to one element per rank).
  const size_t cap = std::max(o.max_bytes, n * t.size) + 64;
  cu.check(cu.mem_alloc(&R.send, cap), "cuMemAlloc");
  cu.check(cu.mem_alloc(&R.recv, cap), "cuMemAlloc");
  cu.check(cu.mem_alloc(&R.scratch, 64), "cuMemAlloc");

  FILE* json = rank == 0 && !o.json.empty() ? std::fopen(o.json.c_str(), "w") : nullptr;
  double total_wrong = 0;
  for (size_t k = 0; k < o.ops.size(); ++k) {
    const std::string& op = o.ops[k];
    const bool reducing = op == "all_reduce" || op == "reduce_scatter";
    if (rank == 0) {
      std::printf("%s# meshcoll nccl_perf  %s  %s  ranks=%d  iters=%d warmup=%d%s\n", k ? "\n" : "",
                  op.c_str(), nc.describe().c_str(), n, o.iters, o.warmup,
                  op == "broadcast" ? str_cat("  root=", o.root).c_str() : "");
      if (o.sync_each)
        std::printf("# time: the slowest rank's median host time of one call followed by a "
                    "stream synchronize, over -n calls\n");
      else
        std::printf("# time: the slowest rank's mean per call over -n back-to-back calls "
                    "(host clock, up to a stream synchronize)\n");
      std::printf("#%11s%10s%9s%7s%9s%8s%8s%8s\n", "size", "count", "type", "redop", "time",
                  "algbw", "busbw", "#wrong");
      std::printf("#%11s%10s%9s%7s%9s%8s%8s%8s\n", "(B)", "(elems)", "", "", "(us)", "(GB/s)",
                  "(GB/s)", "");
      std::fflush(stdout);
    }
    double bw_sum = 0;
    int rows = 0;
    size_t last = 0;
    for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
      const Shape s = shape_of(op, bytes, t.size, n);
      if (s.count == last) continue;  // rounds to the row before
      last = s.count;
      double wrong = -1;
      if (o.check) wrong = R.all_reduce_host(static_cast<double>(verify(R, op, s, t, red, o.root)), abi::ncclSum);
      for (int i = 0; i < o.warmup; ++i) launch(R, op, s, t, red, o.root);
      R.sync();
      R.all_reduce_host(0, abi::ncclSum);  // barrier
      double us = o.sync_each ? synced_median_us(R, o, [&] { launch(R, op, s, t, red, o.root); })
                              : back_to_back_us(R, o, [&] { launch(R, op, s, t, red, o.root); });
      us = R.all_reduce_host(us, abi::ncclMax);
      const size_t size = s.count * t.size;
      const double algbw = size / us / 1e3, busbw = algbw * bus_factor(op, n);
      bw_sum += busbw;
      ++rows;
      if (wrong > 0) total_wrong += wrong;
      if (rank == 0) {
        const std::string w = wrong < 0 ? "N/A" : str_cat(static_cast<long long>(wrong));
        std::printf("%12zu%10zu%9s%7s%9.2f%8.2f%8.2f%8s\n", size, s.count, t.name,
                    reducing ? o.redop.c_str() : "none", us, algbw, busbw, w.c_str());
        std::fflush(stdout);
        if (json)
          std::fprintf(json,
                       "{\"op\": \"%s\", \"size\": %zu, \"count\": %zu, \"type\": \"%s\", "
                       "\"redop\": \"%s\", \"time\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, "
                       "\"wrong\": %s, \"ranks\": %d, \"iters\": %d, \"warmup\": %d, "
                       "\"library\": \"nccl\", \"nccl_version\": %d, \"tool\": \"nccl_perf\"}\n",
                       op.c_str(), size, s.count, t.name, reducing ? o.redop.c_str() : "none", us,
                       algbw, busbw, wrong < 0 ? "null" : w.c_str(), n, o.iters, o.warmup,
                       nc.version);
      }
    }
    if (rank == 0) std::printf("# Avg bus bandwidth : %.4g\n", rows ? bw_sum / rows : 0.0);
  }
  if (rank == 0 && total_wrong > 0) std::printf("# Errors: %.0f wrong elements\n", total_wrong);
  std::fflush(stdout);
  if (json) std::fclose(json);
  R.sync();
  nc.comm_destroy(R.comm);
  cu.mem_free(R.send);
  cu.mem_free(R.recv);
  cu.mem_free(R.scratch);
  cu.event_destroy(R.done);
  cu.stream_destroy(R.stream);
  cu.primary_ctx_release(R.dev);
  return total_wrong > 0 ? 1 : 0;
}

// Whether NCCL and a GPU are there, asked in a forked child: the parent must not initialise
// CUDA before it forks the ranks. Returns the visible GPU count (0: not available, *why says).
int probe(std::string* why) {
  int fds[2];
  if (pipe(fds) != 0) {
    *why = "pipe() failed";
    return 0;
  }
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::string text;
    int n = 0;
    if (nccl::nccl_available(&text)) {
      try {
        n = nccl::cuda_device_count();
      } catch (const std::exception& e) {
        text = e.what();
      }
    }
    std::string msg = str_cat(n, "\n", text);
    ssize_t off = 0;
    while (off < static_cast<ssize_t>(msg.size())) {
      ssize_t w = write(fds[1], msg.data() + off, msg.size() - off);
      if (w <= 0) break;
      off += w;
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string msg;
  char buf[4096];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof(buf))) > 0) msg.append(buf, got);
  close(fds[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || msg.empty()) {
    *why = "the probe process crashed while loading NCCL / the CUDA driver (run with "
           "MESHCOLL_NCCL_TRACE=1 to see how far it got)";
    return 0;
  }
  const size_t nl = msg.find('\n');
  *why = msg.substr(nl + 1);
  return std::atoi(msg.substr(0, nl).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  bench::config_from_env("nccl_perf");
  Options o = parse(argc, argv);
  find_type(o.dtype);
  find_redop(o.redop);
  std::string why;
  const int gpus = probe(&why);
  if (gpus < 1) {
    std::fprintf(stderr, "nccl_perf: NCCL / CUDA is not available here: %s\n", why.c_str());
    return 2;
  }
  const int n = o.ranks ? o.ranks : gpus;
  if (n > gpus) usage(str_cat("-N ", n, " ranks but ", gpus, " GPUs are visible (one rank per GPU)"));
  if (o.root < 0 || o.root >= n) usage(str_cat("-r ", o.root, " is not a rank of ", n));
  return bench::fork_ranks(n, "nccl_perf",
                          [&](int r, int port) { return rank_main(r, port, o, n); });
}
