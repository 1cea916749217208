// The MPI shim's functions (mpi/shim.c), loaded at run time.
//
// Note [Loading MPI]
// A wheel cannot link an MPI: Open MPI, MPICH, Intel MPI and Cray MPICH differ in ABI
// (MPI_Comm is a pointer in one, an int in another; the constants differ), and the one a
// cluster's network needs is the site's own. So the wheel carries the source of a small C shim
// (shim.c, embedded as text at build time, as the direct kernels' CUDA source is) that wraps
// the few MPI calls the backend makes behind a C ABI of meshcoll's own: opaque handles and
// meshcoll's dtype and op codes. On first use python/meshcoll/mpi.py compiles it with the
// site's mpicc ($MPICC, else mpicc on PATH) and caches the library under the user's cache
// directory, keyed by the shim's source and by what the wrapper says it runs (`mpicc -show`
// or `--showme`: the compiler, include and library paths), so a changed MPI module or
// wrapper gets its own build. load() then dlopens it (RTLD_GLOBAL: Open MPI's plugins look up
// libmpi's symbols) and MPI comes up.
// Of the ways the issue lists, this one needs the least of a site: any MPI with an mpicc
// wrapper and a C compiler, which every MPI installation has; nothing at wheel build time.
// The MPI 5 standard ABI would need an MPI that offers it (few do yet); mpi4py's C API would
// need mpi4py built against the site's MPI, which is the same compile moved elsewhere.
//
// Calls into MPI are serialized by mpi_lock(): MPI is asked for MPI_THREAD_MULTIPLE, but an
// MPI that gives less (serialized) is still safe, and the calls are short (nonblocking
// starts and MPI_Test). Where MPI did grant MPI_THREAD_MULTIPLE, the calls of every
// operation (its starts and its progress loop's tests: MpiLock) take no lock: a lock per
// test would slow the loop that waits for a small call, and any thread may call MPI then.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>

namespace meshcoll::mpi {

// The shim's ABI (MC_SHIM_ABI in shim.c): a cached library of another one is rebuilt.
inline constexpr int kShimAbi = 2;

struct MpiApi {
  using ReduceFn = void (*)(int dtype, int op, void* dst, const void* src, size_t n);
  std::string path;     // the shim library loaded
  std::string version;  // MPI_Get_library_version's first line
  int rank = 0, size = 1;
  int thread_level = 0;
  bool multiple = false;  // thread_level is MPI_THREAD_MULTIPLE: MpiLock takes no lock
  bool ours = false;  // this process called MPI_Init (and so finalizes)

  int (*abi)();
  int (*thread_multiple)();  // MPI_THREAD_MULTIPLE's value
  int (*init)(ReduceFn, int*, int*, int*, int*);
  int (*finalize)();
  void (*abort)(int);
  int (*error_string)(int, char*, int);
  int (*library_version)(char*, int);
  int (*comm_world)(void**);
  int (*comm_split)(void*, int, int, void**);
  int (*comm_info)(void*, int*, int*);
  int (*comm_free)(void*);
  int (*bcast_bytes)(void*, int, int, void*);
  int (*iallreduce)(const void*, void*, int, int, int, void*, void**);
  int (*ireduce)(const void*, void*, int, int, int, int, void*, void**);
  int (*ibcast)(void*, int, int, int, void*, void**);
  int (*iallgatherv)(const void*, int, void*, const int*, const int*, int, int, void*, void**);
  int (*ireduce_scatter)(const void*, void*, const int*, int, int, void*, void**);
  int (*ialltoallv)(const void*, const int*, const int*, void*, const int*, const int*, int,
                    void*, void**);
  int (*igatherv)(const void*, int, void*, const int*, const int*, int, int, void*, void**);
  int (*iscatterv)(const void*, const int*, const int*, void*, int, int, int, void*, void**);
  int (*ibarrier)(void*, void**);
  int (*isend)(const void*, int, int, int, int, void*, void**);
  int (*irecv)(void*, int, int, int, int, void*, void**);
  // (send, scount, to, recv, rcount, from, dtype, tag, comm, req): one step of meshcoll's own
  // collectives, on the communicator's private duplicate; to or from < 0: that side is none.
  int (*isendrecv)(const void*, int, int, void*, int, int, int, int, void*, void**);
  int (*test)(void*, int*);

  // "MPI error 15: MPI_ERR_TRUNCATE: message truncated" (for messages).
  std::string error_text(int rc) const;
};

// shim.c's text, embedded at build time: what python/meshcoll/mpi.py compiles.
const char* shim_source();
// Loads the shim at `path` and initializes MPI (unless the process already did, as mpi4py
// does), once per process; later calls return the same table (a different path is an
// error). Throws meshcoll::Error saying what failed.
MpiApi& load(const std::string& path);
// The loaded table; throws if load() was not called.
MpiApi& api();
bool loaded();
// Held around every call into MPI.
std::mutex& mpi_lock();
// Held around an operation's calls into MPI: mpi_lock(), unless MPI is thread-safe.
class MpiLock {
 public:
  MpiLock() : lock_(mpi_lock(), std::defer_lock) {
    if (!api().multiple) lock_.lock();
  }

 private:
  std::unique_lock<std::mutex> lock_;
};
// Operations started in MPI and not yet completed, over every group of the process.
std::atomic<int>& inside_mpi();
// At exit: MPI_Abort if an operation is still inside MPI (Note [MPI failure model] in
// mpi_backend.h), else MPI_Finalize if this process initialized MPI.
void finalize();
// Ends the job: MPI_Abort on the world communicator (mpirun/srun then end every rank).
void abort_job();

}  // namespace meshcoll::mpi
