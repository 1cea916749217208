/* The MPI shim: the few MPI calls the MPI backend makes, behind a C ABI of our own that no MPI
 * implementation's headers leak into (Note [Loading MPI] in mpi/mpi_api.h). This file is not
 * compiled with the wheel: it is embedded in it as text, and python/meshcoll/mpi.py compiles
 * it with the site's mpicc on first use and caches the library. Handles are opaque pointers
 * (MPI_Comm and MPI_Request are pointers in Open MPI and ints in MPICH); dtypes and ops are
 * meshcoll's codes (common/dtype.h), mapped here to MPI's. Every function returns 0 or an MPI
 * error code (mc_error_string says what it means). Calls are serialized by the caller. */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MC_SHIM_ABI 2

/* meshcoll's DType codes (common/dtype.h): 0 bool, 1 int8, 2 uint8, 3 int32, 4 int64,
 * 5 float16, 6 bfloat16, 7 float32, 8 float64, 9 float8_e4m3fn, 10 float8_e5m2. */
enum { kNumDTypes = 11, kNumOps = 8 };
/* A reduction of meshcoll's own, for the types MPI has no standard reduction of: dst op= src. */
typedef void (*mc_reduce_fn)(int dtype, int op, void* dst, const void* src, size_t n);

static MPI_Datatype g_types[kNumDTypes];
static int g_user[kNumDTypes]; /* 1: our own type, reduced by g_reduce */
static MPI_Op g_user_ops[kNumOps];
static mc_reduce_fn g_reduce;

/* `coll`: a private duplicate of `comm` for meshcoll's own collectives over point-to-point
 * (mc_isendrecv), whose messages must never match the user's sends and receives on `comm`. */
typedef struct {
  MPI_Comm comm, coll;
} mc_comm;
typedef struct {
  MPI_Request req[2];
  int n;
} mc_req;

static void user_op(void* in, void* inout, int* len, MPI_Datatype* dt, int op) {
  for (int t = 0; t < kNumDTypes; ++t)
    if (g_user[t] && g_types[t] == *dt) {
      g_reduce(t, op, inout, in, (size_t)*len);
      return;
    }
}
#define MC_USER_OP(k) \
  static void user_op_##k(void* in, void* inout, int* len, MPI_Datatype* dt) { user_op(in, inout, len, dt, k); }
MC_USER_OP(0) MC_USER_OP(1) MC_USER_OP(2) MC_USER_OP(3)
MC_USER_OP(4) MC_USER_OP(5) MC_USER_OP(6) MC_USER_OP(7)
static MPI_User_function* const g_user_fns[kNumOps] = {user_op_0, user_op_1, user_op_2, user_op_3,
                                                      user_op_4, user_op_5, user_op_6, user_op_7};

int mc_abi(void) { return MC_SHIM_ABI; }
int mc_thread_multiple(void) { return MPI_THREAD_MULTIPLE; }

static int own_type(int bytes, MPI_Datatype* t) {
  int rc = MPI_Type_contiguous(bytes, MPI_BYTE, t);
  return rc ? rc : MPI_Type_commit(t);
}

/* Initializes MPI unless someone (mpi4py) did; `*ours`: this call did, so MPI_Finalize is ours.
 * `reduce`: meshcoll's reductions, for bool, float16 and bfloat16. */
int mc_init(mc_reduce_fn reduce, int* rank, int* size, int* thread_level, int* ours) {
  int done = 0, rc;
  MPI_Initialized(&done);
  *ours = !done;
  if (!done && (rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, thread_level))) return rc;
  if (done) MPI_Query_thread(thread_level);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  g_reduce = reduce;
  g_types[1] = MPI_INT8_T;
  g_types[2] = MPI_UINT8_T;
  g_types[3] = MPI_INT32_T;
  g_types[4] = MPI_INT64_T;
  g_types[7] = MPI_FLOAT;
  g_types[8] = MPI_DOUBLE;
  static const int user_bytes[kNumDTypes] = {1, 0, 0, 0, 0, 2, 2, 0, 0, 1, 1};
  for (int t = 0; t < kNumDTypes; ++t)
    if (user_bytes[t]) {
      if ((rc = own_type(user_bytes[t], &g_types[t]))) return rc;
      g_user[t] = 1;
    }
  for (int k = 0; k < kNumOps; ++k)
    if ((rc = MPI_Op_create(g_user_fns[k], 1, &g_user_ops[k]))) return rc;
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, size);
  return 0;
}

