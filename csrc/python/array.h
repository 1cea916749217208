// Every array that crosses into C++ becomes a comm::ArrayView here, and only here: numpy
// arrays, buffer-protocol objects, DLPack tensors, __cuda_array_interface__ objects and
// torch tensors. Every check runs here, with the GIL held, before anything is sent:
// contiguity, writability, a supported dtype, native byte order, host or device memory as
// the backend needs. Nothing here imports a framework.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/array_view.h"

namespace meshcoll::python {

// Stream handles as the array protocols spell them: 1 legacy default, 2 per-thread default.
constexpr uintptr_t kLegacyStream = 1;

// What a call asks of an array.
struct Want {
  const char* what = "";      // the operation, "all_reduce", for errors
  const char* arg = nullptr;  // which of its arrays, "out" (errors say "all_reduce: out")
  bool writable = false;      // the result is written into it
  bool device = false;        // CUDA memory (NCCL backend), else host memory (CPU backend)
  bool keep = false;          // take a reference to the owner (asynchronous operations)
  bool has_stream = false;    // device: the op's stream was given (stream=), in `stream`
  uintptr_t stream = kLegacyStream;
};

// What was read: the view, and for device arrays the stream the op runs on and a stream it
// must first wait for (a __cuda_array_interface__ "stream" other than the op's).
struct Read {
  comm::ArrayView view;
  uintptr_t stream = kLegacyStream;
  uintptr_t order_after = 0;
  // The memory is numpy's own allocation (Note [Memory numpy owns] in array_memory.cc): it
  // stays mapped, readable and writable while the array lives, so it needs no probe.
  bool numpy_owned = false;
};

// "all_reduce: out": how errors name the array (formatted only when one is raised).
std::string label(const Want& w);

// Reads `x` as `want` asks; TypeError / ValueError (TypeMismatch / InvalidArgument) naming
// `want.what` for anything a backend cannot take. `dims`, if given, receives the shape.
Read read_array(const pybind11::handle& x, const Want& want, std::vector<int64_t>* dims = nullptr);

// Which protocol read_array reads `x` through: "numpy", "torch" (its methods),
// "dlpack exchange" (Note [The DLPack C exchange API]), "dlpack", "jax", "cuda array
// interface", "buffer" or "unknown". For tests and diagnosis.
const char* array_reader(const pybind11::handle& x);

// stream=: None, an int handle, or an object with .cuda_stream (torch) or .ptr (CuPy).
// False for None. 0 (torch's and CuPy's spelling of the default stream) -> legacy.
bool stream_arg(const pybind11::handle& s, uintptr_t* out);
void* to_cu_stream(uintptr_t s);  // protocol spelling -> CUstream (legacy: nullptr)

// Note [Owners]
// An asynchronous operation holds a reference to each array it reads or writes until it has
// completed, so an array whose Work the caller dropped is not freed under it. The
// reference is released by the thread that sees the operation complete, which may not hold
// the GIL (the CPU worker, the NCCL watchdog) and must not take it (a caller holding the GIL
// may be waiting for that thread): the decref is then handed to the interpreter as a
// pending call (Py_AddPendingCall), run by the main thread at its next chance, and by any
// thread that enters a collective (release_owners): a main thread blocked in C for good
// (joining the thread that trains) must not keep finished operations' arrays alive.
std::shared_ptr<void> owner_of(const pybind11::handle& x);
// InvalidArgument naming `w` when a host array's memory is not mapped, or not readable or
// writable as the call needs (Note [Unmapped memory] in array_memory.cc); nothing for device
// arrays.
void check_memory(const comm::ArrayView& v, const Want& w);
// Whether `a` is a numpy array whose memory numpy allocated for it or for the array it views
// (Note [Memory numpy owns] in array_memory.cc): no probe needed.
bool owns_its_memory(PyObject* a);
// Drops the references finished operations left for a GIL holder (the GIL held).
void release_owners();

// A DLPack capsule ("dltensor") of C-contiguous CUDA memory at `data` on `device`, holding
// `owner` until the consumer's deleter runs (or the capsule dies unconsumed): how memory
// meshcoll allocates becomes a framework's array (torch.from_dlpack, cupy.from_dlpack).
pybind11::capsule device_capsule(std::shared_ptr<void> owner, void* data, int device, DType dt,
                                 const std::vector<int64_t>& shape);

}  // namespace meshcoll::python
