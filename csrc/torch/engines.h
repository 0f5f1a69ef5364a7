// The engines between hosts (hier/engine.h) that the native torch module hands out, and the
// test-only calls over any engine capsule. Each binder adds its functions to the module.
#pragma once
#include <pybind11/pybind11.h>

namespace plait_torch {

// make_gloo_engine(pg, store, label) -> PyCapsule (gloo_engine.cc).
void bind_gloo_engine(pybind11::module_& m);
// _engine_* : an engine's functions called on numpy arrays, for tests (engine_calls.cc).
void bind_engine_calls(pybind11::module_& m);

}  // namespace plait_torch