int mc_finalize(void) {
  int done = 0;
  MPI_Finalized(&done);
  return done ? 0 : MPI_Finalize();
}

void mc_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

int mc_error_string(int code, char* buf, int len) {
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(code, text, &n) != MPI_SUCCESS) n = 0;
  text[n < MPI_MAX_ERROR_STRING ? n : MPI_MAX_ERROR_STRING - 1] = 0;
  strncpy(buf, text, (size_t)len - 1);
  buf[len - 1] = 0;
  return 0;
}

int mc_library_version(char* buf, int len) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  MPI_Get_library_version(text, &n);
  text[n < MPI_MAX_LIBRARY_VERSION_STRING ? n : MPI_MAX_LIBRARY_VERSION_STRING - 1] = 0;
  strncpy(buf, text, (size_t)len - 1);
  buf[len - 1] = 0;
  return 0;
}

/* Wraps `comm` (owned from here on) with its private duplicate; collective over `comm`. */
static int wrap(MPI_Comm comm, void** out) {
  mc_comm* c = (mc_comm*)malloc(sizeof *c);
  c->comm = comm;
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  int rc = MPI_Comm_dup(comm, &c->coll);
  if (rc) {
    MPI_Comm_free(&c->comm);
    free(c);
    return rc;
  }
  MPI_Comm_set_errhandler(c->coll, MPI_ERRORS_RETURN);
  *out = c;
  return 0;
}

/* A communicator of our own (a duplicate of the world's): our calls never match the user's. */
int mc_comm_world(void** out) {
  MPI_Comm comm;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return rc ? rc : wrap(comm, out);
}

/* Collective over `parent`; color < 0 joins no communicator (*out = NULL). */
int mc_comm_split(void* parent, int color, int key, void** out) {
  MPI_Comm child;
  int rc = MPI_Comm_split(((mc_comm*)parent)->comm, color < 0 ? MPI_UNDEFINED : color, key, &child);
  *out = NULL;
  if (rc || child == MPI_COMM_NULL) return rc;
  return wrap(child, out);
}

int mc_comm_info(void* comm, int* rank, int* size) {
  int rc = MPI_Comm_rank(((mc_comm*)comm)->comm, rank);
  return rc ? rc : MPI_Comm_size(((mc_comm*)comm)->comm, size);
}

int mc_comm_free(void* comm) {
  mc_comm* c = (mc_comm*)comm;
  int rc = MPI_Comm_free(&c->coll);
  int rc2 = MPI_Comm_free(&c->comm);
  free(c);
  if (!rc) rc = rc2;
  return rc;
}

/* Blocking, at setup only: rank `root`'s bytes to every rank. */
int mc_bcast_bytes(void* buf, int n, int root, void* comm) {
  return MPI_Bcast(buf, n, MPI_BYTE, root, comm ? ((mc_comm*)comm)->comm : MPI_COMM_WORLD);
}

static MPI_Op op_of(int dtype, int op) {
  if (g_user[dtype]) return g_user_ops[op];
  switch (op) {
    case 0: case 4: return MPI_SUM; /* avg: the caller divides */
    case 1: return MPI_PROD;
    case 2: return MPI_MIN;
    case 3: return MPI_MAX;
    case 5: return MPI_BAND;
    case 6: return MPI_BOR;
    default: return MPI_BXOR;
  }
}

#define MC_COMM(c) (((mc_comm*)(c))->comm)
#define MC_START(call)                             \
  mc_req* r = (mc_req*)malloc(sizeof *r);          \
  r->n = 1;                                        \
  int rc = (call);                                 \
  if (rc) {                                        \
    free(r);                                       \
    return rc;                                     \
  }                                                \
  *req = r;                                        \
  return 0
#define MC_IN(in, out) ((in) == (out) ? MPI_IN_PLACE : (in))

int mc_iallreduce(const void* in, void* out, int count, int dtype, int op, void* comm, void** req) {
  MC_START(MPI_Iallreduce(MC_IN(in, out), out, count, g_types[dtype], op_of(dtype, op), MC_COMM(comm),
                          &r->req[0]));
}

int mc_ireduce(const void* in, void* out, int count, int dtype, int op, int root, void* comm,
               void** req) {
  int me;
  MPI_Comm_rank(MC_COMM(comm), &me);
  const void* send = me == root ? MC_IN(in, out) : in;
  MC_START(MPI_Ireduce(send, out, count, g_types[dtype], op_of(dtype, op), root, MC_COMM(comm),
                       &r->req[0]));
}

