// plait's C entry point for other native modules (the torch backend in csrc/torch/): one table
// of plain C functions, versioned, handed out as the PyCapsule plait._C._capi. Callers compile
// against this header only, so the core (and its communicators) exist once, in plait._C.
// Codes: coll = plait::Coll, dtype = plait::DType, op = plait::RedOp, error kinds =
// plait::ErrorKind (0 = none). A function returning an error kind writes the message to err.
#ifndef PLAIT_CAPI_H
#define PLAIT_CAPI_H
#include <stddef.h>
#include <stdint.h>

#define PLAIT_CAPI_VERSION 3
#define PLAIT_CAPI_CAPSULE "plait._C._capi"
#define PLAIT_COMM_CAPSULE "plait.Communicator"

#ifdef __cplusplus
extern "C" {
#endif

// The codes, as plait's enums number them (capi.cc checks they agree).
enum plait_coll {
  PLAIT_ALLREDUCE = 0,
  PLAIT_REDUCE_SCATTER,
  PLAIT_ALLGATHER,
  PLAIT_BROADCAST,
  PLAIT_REDUCE,
  PLAIT_ALLTOALL,
  PLAIT_BARRIER,
  PLAIT_SEND,
  PLAIT_RECV
};
enum plait_dtype {
  PLAIT_F16 = 0,
  PLAIT_BF16,
  PLAIT_F32,
  PLAIT_F64,
  PLAIT_I8,
  PLAIT_U8,
  PLAIT_I32,
  PLAIT_I64,
  PLAIT_BOOL
};
enum { PLAIT_ANY_SOURCE = -1 };
enum plait_device { PLAIT_HOST = 0, PLAIT_CUDA };
enum plait_op { PLAIT_SUM = 0, PLAIT_PROD, PLAIT_MIN, PLAIT_MAX, PLAIT_AVG };
enum plait_error {
  PLAIT_OK = 0,
  PLAIT_E_GENERIC,
  PLAIT_E_INVALID,
  PLAIT_E_MISMATCH,
  PLAIT_E_TIMEOUT,
  PLAIT_E_PEER_LOST
};

typedef struct plait_buffer {
  void* ptr;
  size_t bytes;
  uint8_t dtype;
  uint8_t present;  // 0: no buffer (e.g. reduce's output on a non-root)
  uint8_t writable;
  // Version 3: where the bytes live. PLAIT_HOST (0, what a zero-filled buffer says), or
  // PLAIT_CUDA: memory of CUDA device device_index, the call enqueued on CUDA stream `stream`
  // (a cudaStream_t; 0: the legacy default stream) and complete when that stream gets there.
  uint8_t device;
  int32_t device_index;
  uintptr_t stream;
} plait_buffer;

// Completion of an asynchronous call; runs once on plait's progress thread (or on the thread
// that ran the call through task_run). msg is "" on success and only valid during the call.
typedef void (*plait_done_fn)(void* ctx, uint32_t kind, const char* msg);

typedef struct plait_capi {
  uint32_t version;      // PLAIT_CAPI_VERSION
  uint32_t struct_size;  // sizeof(plait_capi) of the library: later versions only append
  int (*rank)(void* comm);
  int (*size)(void* comm);
  // One call; a recv's peer may be PLAIT_ANY_SOURCE. Device buffers (PLAIT_CUDA) are enqueued on
  // their stream by the communicator's GPU queue and return at once (done is not called: the
  // stream orders what follows). Host buffers: done == NULL: synchronous, returns when it
  // finished. Otherwise asynchronous: returns 0 once it is queued, done(ctx, ...) follows exactly
  // once; with task != NULL, *task receives a handle for task_run / task_release. Validation errors
  // return their kind (done is not called) and abort the communicator on every rank, as the Python
  // calls do. timeout_s: the call's deadline in seconds (0: fail at once if a peer is not there); <
  // 0: the communicator's default.
  uint32_t (*call)(void* comm, uint8_t coll, const plait_buffer* in, const plait_buffer* out,
                   uint8_t op, int root, int peer, int64_t tag, const char* algo, double timeout_s,
                   plait_done_fn done, void* ctx, void** task, char* err, size_t errlen);
  // Aborts the communicator on every rank with this message; returns the kind raised.
  uint32_t (*fail)(void* comm, uint32_t kind, const char* msg, char* err, size_t errlen);
  // Runs a queued task on this thread when nothing runs before it; 1 if it is finished.
  int (*task_run)(void* comm, void* task);
  void (*task_release)(void* task);
  // Finishes the queued calls, then stops the communicator (later calls fail); idempotent.
  void (*finalize)(void* comm);
  // The rank a finished recv task got its message from (the sender an any-source recv matched).
  int (*task_peer)(void* task);
  // Memory peers can map (plait.empty's): alloc returns NULL on failure; id frees it.
  void* (*shared_alloc)(size_t bytes, uint64_t* id);
  void (*shared_free)(uint64_t id);
  // Version 2. Starts a queued async call now on plait's progress thread. An async collective is
  // otherwise left up to a grace period to a caller that runs it when it waits (task_run;
  // core/wakeup.h): callers that will not wait soon (they hand out its Future, or poll it) start
  // it.
  void (*task_start)(void* task);
} plait_capi;

#ifdef __cplusplus
}
#endif
#endif
