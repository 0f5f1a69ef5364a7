/* The engine between hosts, as plait's multi-host communicator (hier/hier_comm.h) drives it: a
 * table of plain C functions over one engine group (a set of processes, one or a few per host),
 * handed across modules as a PyCapsule named PLAIT_ENGINE_CAPSULE holding a plait_engine*.
 *
 * Two engines implement it, each a real, proven transport (plait owns no network data path):
 *   gloo  torch's own ProcessGroupGloo, driven through the generic c10d::Backend interface by the
 *         native torch module (csrc/torch/gloo_engine.cc); its job-wide abort flag is a key in the
 *         group's c10d store.
 *   mpi   MPI's C API over a communicator mpi4py created (csrc/hier/mpi_engine.cc, built when CMake
 *         finds MPI); its abort flag is a message on a private duplicate of that communicator.
 *
 * Rules every engine keeps:
 * - Every function is called with the GIL released, from any one thread at a time per group
 *   (the multi-host communicator serialises its calls), except fail(), which any thread may call
 *   at any time, also while another thread is inside a call of the same group.
 * - Buffers are host memory, contiguous, and stay valid until the call (or wait) returns.
 * - A call returns PLAIT_OK (0) or an error kind of capi.h's plait_error, with a message in err
 *   (NUL-terminated, at most errlen bytes) that names the operation, the group and the peer.
 *   PLAIT_E_TIMEOUT when timeout_s (seconds left of the plait call's deadline, >= 0; inf: none)
 *   passes; PLAIT_E_PEER_LOST when a member is gone or the job-wide flag is set (then the message
 *   is the flag's: "rank R failed: ..."). When the flag is set, an engine that knows the kind
 *   fail() recorded returns that kind instead (PLAIT_E_INVALID, PLAIT_E_MISMATCH, ...), so bad
 *   input or a mismatch on one host raises the same class on every host; PLAIT_E_PEER_LOST
 *   stays correct where it does not.
 * - While it waits, a call looks at the job-wide flag at least every 50 ms, so a failure on any
 *   host ends every waiting call everywhere within about that.
 * - Element types: allreduce takes the (dtype, op) pairs for which supports() says 1; for the
 *   others the communicator allgathers and reduces on plait's kernels. Bytes calls carry any type.
 */
#ifndef PLAIT_ENGINE_H
#define PLAIT_ENGINE_H
#include <stddef.h>
#include <stdint.h>