int mc_ibcast(void* buf, int count, int dtype, int root, void* comm, void** req) {
  MC_START(MPI_Ibcast(buf, count, g_types[dtype], root, MC_COMM(comm), &r->req[0]));
}

/* `in_place`: this rank's block already lies at its place in `out`. */
int mc_iallgatherv(const void* in, int count, void* out, const int* counts, const int* displs,
                   int dtype, int in_place, void* comm, void** req) {
  MC_START(MPI_Iallgatherv(in_place ? MPI_IN_PLACE : in, count, g_types[dtype], out, counts, displs,
                           g_types[dtype], MC_COMM(comm), &r->req[0]));
}

int mc_ireduce_scatter(const void* in, void* out, const int* counts, int dtype, int op, void* comm,
                       void** req) {
  MC_START(MPI_Ireduce_scatter(in, out, counts, g_types[dtype], op_of(dtype, op), MC_COMM(comm),
                               &r->req[0]));
}

int mc_ialltoallv(const void* in, const int* scounts, const int* sdispls, void* out,
                  const int* rcounts, const int* rdispls, int dtype, void* comm, void** req) {
  MC_START(MPI_Ialltoallv(in, scounts, sdispls, g_types[dtype], out, rcounts, rdispls,
                          g_types[dtype], MC_COMM(comm), &r->req[0]));
}

int mc_igatherv(const void* in, int count, void* out, const int* counts, const int* displs,
                int dtype, int root, void* comm, void** req) {
  MC_START(MPI_Igatherv(in, count, g_types[dtype], out, counts, displs, g_types[dtype], root,
                        MC_COMM(comm), &r->req[0]));
}

int mc_iscatterv(const void* in, const int* counts, const int* displs, void* out, int count,
                 int dtype, int root, void* comm, void** req) {
  MC_START(MPI_Iscatterv(in, counts, displs, g_types[dtype], out, count, g_types[dtype], root,
                         MC_COMM(comm), &r->req[0]));
}

int mc_ibarrier(void* comm, void** req) { MC_START(MPI_Ibarrier(MC_COMM(comm), &r->req[0])); }

int mc_isend(const void* buf, int count, int dtype, int peer, int tag, void* comm, void** req) {
  MC_START(MPI_Isend(buf, count, g_types[dtype], peer, tag, MC_COMM(comm), &r->req[0]));
}

int mc_irecv(void* buf, int count, int dtype, int peer, int tag, void* comm, void** req) {
  MC_START(MPI_Irecv(buf, count, g_types[dtype], peer, tag, MC_COMM(comm), &r->req[0]));
}

/* One step of meshcoll's own collectives (Note [all_reduce over point-to-point] in
 * mpi/mpi_backend.cc), on the communicator's private duplicate: a receive of `rcount` from
 * `from` and a send of `scount` to `to` (either < 0: none), as one request. */
int mc_isendrecv(const void* sbuf, int scount, int to, void* rbuf, int rcount, int from, int dtype,
                 int tag, void* comm, void** req) {
  mc_req* r = (mc_req*)malloc(sizeof *r);
  MPI_Comm c = ((mc_comm*)comm)->coll;
  int rc = 0;
  r->n = 0;
  if (from >= 0 && !(rc = MPI_Irecv(rbuf, rcount, g_types[dtype], from, tag, c, &r->req[0])))
    r->n = 1;
  if (!rc && to >= 0 &&
      !(rc = MPI_Isend(sbuf, scount, g_types[dtype], to, tag, c, &r->req[r->n])))
    r->n += 1;
  if (rc) {
    for (int i = 0; i < r->n; ++i) { /* a posted receive is withdrawn; nothing was sent */
      MPI_Cancel(&r->req[i]);
      MPI_Request_free(&r->req[i]);
    }
    free(r);
    return rc;
  }
  *req = r;
  return 0;
}

/* *done = 1 once the operation completed (the request is then freed: do not test it again).
 * A failed operation returns its error and is freed too. */
int mc_test(void* req, int* done) {
  mc_req* r = (mc_req*)req;
  int rc = r->n == 1 ? MPI_Test(&r->req[0], done, MPI_STATUS_IGNORE)
                     : MPI_Testall(r->n, r->req, done, MPI_STATUSES_IGNORE);
  if (rc || *done) free(r);
  if (rc) *done = 1;
  return rc;
}
