// torch.ops.plait.all_reduce_ and torch.ops.plait.all_gather: collectives as torch operators, for
// tensor-parallel inference loops under torch.compile (one opaque graph node each; the Meta
// kernels give their shapes when tracing). The group is named as c10d's functional collectives
// name it (pg.group_name); its CPU backend runs the call inline, with no Python.
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace {

c10d::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum") return c10d::ReduceOp::SUM;
  if (op == "avg") return c10d::ReduceOp::AVG;
  if (op == "max") return c10d::ReduceOp::MAX;
  if (op == "min") return c10d::ReduceOp::MIN;
  if (op == "product") return c10d::ReduceOp::PRODUCT;
  TORCH_CHECK(false, "plait.all_reduce_: op '", op, "' is not one of sum, avg, max, min, product");
}

c10::intrusive_ptr<c10d::Backend> backend_of(const std::string& group) {
  return c10d::resolve_process_group(group)->getBackend(c10::DeviceType::CPU);
}

void all_reduce_(at::Tensor& t, c10::string_view op, c10::string_view group) {
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = reduce_op(std::string(op));
  o.asyncOp = false;
  backend_of(std::string(group))->allreduce(ts, o)->wait();
}

std::vector<int64_t> gathered_shape(const at::Tensor& t, int64_t n) {
  auto shape = t.sizes().vec();
  if (shape.empty()) shape.push_back(1);
  shape[0] *= n;
  return shape;
}

at::Tensor all_gather(const at::Tensor& t, c10::string_view group) {
  auto b = backend_of(std::string(group));
  at::Tensor in = t.contiguous();
  at::Tensor out = at::empty(gathered_shape(t, b->getSize()), t.options());
  c10d::AllgatherOptions o;
  o.asyncOp = false;
  b->_allgather_base(out, in, o)->wait();
  return out;
}

void all_reduce_meta(at::Tensor&, c10::string_view, c10::string_view) {}

at::Tensor all_gather_meta(const at::Tensor& t, c10::string_view group) {
  const int64_t n = c10d::resolve_process_group(std::string(group))->getSize();
  return at::empty(gathered_shape(t, n), t.options());
}

}  // namespace

TORCH_LIBRARY(plait, m) {
  // In place, returning nothing: torch.compile functionalizes no custom op with aliased outputs.
  m.def("all_reduce_(Tensor(a!) tensor, str op, str group_name) -> ()");
  m.def("all_gather(Tensor tensor, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(plait, CPU, m) {
  m.impl("all_reduce_", all_reduce_);
  m.impl("all_gather", all_gather);
}

TORCH_LIBRARY_IMPL(plait, Meta, m) {
  m.impl("all_reduce_", all_reduce_meta);
  m.impl("all_gather", all_gather_meta);
}
