// plait.horovod's native pieces (csrc/torch/horovod.cc, horovod_fast.cc), shared between them.
#ifndef PLAIT_TORCH_HOROVOD_H
#define PLAIT_TORCH_HOROVOD_H

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <vector>

namespace plait_torch {

// One dtype's tensors of a cached group layout, held here so that the copies in and out take no
// list conversion per call: the layout is built once, its copies run every step.
class Group {
 public:
  explicit Group(const std::vector<at::Tensor>& ts);
  // The Python calls: release the GIL for large copies.
  void gather(const at::Tensor& out, double f) const;
  void scatter(const at::Tensor& src, double f) const;
  // The same without touching the GIL (the caller holds it, or released it).
  void gather_into(const at::Tensor& out, double f) const;  // out = the tensors, in order, * f
  void scatter_from(const at::Tensor& src,
                    double f) const;  // the tensors = src * f; bumps versions

 private:
  std::vector<at::Tensor> ts_;
};

// Horovod's ScaleBuffer in place: floating types multiply in their own precision, integers in
// double precision, truncated.
void scale_in_place(at::Tensor& t, double f);

void bind_horovod_fast(pybind11::module_& m);  // horovod_fast.cc

}  // namespace plait_torch
#endif