#define PLAIT_ENGINE_VERSION 1
#define PLAIT_ENGINE_CAPSULE "plait.engine"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct plait_engine {
  uint32_t version;     /* PLAIT_ENGINE_VERSION */
  uint32_t struct_size; /* sizeof(plait_engine) of the engine's build: later versions only append */
  const char* name;     /* "gloo", "mpi": for messages */
  int rank;             /* this process's rank in the group */
  int size;             /* the group's size */
  void* ctx;            /* the engine's state, the first argument of every function */

  /* 1 when allreduce takes this (plait_dtype, plait_op) natively (PLAIT_AVG is never asked). */
  int (*supports)(void* ctx, uint8_t dtype, uint8_t op);
  /* In place: buf (count elements of dtype) = the op over the members' buf. */
  uint32_t (*allreduce)(void* ctx, void* buf, size_t count, uint8_t dtype, uint8_t op,
                        double timeout_s, char* err, size_t errlen);
  /* out (size * bytes) = every member's in (bytes), in group-rank order. in may not overlap out. */
  uint32_t (*allgather)(void* ctx, const void* in, void* out, size_t bytes, double timeout_s,
                        char* err, size_t errlen);
  /* allgather in two halves: start returns a request (in and out untouched by the caller until
   * wait returns); wait finishes it (or fails) and frees it, as it does allreduce_start's
   * (below). Every started request is waited. */
  uint32_t (*allgather_start)(void* ctx, const void* in, void* out, size_t bytes, void** req,
                              char* err, size_t errlen);
  uint32_t (*wait)(void* ctx, void* req, double timeout_s, char* err, size_t errlen);
  /* buf (bytes) of member root to every member. */
  uint32_t (*broadcast)(void* ctx, void* buf, size_t bytes, int root, double timeout_s, char* err,
                        size_t errlen);
  /* out block j (bytes each) = member j's in block (this rank's index). in may not overlap out. */
  uint32_t (*alltoall)(void* ctx, const void* in, void* out, size_t bytes, double timeout_s,
                       char* err, size_t errlen);
  /* Point to point between two members; tag in [0, 2^31). Messages of one (peer, tag) pair
   * arrive in order. */
  uint32_t (*send)(void* ctx, const void* buf, size_t bytes, int peer, int tag, double timeout_s,
                   char* err, size_t errlen);
  uint32_t (*recv)(void* ctx, void* buf, size_t bytes, int peer, int tag, double timeout_s,
                   char* err, size_t errlen);
  /* Sets the job-wide flag (kind, msg: the first failure; later ones keep the first) and makes
   * this group's current and later calls fail soon. Any thread, any time; never blocks long. */
  void (*fail)(void* ctx, uint32_t kind, const char* msg);
  /* Frees the group, after its last call returned. The capsule has no destructor of its own: the
   * communicator the capsule is handed to owns the engine and calls this once (hand a capsule to
   * one communicator only). */
  void (*release)(void* ctx);

  /* Appended after version 1's first table: an engine built before it has a smaller struct_size
   * (PLAIT_ENGINE_HAS(e, allreduce_start) is 0), and an engine may leave it NULL; then the
   * communicator calls allreduce. allreduce in two halves, as allgather_start: start issues it
   * and returns a request (buf untouched by the caller until wait returns), wait finishes it and
   * frees it; every started request is waited. timeout_s is the call's time left when it starts
   * (the engine may give the operation its own timeout from it); wait's timeout_s bounds the
   * wait. Errors, the job-wide flag and fail() behave as for allreduce; a start that fails
   * returns no request. */
  uint32_t (*allreduce_start)(void* ctx, void* buf, size_t count, uint8_t dtype, uint8_t op,
                              double timeout_s, void** req, char* err, size_t errlen);

  /* Appended after allreduce_start, likewise optional (PLAIT_ENGINE_HAS(e, probe)): whether a
   * message of tag (in [0, 2^31)) from some other member is ready for recv(*src, tag). Never
   * waits: returns PLAIT_OK with *src = that member (the first found; messages of one (member,
   * tag) pair are seen in their order) and *bytes = its size, or *bytes = PLAIT_ENGINE_UNKNOWN
   * where the engine cannot tell before receiving it (recv then checks it); *src = -1 when there
   * is none yet. A probe consumes nothing: the caller's recv(*src, tag) takes that message. Errors,
   * the job-wide flag and fail() as for the other calls. An engine without it cannot serve a
   * receive from any member: the communicator refuses those. */
  uint32_t (*probe)(void* ctx, int tag, int* src, size_t* bytes, char* err, size_t errlen);

  /* Appended after probe, likewise optional (PLAIT_ENGINE_HAS(e, p2p_start)): send (send = 1)
   * or recv in two halves, so that several can be in flight at once, in any mix of peers and
   * directions (two members that each post a receive and then send to the other must not wait
   * on each other, as with MPI_Irecv + MPI_Send). p2p_start issues the transfer and returns a
   * request without waiting for the peer (buf stays the engine's until the request is finished);
   * p2p_test never waits: *done = 0 while it runs (the request stays), *done = 1 once it has
   * finished, then the request is freed and the return value is its outcome (a size mismatch:
   * PLAIT_E_MISMATCH; the deadline of the start's timeout_s: PLAIT_E_TIMEOUT). Messages of one
   * (peer, tag) pair still arrive in order, and requests of one (peer, tag, direction) complete
   * in the order they were started. Every started request is tested until done, or released
   * with the group (release() must then leave no transfer pointing at a caller's buffer).
   * Errors, the job-wide flag and fail() as for the other calls: p2p_test looks at the flag at
   * least every 50 ms of a request's life. An engine without it serves send/recv one at a time
   * (blocking), and the communicator documents that exchanges across hosts then need a send
   * issued before the matching receive's wait. */
  uint32_t (*p2p_start)(void* ctx, int send, void* buf, size_t bytes, int peer, int tag,
                        double timeout_s, void** req, char* err, size_t errlen);
  uint32_t (*p2p_test)(void* ctx, void* req, int* done, char* err, size_t errlen);
} plait_engine;

/* probe's *bytes when the engine cannot tell a message's size before receiving it. */
#define PLAIT_ENGINE_UNKNOWN SIZE_MAX

/* 1 when engine e (a plait_engine*) was built with member m and sets it. */
#define PLAIT_ENGINE_HAS(e, m) \
  ((e)->struct_size >= offsetof(plait_engine, m) + sizeof((e)->m) && (e)->m != NULL)
/* The size of version 1's first table (before allreduce_start): the least an engine may have. */
#define PLAIT_ENGINE_MIN_SIZE offsetof(plait_engine, allreduce_start)

#ifdef __cplusplus
}
#endif
#endif
