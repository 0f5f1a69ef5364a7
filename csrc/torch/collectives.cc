// The collectives of the plait c10d backend: torch's arguments onto plait calls.
// plait takes C-contiguous buffers of its nine dtypes; everything else torch can hand over is
// mapped here, as the Python backend (python/plait/torch/_reduce.py, _tensors.py) does it:
// data movement moves raw bytes (any dtype); reductions widen int16/uint16/uint32, reinterpret
// uint64 for sums and products, see complex tensors as float pairs; PREMUL_SUM scales a copy
// then sums; integer AVG sums then divides (truncating); BAND/BOR/BXOR gather every rank's
// input and reduce locally; non-contiguous outputs get a temporary copied back afterwards.
#include <ATen/ATen.h>

#include "torch/backend.h"

namespace plait_torch {

int dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kHalf:
      return PLAIT_F16;
    case at::kBFloat16:
      return PLAIT_BF16;
    case at::kFloat:
      return PLAIT_F32;
    case at::kDouble:
      return PLAIT_F64;
    case at::kChar:
      return PLAIT_I8;
    case at::kByte:
      return PLAIT_U8;
    case at::kInt:
      return PLAIT_I32;
    case at::kLong:
      return PLAIT_I64;
    case at::kBool:
      return PLAIT_BOOL;
    default:
      return -1;
  }
}

namespace {

using RT = c10d::ReduceOp::RedOpType;
constexpr int64_t kTag = kInternalTag;

// A tensor's bytes as plait takes them; a CUDA tensor's are device memory (Op::issue gives the
// buffer its stream).
plait_buffer buffer(const at::Tensor& t, int dtype) {
  plait_buffer b{t.data_ptr(), t.nbytes(), uint8_t(dtype), 1, 1};
  if (t.is_cuda()) b.device = PLAIT_CUDA, b.device_index = t.device().index();
  return b;
}
plait_buffer typed(const at::Tensor& t) { return buffer(t, dtype_code(t.scalar_type())); }
plait_buffer bytes(const at::Tensor& t) { return buffer(t, PLAIT_U8); }

at::Tensor raw(const at::Tensor& t) {
  auto flat = t.detach().reshape(-1);
  return flat.scalar_type() == at::kByte ? flat : flat.view(at::kByte);
}

// t contiguous with its conjugation resolved; fresh says whether that made a copy.
at::Tensor source(const at::Tensor& t, bool* fresh = nullptr) {
  at::Tensor s = t.is_conj() ? t.resolve_conj() : t;
  if (!s.is_contiguous()) s = s.contiguous();
  if (fresh) *fresh = !s.is_same(t);
  return s;
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (!a.numel() || !b.numel()) return false;
  auto pa = static_cast<const char*>(a.data_ptr()), pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.nbytes() == b.nbytes();
}
bool is_block(const at::Tensor& part, const at::Tensor& whole, int index) {
  return static_cast<const char*>(part.data_ptr()) ==
         static_cast<const char*>(whole.data_ptr()) + size_t(index) * part.nbytes();
}

// One contiguous 1-D tensor over tensors that lie back to back in one storage, or undefined.
at::Tensor flat_view(const std::vector<at::Tensor>& ts) {
  const auto& first = ts[0];
  auto* p = static_cast<const char*>(first.data_ptr());
  int64_t total = 0;
  for (const auto& t : ts) {
    if (t.scalar_type() != first.scalar_type() || !t.is_contiguous() || t.data_ptr() != p ||
        !t.storage().is_alias_of(first.storage()))
      return at::Tensor();
    p += t.nbytes();
    total += t.numel();
  }
  return first.detach().as_strided({total}, {1});
}

void write_bytes(const at::Tensor& dst, const at::Tensor& data) {
  if (dst.is_contiguous()) {
    raw(dst).copy_(data);
  } else {
    auto tmp = at::empty(dst.sizes(), dst.options());
    raw(tmp).copy_(data);
    const_cast<at::Tensor&>(dst).copy_(tmp);
  }
}

const char* op_name(RT k) {
  switch (k) {
    case RT::SUM:
      return "SUM";
    case RT::AVG:
      return "AVG";
    case RT::PRODUCT:
      return "PRODUCT";
    case RT::MIN:
      return "MIN";
    case RT::MAX:
      return "MAX";
    case RT::BAND:
      return "BAND";
    case RT::BOR:
      return "BOR";
    case RT::BXOR:
      return "BXOR";
    case RT::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

int64_t nrows(const at::Tensor& t) { return t.dim() ? t.size(0) : 1; }

// Rows of t per rank: the split sizes, or dim 0 cut evenly; empty when they do not fit.
std::vector<int64_t> splits(const at::Tensor& t, const std::vector<int64_t>& sizes, int n) {
  const int64_t rows = nrows(t);
  if (!sizes.empty()) {
    int64_t sum = 0;
    for (auto s : sizes) sum += s;
    return int(sizes.size()) == n && sum == rows ? sizes : std::vector<int64_t>{};
  }
  return rows % n == 0 ? std::vector<int64_t>(size_t(n), rows / n) : std::vector<int64_t>{};
}

std::vector<at::Tensor> rows_of(const at::Tensor& t, const std::vector<int64_t>& counts) {
  at::Tensor flat = t.dim() ? t : t.reshape({1});
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (auto c : counts) {
    out.push_back(flat.narrow(0, start, c));
    start += c;
  }
  return out;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

struct Backend::Red {
  RT kind = RT::SUM;
  double factor = 1;
  at::Tensor tfactor;
  bool gathers() const { return kind == RT::BAND || kind == RT::BOR || kind == RT::BXOR; }
};

Backend::Red Backend::red_of(const c10d::ReduceOp& r, const Op& op) const {
  Red red;
  red.kind = r.op_;
  if (red.kind == RT::PREMUL_SUM) {
    auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(r.supplement_.get());
    if (!s) unsupported(op, "PREMUL_SUM without a factor");
    if (s->tensor_factor.defined()) {
      red.tfactor = s->tensor_factor.to(at::kCPU);
    } else {
      red.factor = s->double_factor;
    }
  }
  return red;
}

at::Tensor Backend::sink(Op& op, const at::Tensor& t) {
  if (t.is_contiguous()) return t;
  auto tmp = at::empty(t.sizes(), t.options());
  at::Tensor dst = t;
  op.after([dst, tmp]() mutable { dst.copy_(tmp); });
  return tmp;
}

void Backend::reduce_into(Op& op, at::Tensor x, at::Tensor y, const Red& red, int root,
                          bool scatter) {
  same_device(op, x, y);
  const int me = getRank();
  // A non-root of a reduce gets no output from plait: its tensor is left alone, and x stands in
  // for it where only shape and dtype are read (the gather path writes a scratch copy).
  const bool discard = root >= 0 && me != root;
  if (discard) y = red.gathers() ? at::empty_like(x) : x;
  if (red.gathers()) return reduce_by_gather(op, x, y, red, root, scatter);
  const RT kind = red.kind;
  const bool additive = kind == RT::SUM || kind == RT::AVG || kind == RT::PREMUL_SUM;
  if (x.is_complex() || y.is_complex()) {
    if (!additive)
      unsupported(op, std::string(op_name(kind)) +
                          " on complex tensors (c10d allows SUM, AVG, PREMUL_SUM)");
    x = at::view_as_real(x.resolve_conj());
    y = at::view_as_real(y);
  }
  at::ScalarType wire = x.scalar_type();
  bool widen = false, reinterp = false;
  if (dtype_code(wire) < 0) {
    if (wire == at::kShort || wire == at::kUInt16) {
      wire = at::kInt, widen = true;
    } else if (wire == at::kUInt32) {
      wire = at::kLong, widen = true;
    } else if (wire == at::kUInt64 && (kind == RT::SUM || kind == RT::PRODUCT)) {
      wire = at::kLong, reinterp = true;
    } else {
      unsupported(op, std::string(op_name(kind)) + " on " +
                          std::string(c10::toString(x.scalar_type())) + " tensors");
    }
  }
  at::Tensor src = x;
  bool fresh = false;
  if (kind == RT::PREMUL_SUM) {
    src = (red.tfactor.defined() ? at::mul(src, red.tfactor.to(src.device()))
                                 : at::mul(src, red.factor))
              .to(x.scalar_type());
    fresh = true;
  }
  if (widen) {
    src = src.to(wire).contiguous();
    fresh = true;
  } else {
    if (!src.is_contiguous()) src = src.contiguous(), fresh = true;
    if (reinterp) src = src.view(wire);
  }
  std::vector<std::function<void()>> post;
  at::Tensor dst;
  if ((widen || !y.is_contiguous()) && !discard) {
    at::Tensor target;
    if (fresh && !reinterp && src.sizes() == y.sizes()) {
      dst = target = src;
    } else {
      target = at::empty(y.sizes(), y.options().dtype(widen ? wire : y.scalar_type()));
      dst = reinterp ? target.view(wire) : target;
    }
    post.push_back([y, target]() mutable { y.copy_(target); });
  } else {
    dst = reinterp ? y.view(wire) : y;
  }
  uint8_t name = kind == RT::PRODUCT ? PLAIT_PROD
                 : kind == RT::MIN   ? PLAIT_MIN
                 : kind == RT::MAX   ? PLAIT_MAX
                 : kind == RT::AVG   ? PLAIT_AVG
                                     : PLAIT_SUM;
  if (kind == RT::AVG && !at::isFloatingType(wire)) {
    if (wire == at::kBool) unsupported(op, "AVG on bool tensors");
    name = PLAIT_SUM;
    const int n = getSize();
    post.insert(post.begin(), [dst, n]() mutable { dst.div_(n, "trunc"); });
  }
  const bool inplace_ok = scatter && is_block(dst, src, me);
  if (!fresh && !dst.is_same(src) && overlaps(src, dst) && !(same_bytes(src, dst) || inplace_ok))
    src = src.clone();
  if (!discard)
    for (auto& f : post) op.after(std::move(f));
  op.keep(src);
  op.keep(dst);
  plait_buffer in = typed(src), out = typed(dst);
  if (scatter) {
    op.issue(PLAIT_REDUCE_SCATTER, &in, &out, name, 0, -1, 0);
  } else if (root < 0) {
    op.issue(PLAIT_ALLREDUCE, &in, &out, name, 0, -1, 0);
  } else {
    op.issue(PLAIT_REDUCE, &in, me == root ? &out : nullptr, name, root, -1, 0);
  }
}

void Backend::reduce_by_gather(Op& op, const at::Tensor& x, at::Tensor y, const Red& red, int root,
                               bool scatter) {
  if (x.is_floating_point() || x.is_complex())
    unsupported(op, std::string(op_name(red.kind)) + " on " +
                        std::string(c10::toString(x.scalar_type())) + " tensors");
  at::Tensor src = source(x);
  std::vector<int64_t> shape{getSize()};
  for (auto d : src.sizes()) shape.push_back(d);
  at::Tensor stack = at::empty(shape, src.options());
  op.keep(src);
  plait_buffer in = bytes(src), out = bytes(stack);
  op.issue(PLAIT_ALLGATHER, &in, &out, PLAIT_SUM, 0, -1, 0);
  const RT kind = red.kind;
  const int me = getRank();
  op.after([=]() mutable {
    at::Tensor r = stack[0].clone();
    for (int64_t i = 1; i < stack.size(0); ++i) {
      if (kind == RT::BAND)
        r.bitwise_and_(stack[i]);
      else if (kind == RT::BOR)
        r.bitwise_or_(stack[i]);
      else
        r.bitwise_xor_(stack[i]);
    }
    if (scatter) {
      const int64_t m = y.numel();
      r = r.reshape(-1).narrow(0, me * m, m);
    }
    y.copy_(r.reshape(y.sizes()));
  });
}

// A coalesced allreduce plait reduces as it is: it joins the fused call (see flush).
static int fusable_op(const Backend::Tensors& ts, const c10d::ReduceOp& r) {
  if (ts.size() != 1) return -1;
  const at::Tensor& t = ts[0];
  if (!t.is_cpu() || !t.is_contiguous() || t.is_conj() || dtype_code(t.scalar_type()) < 0)
    return -1;
  switch (r.op_) {
    case RT::SUM:
      return PLAIT_SUM;
    case RT::PRODUCT:
      return PLAIT_PROD;
    case RT::MIN:
      return PLAIT_MIN;
    case RT::MAX:
      return PLAIT_MAX;
    case RT::AVG:
      return at::isFloatingType(t.scalar_type()) ? PLAIT_AVG : -1;
    default:
      return -1;
  }
}

void Backend::flush() {
  if (fuse_.empty()) return;
  auto batch = std::move(fuse_);
  fuse_.clear();
  std::vector<at::Tensor> parts, outs;
  for (auto& [op, t] : batch) {
    parts.push_back(t.reshape(-1));
    outs.push_back(t);
  }
  at::Tensor flat = at::cat(parts);
  auto fused = std::make_shared<Op>(
      this, "allreduce (" + std::to_string(batch.size()) + " coalesced)", Tensors{});
  fused->weak = fused;
  fused->timeout_s = batch.front().first->timeout_s;
  for (auto& b : batch) fused->follow(b.first);
  fused->keep(flat);
  fused->after([flat, outs]() mutable {
    int64_t off = 0;
    for (auto& t : outs) {
      t.view(-1).copy_(flat.narrow(0, off, t.numel()));
      off += t.numel();
    }
  });
  plait_buffer b = typed(flat);
  try {
    fused->issue(PLAIT_ALLREDUCE, &b, &b, fuse_op_, 0, -1, 0);
  } catch (const Error& e) {
    for (auto& x : batch) x.first->release(e.kind(), e.what_without_backtrace());
    throw;
  }
  fused->launch();
}

namespace {
// A sparse tensor's nnz, then what must agree across ranks: dtype, sparse and dense dims, and
// the sizes (the first kSparseDims of them, and a hash of all, for tensors with more dims).
constexpr int64_t kSparseDims = 24;
at::Tensor sparse_descriptor(const at::Tensor& t) {
  at::Tensor d = at::full({5 + kSparseDims}, -1, at::kLong);
  auto v = d.accessor<int64_t, 1>();
  v[0] = t._nnz();
  v[1] = int64_t(t.scalar_type());
  v[2] = t.sparse_dim();
  v[3] = t.dense_dim();
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i < kSparseDims) v[5 + i] = t.size(i);
    h = (h ^ uint64_t(t.size(i))) * 1099511628211ull;
  }
  v[4] = int64_t(h >> 1);
  return d;
}

std::string sparse_shape(const at::Tensor& row) {
  auto v = row.accessor<int64_t, 1>();
  std::string s = "(";
  for (int64_t i = 0; i < v[2] + v[3] && i < kSparseDims; ++i)
    s += (i ? ", " : "") + std::to_string(v[5 + i]);
  s += v[2] + v[3] == 1 ? ",)" : ")";
  return s + " " + std::string(c10::toString(c10::ScalarType(v[1]))) +
         " sparse_dim=" + std::to_string(v[2]) + " dense_dim=" + std::to_string(v[3]);
}
}  // namespace

// A sparse (COO) allreduce, as gloo does it: every rank's indices and values are gathered
// (padded to the largest count), then summed locally (coalesce) into the input tensor.
Backend::WorkPtr Backend::allreduce_sparse_coo(Tensors& ts, const c10d::AllreduceOptions& o) {
  auto op = begin("allreduce (sparse)", ts, !o.asyncOp, o.timeout);
  one_tensor(*op, ts.size());
  if (o.reduceOp.op_ != RT::SUM)
    unsupported(*op,
                std::string(op_name(o.reduceOp.op_)) + " on sparse tensors (SUM only, as gloo)");
  at::Tensor t = ts[0];
  if (!t.is_cpu() || t.layout() != at::kSparse)
    unsupported(*op, "sparse tensors other than CPU COO (CUDA tensors: dense ones only)");
  const at::Tensor in = t.coalesce();
  const int n = getSize();
  // Each rank's nnz and shape first, inline: the gathers' sizes depend on the counts, and ranks
  // whose tensors differ in shape, sparse/dense split or dtype must all refuse before data moves
  // (else indices valid on one rank land out of range on another).
  const at::Tensor desc = sparse_descriptor(in);
  at::Tensor table = at::empty({n, desc.numel()}, at::kLong);
  plait_buffer a = typed(desc), b = typed(table);
  char err[1024];
  if (uint32_t kind = api_->call(comm_, PLAIT_ALLGATHER, &a, &b, PLAIT_SUM, 0, -1, 0, "auto",
                                 op->timeout_s, nullptr, nullptr, nullptr, err, sizeof err))
    throw error(kind, op->where(), err);
  check_sparse_shapes(*op, table);
  const at::Tensor counts = table.select(1, 0).contiguous();
  const int64_t most = counts.max().item<int64_t>();
  auto pad = [&](const at::Tensor& x, int64_t dim) {  // x with dim grown to `most`, contiguous
    auto sizes = x.sizes().vec();
    sizes[size_t(dim)] = most;
    at::Tensor p = at::zeros(sizes, x.options());
    p.narrow(dim, 0, x.size(dim)).copy_(x);
    return p;
  };
  const at::Tensor idx = pad(in._indices(), 1), val = pad(in._values(), 0);
  auto stacked = [&](const at::Tensor& x) {
    auto sizes = x.sizes().vec();
    sizes.insert(sizes.begin(), n);
    return at::empty(sizes, x.options());
  };
  at::Tensor all_idx = stacked(idx), all_val = stacked(val);
  op->keep(idx);
  op->keep(val);
  plait_buffer i1 = bytes(idx), i2 = bytes(all_idx), v1 = bytes(val), v2 = bytes(all_val);
  op->issue(PLAIT_ALLGATHER, &i1, &i2, PLAIT_SUM, 0, -1, 0);
  op->issue(PLAIT_ALLGATHER, &v1, &v2, PLAIT_SUM, 0, -1, 0);
  op->after([t, counts, all_idx, all_val]() mutable {
    std::vector<at::Tensor> is, vs;
    for (int64_t r = 0; r < counts.size(0); ++r) {
      const int64_t c = counts[r].item<int64_t>();
      is.push_back(all_idx[r].narrow(1, 0, c));
      vs.push_back(all_val[r].narrow(0, 0, c));
    }
    t.copy_(at::sparse_coo_tensor(at::cat(is, 1), at::cat(vs, 0), t.sizes()).coalesce());
  });
  return op->launch();
}

// Every rank holds the same table, so every rank raises (and the group stays usable).
void Backend::check_sparse_shapes(const Op& op, const at::Tensor& table) const {
  const at::Tensor mine = table[getRank()].narrow(0, 1, table.size(1) - 1);
  for (int64_t r = 0; r < table.size(0); ++r) {
    if (at::equal(table[r].narrow(0, 1, table.size(1) - 1), mine)) continue;
    std::string all;
    for (int64_t q = 0; q < table.size(0); ++q)
      all += (q ? "; rank " : "rank ") + std::to_string(q) + ": " + sparse_shape(table[q]);
    throw error(
        PLAIT_E_MISMATCH, op.where(),
        "sparse all_reduce: the ranks' sparse tensors differ in size, dims or dtype (" + all + ")");
  }
}

Backend::WorkPtr Backend::allreduce(Tensors& ts, const c10d::AllreduceOptions& o) {
  if (!ts.empty() && ts[0].is_sparse()) return allreduce_sparse_coo(ts, o);
  const int fop = coalescing_ ? fusable_op(ts, o.reduceOp) : -1;
  if (fop >= 0 && !fuse_.empty() &&
      (fop != fuse_op_ || fuse_.front().second.scalar_type() != ts[0].scalar_type()))
    flush();
  auto op = begin("allreduce", ts, !o.asyncOp, o.timeout, fop >= 0);
  if (fop >= 0) {
    op->hold();  // released by the fused call
    fuse_op_ = uint8_t(fop);
    fuse_.emplace_back(op, ts[0]);
    return op->launch();
  }
  one_device(*op, ts);
  const Red red = red_of(o.reduceOp, *op);
  for (auto& t : ts) reduce_into(*op, t, t, red, -1, false);
  return op->launch();
}

Backend::WorkPtr Backend::allreduce_coalesced(Tensors& ts,
                                              const c10d::AllreduceCoalescedOptions& o) {
  // One plait call over a flat copy when plait reduces every tensor as it is, in one dtype.
  int fop = -1;
  for (const auto& t : ts) {
    const int f = fusable_op({t}, o.reduceOp);
    if (f < 0 || t.scalar_type() != ts[0].scalar_type()) return allreduce(ts, o);
    fop = f;
  }
  if (ts.size() < 2) return allreduce(ts, o);
  auto op = begin("allreduce_coalesced", ts, !o.asyncOp, o.timeout);
  one_device(*op, ts);
  std::vector<at::Tensor> parts;
  for (const auto& t : ts) parts.push_back(t.reshape(-1));
  at::Tensor flat = at::cat(parts);
  op->keep(flat);
  op->after([flat, ts]() mutable {
    int64_t off = 0;
    for (auto& t : ts) {
      t.view(-1).copy_(flat.narrow(0, off, t.numel()));
      off += t.numel();
    }
  });
  plait_buffer b = typed(flat);
  op->issue(PLAIT_ALLREDUCE, &b, &b, uint8_t(fop), 0, -1, 0);
  return op->launch();
}

Backend::WorkPtr Backend::reduce(Tensors& ts, const c10d::ReduceOptions& o) {
  auto op = begin("reduce", ts, !o.asyncOp, o.timeout);
  one_tensor(*op, ts.size());
  reduce_into(*op, ts[0], ts[0], red_of(o.reduceOp, *op), int(o.rootRank), false);
  return op->launch();
}

void Backend::reduce_scatter_one(Op& op, at::Tensor out, const at::Tensor& in, const Red& red) {
  if (in.numel() != out.numel() * getSize())
    fail("reduce_scatter: input has " + std::to_string(in.numel()) + " elements, output " +
         std::to_string(out.numel()) + "; the input needs group size (" +
         std::to_string(getSize()) + ") x output elements");
  at::Tensor x = source(in);  // plait reads bytes: no need to flatten
  if (out.is_contiguous()) return reduce_into(op, x, out, red, -1, true);
  at::Tensor tmp = at::empty({out.numel()}, out.options());
  reduce_into(op, x, tmp, red, -1, true);
  op.after([out, tmp]() mutable { out.copy_(tmp.view(out.sizes())); });
}

Backend::WorkPtr Backend::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                               const c10d::ReduceScatterOptions& o) {
  auto op = begin("reduce_scatter_single", {out}, !o.asyncOp, o.timeout);
  reduce_scatter_one(*op, out, in, red_of(o.reduceOp, *op));
  return op->launch();
}

Backend::WorkPtr Backend::reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                          const c10d::ReduceScatterOptions& o) {
  auto op = begin("reduce_scatter_single_coalesced", outs, !o.asyncOp, o.timeout);
  const Red red = red_of(o.reduceOp, *op);
  for (size_t i = 0; i < outs.size() && i < ins.size(); ++i)
    reduce_scatter_one(*op, outs[i], ins[i], red);
  return op->launch();
}

Backend::WorkPtr Backend::reduce_scatter(Tensors& outs, TensorLists& ins_lists,
                                         const c10d::ReduceScatterOptions& o) {
  auto op = begin("reduce_scatter", outs, !o.asyncOp, o.timeout);
  one_tensor(*op, outs.size());
  at::Tensor out = outs[0];
  const auto& ins = ins_lists.at(0);
  one_device(*op, outs, ins);
  const Red red = red_of(o.reduceOp, *op);
  if (int(ins.size()) != getSize())
    fail("reduce_scatter: " + std::to_string(ins.size()) + " inputs for a group of " +
         std::to_string(getSize()));
  bool even = true;
  for (const auto& t : ins) even = even && t.numel() == out.numel();
  if (even) {
    at::Tensor flat = flat_view(ins);
    if (!flat.defined()) {
      std::vector<at::Tensor> parts;
      for (const auto& t : ins) parts.push_back(t.reshape(-1));
      flat = at::cat(parts);
    }
    reduce_scatter_one(*op, out, flat, red);
  } else {  // uneven blocks: one reduce per block, rooted at the rank that keeps it
    for (int r = 0; r < getSize(); ++r) reduce_into(*op, ins[size_t(r)], out, red, r, false);
  }
  return op->launch();
}

void Backend::broadcast_one(Op& op, at::Tensor t, int root) {
  on_device(op, t);
  at::Tensor buf = source(t);
  if (!buf.is_same(t) && getRank() != root) op.after([t, buf]() mutable { t.copy_(buf); });
  op.keep(buf);
  plait_buffer b = bytes(buf);
  op.issue(PLAIT_BROADCAST, &b, &b, PLAIT_SUM, root, -1, 0);
}

Backend::WorkPtr Backend::broadcast(Tensors& ts, const c10d::BroadcastOptions& o) {
  auto op = begin("broadcast", ts, !o.asyncOp, o.timeout);
  one_tensor(*op, ts.size());
  broadcast_one(*op, ts[0], int(o.rootRank));
  return op->launch();
}

void Backend::allgather_one(Op& op, at::Tensor out, const at::Tensor& in) {
  same_device(op, in, out);
  if (out.numel() != in.numel() * getSize())
    fail("all_gather: output has " + std::to_string(out.numel()) + " elements, input " +
         std::to_string(in.numel()) + "; the output needs group size (" +
         std::to_string(getSize()) + ") x input elements");
  at::Tensor dst = sink(op, out);
  bool fresh = false;
  at::Tensor src = source(in, &fresh);
  if (!fresh && overlaps(src, dst) && !is_block(src, dst, getRank())) src = src.clone();
  op.keep(src);
  op.keep(dst);
  plait_buffer a = bytes(src), b = bytes(dst);
  op.issue(PLAIT_ALLGATHER, &a, &b, PLAIT_SUM, 0, -1, 0);
}

Backend::WorkPtr Backend::_allgather_base(at::Tensor& out, at::Tensor& in,
                                          const c10d::AllgatherOptions& o) {
  auto op = begin("all_gather_single", {out}, !o.asyncOp, o.timeout);
  allgather_one(*op, out, in);
  return op->launch();
}

Backend::WorkPtr Backend::allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                          const c10d::AllgatherOptions& o) {
  auto op = begin("all_gather_single_coalesced", outs, !o.asyncOp, o.timeout);
  for (size_t i = 0; i < outs.size() && i < ins.size(); ++i) allgather_one(*op, outs[i], ins[i]);
  return op->launch();
}

Backend::WorkPtr Backend::allgather(TensorLists& outs_lists, Tensors& ins,
                                    const c10d::AllgatherOptions& o) {
  std::vector<at::Tensor> value;
  for (auto& l : outs_lists) value.insert(value.end(), l.begin(), l.end());
  auto op = begin("allgather", value, !o.asyncOp, o.timeout);
  if (ins.size() != 1 || outs_lists.size() != 1) unsupported(*op, "one tensor per process");
  one_device(*op, outs_lists[0], ins);
  at::Tensor x = ins[0];
  auto outs = outs_lists[0];
  const int n = getSize(), me = getRank();
  if (int(outs.size()) != n)
    fail("all_gather: " + std::to_string(outs.size()) + " outputs for a group of " +
         std::to_string(n));
  bool even = true, same_dtype = true;
  for (const auto& t : outs)
    even = even && t.numel() == x.numel(),
    same_dtype = same_dtype && t.scalar_type() == x.scalar_type();
  if (even) {
    at::Tensor flat = same_dtype ? flat_view(outs) : at::Tensor();
    if (!flat.defined()) {
      std::vector<int64_t> shape{n};
      for (auto d : x.sizes()) shape.push_back(d);
      flat = at::empty(shape, x.options());
      op->after([flat, outs]() mutable {
        for (size_t r = 0; r < outs.size(); ++r)
          write_bytes(outs[r], raw(flat[int64_t(r)].contiguous()));
      });
    }
    allgather_one(*op, flat, x);
  } else {  // uneven sizes: each rank broadcasts its own
    at::Tensor src = source(x);
    op->keep(src);
    for (int r = 0; r < n; ++r) {
      if (r == me) {
        plait_buffer b = bytes(src);
        op->issue(PLAIT_BROADCAST, &b, &b, PLAIT_SUM, r, -1, 0);
      } else {
        broadcast_one(*op, outs[size_t(r)], r);
      }
    }
    at::Tensor mine = outs[size_t(me)];
    op->after([mine, src]() mutable { mine.copy_(src.view(mine.sizes())); });
  }
  return op->launch();
}

Backend::WorkPtr Backend::allgather_coalesced(TensorLists& outs_lists, Tensors& ins,
                                              const c10d::AllgatherOptions& o) {
  std::vector<at::Tensor> value;
  for (auto& l : outs_lists) value.insert(value.end(), l.begin(), l.end());
  auto op = begin("allgather_coalesced", value, !o.asyncOp, o.timeout);
  one_device(*op, value, ins);
  std::vector<at::Tensor> parts;
  for (const auto& t : ins) parts.push_back(raw(source(t)));
  at::Tensor src = parts.empty() ? at::empty({0}, at::kByte) : at::cat(parts);
  at::Tensor stack = at::empty({getSize(), src.numel()}, src.options());  // bytes, src's device
  op->keep(src);
  plait_buffer a = bytes(src), b = bytes(stack);
  op->issue(PLAIT_ALLGATHER, &a, &b, PLAIT_SUM, 0, -1, 0);
  std::vector<int64_t> sizes;
  for (const auto& p : parts) sizes.push_back(p.numel());
  op->after([outs_lists, sizes, stack]() {
    for (size_t r = 0; r < outs_lists.size(); ++r) {
      int64_t off = 0;
      for (size_t i = 0; i < outs_lists[r].size() && i < sizes.size(); ++i) {
        write_bytes(outs_lists[r][i], stack[int64_t(r)].narrow(0, off, sizes[i]));
        off += sizes[i];
      }
    }
  });
  return op->launch();
}

void Backend::exchange(Op& op, const Tensors& srcs, const Tensors& dsts) {
  const int me = getRank();
  const auto& ms = srcs[size_t(me)];
  const auto& md = dsts[size_t(me)];
  if (ms.nbytes() != md.nbytes())
    fail("all_to_all: rank " + std::to_string(me) + " sends itself " + std::to_string(ms.numel()) +
         " elements but expects " + std::to_string(md.numel()));
  // GPU sends and receives wait for their match in stream order: of each pair, the lower rank
  // sends first and the higher receives first, so no chain of pairs can wait in a circle.
  const bool gpu = ms.is_cuda();
  for (int j = 0; j < getSize(); ++j) {
    if (j == me) continue;
    op.keep(srcs[size_t(j)]);
    op.keep(dsts[size_t(j)]);
    plait_buffer s = bytes(srcs[size_t(j)]), d = bytes(dsts[size_t(j)]);
    if (gpu && j < me) op.issue(PLAIT_RECV, nullptr, &d, PLAIT_SUM, 0, j, kTag);
    op.issue(PLAIT_SEND, &s, nullptr, PLAIT_SUM, 0, j, kTag);
    if (!gpu || j > me) op.issue(PLAIT_RECV, nullptr, &d, PLAIT_SUM, 0, j, kTag);
  }
  at::Tensor a = ms, b = md;
  op.after_first([a, b]() { raw(b).copy_(raw(a)); });
}

Backend::WorkPtr Backend::alltoall_base(at::Tensor& out, at::Tensor& in,
                                        std::vector<int64_t>& out_splits,
                                        std::vector<int64_t>& in_splits,
                                        const c10d::AllToAllOptions& o) {
  const int n = getSize();
  auto out_rows = splits(out, out_splits, n), in_rows = splits(in, in_splits, n);
  bool even = !out_rows.empty() && out_rows == in_rows;
  for (auto r : out_rows) even = even && r == out_rows[0];
  auto op = begin(even ? "all_to_all_single (even splits)"
                       : "all_to_all_single (input splits " + join(in_rows) + ", output splits " +
                             join(out_rows) + ")",
                  {out}, even && !o.asyncOp, o.timeout);
  if (out_rows.empty() || in_rows.empty())
    fail("all_to_all_single: " + std::to_string(nrows(out)) + " output rows split " +
         join(out_splits) + ", " + std::to_string(nrows(in)) + " input rows split " +
         join(in_splits) + ": not " + std::to_string(n) +
         " splits covering the rows (or, without splits, rows that divide evenly)");
  same_device(*op, in, out);
  at::Tensor dst = sink(*op, out);
  bool fresh = false;
  at::Tensor src = source(in, &fresh);
  if (!fresh && overlaps(src, dst) && !(even && same_bytes(src, dst))) src = src.clone();
  op->keep(src);
  op->keep(dst);
  if (even) {
    plait_buffer a = bytes(src), b = bytes(dst);
    op->issue(PLAIT_ALLTOALL, &a, &b, PLAIT_SUM, 0, -1, 0);
  } else {
    check_splits(*op, src, in_rows, dst, out_rows);
    exchange(*op, rows_of(src, in_rows), rows_of(dst, out_rows));
  }
  return op->launch();
}

// Uneven splits: every rank's byte counts, to and from each peer, gathered before any data moves
// and compared on every rank, so a disagreement raises on all of them at once instead of leaving
// a receive waiting out the deadline. A rank that took the even path instead runs a different
// collective there, which the call check reports as a mismatch at once.
void Backend::check_splits(const Op& op, const at::Tensor& src, const std::vector<int64_t>& in_rows,
                           const at::Tensor& dst, const std::vector<int64_t>& out_rows) {
  const int n = getSize();
  const int64_t in_row = nrows(src) ? int64_t(src.nbytes()) / nrows(src) : 0;
  const int64_t out_row = nrows(dst) ? int64_t(dst.nbytes()) / nrows(dst) : 0;
  at::Tensor mine = at::empty({2 * n}, at::kLong), table = at::empty({n, 2 * n}, at::kLong);
  for (int j = 0; j < n; ++j) {
    mine[j] = in_rows[size_t(j)] * in_row;
    mine[n + j] = out_rows[size_t(j)] * out_row;
  }
  plait_buffer a = typed(mine), b = typed(table);
  char err[1024];
  if (uint32_t kind = api_->call(comm_, PLAIT_ALLGATHER, &a, &b, PLAIT_SUM, 0, -1, 0, "auto",
                                 op.timeout_s, nullptr, nullptr, nullptr, err, sizeof err))
    throw error(kind, op.where(), err);
  auto t = table.accessor<int64_t, 2>();
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      if (t[i][j] != t[j][n + i])
        throw error(PLAIT_E_MISMATCH, op.where(),
                    "all_to_all_single: rank " + std::to_string(i) + " sends " +
                        std::to_string(t[i][j]) + " bytes to rank " + std::to_string(j) +
                        ", which expects " + std::to_string(t[j][n + i]) +
                        " bytes from it (this rank's input splits " + join(in_rows) +
                        ", output splits " + join(out_rows) + ")");
}

Backend::WorkPtr Backend::alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) {
  const int n = getSize();
  bool even = true;
  for (const auto& t : outs) even = even && t.nbytes() == ins.at(0).nbytes();
  for (const auto& t : ins) even = even && t.nbytes() == ins.at(0).nbytes();
  auto op = begin("alltoall", outs, even && !o.asyncOp, o.timeout);
  if (int(outs.size()) != n || int(ins.size()) != n)
    fail("all_to_all: " + std::to_string(ins.size()) + " inputs and " +
         std::to_string(outs.size()) + " outputs for a group of " + std::to_string(n));
  one_device(*op, outs, ins);
  if (even) {
    std::vector<at::Tensor> parts;
    for (const auto& t : ins) parts.push_back(raw(source(t)));
    at::Tensor src = at::cat(parts), flat = at::empty_like(src);
    op->keep(src);
    plait_buffer a = bytes(src), b = bytes(flat);
    op->issue(PLAIT_ALLTOALL, &a, &b, PLAIT_SUM, 0, -1, 0);
    const int64_t nb = flat.numel() / n;
    op->after([outs, flat, nb]() {
      for (size_t j = 0; j < outs.size(); ++j)
        write_bytes(outs[j], flat.narrow(0, int64_t(j) * nb, nb));
    });
  } else {
    std::vector<at::Tensor> dsts, srcs;
    for (const auto& t : outs) dsts.push_back(sink(*op, t));
    for (const auto& t : ins) {
      at::Tensor s = source(t);
      for (const auto& d : dsts)
        if (overlaps(s, d)) {
          s = s.clone();
          break;
        }
      srcs.push_back(s);
    }
    exchange(*op, srcs, dsts);
  }
  return op->launch();
}

Backend::WorkPtr Backend::gather(TensorLists& outs_lists, Tensors& ins,
                                 const c10d::GatherOptions& o) {
  const int root = int(o.rootRank), me = getRank();
  std::vector<at::Tensor> outs =
      me == root && !outs_lists.empty() ? outs_lists[0] : std::vector<at::Tensor>{};
  auto op = begin("gather", outs, false, o.timeout);
  one_tensor(*op, ins.size());
  one_device(*op, outs, ins);
  bool fresh = false;
  at::Tensor src = source(ins[0], &fresh);
  op->keep(src);
  if (me != root) {
    plait_buffer s = bytes(src);
    op->issue(PLAIT_SEND, &s, nullptr, PLAIT_SUM, 0, root, kTag);
    return op->launch();
  }
  if (int(outs.size()) != getSize())
    fail("gather: " + std::to_string(outs.size()) + " outputs for a group of " +
         std::to_string(getSize()));
  for (const auto& t : outs)
    if (!fresh && t.is_contiguous() && overlaps(src, t)) {
      src = src.clone();
      op->keep(src);
      break;
    }
  for (int r = 0; r < getSize(); ++r) {
    if (r == me) continue;
    at::Tensor d = sink(*op, outs[size_t(r)]);
    op->keep(d);
    plait_buffer b = bytes(d);
    op->issue(PLAIT_RECV, nullptr, &b, PLAIT_SUM, 0, r, kTag);
  }
  at::Tensor mine = outs[size_t(me)];
  op->after_first([mine, src]() mutable { mine.copy_(src.view(mine.sizes())); });
  return op->launch();
}

Backend::WorkPtr Backend::scatter(Tensors& outs, TensorLists& ins_lists,
                                  const c10d::ScatterOptions& o) {
  const int root = int(o.rootRank), me = getRank();
  auto op = begin("scatter", outs, false, o.timeout);
  one_tensor(*op, outs.size());
  one_device(*op, outs, me == root ? ins_lists.at(0) : Tensors{});
  at::Tensor out = outs[0];
  if (me != root) {
    at::Tensor d = sink(*op, out);
    op->keep(d);
    plait_buffer b = bytes(d);
    op->issue(PLAIT_RECV, nullptr, &b, PLAIT_SUM, 0, root, kTag);
    return op->launch();
  }
  const auto& ins = ins_lists.at(0);
  if (int(ins.size()) != getSize())
    fail("scatter: " + std::to_string(ins.size()) + " inputs for a group of " +
         std::to_string(getSize()));
  for (int r = 0; r < getSize(); ++r) {
    if (r == me) continue;
    at::Tensor s = source(ins[size_t(r)]);
    op->keep(s);
    plait_buffer b = bytes(s);
    op->issue(PLAIT_SEND, &b, nullptr, PLAIT_SUM, 0, r, kTag);
  }
  at::Tensor mine = ins[size_t(me)].clone();
  op->after_first([out, mine]() mutable { out.copy_(mine.view(out.sizes())); });
  return op->launch();
}

Backend::WorkPtr Backend::send(Tensors& ts, int dst, int tag) {
  auto op = begin("send to rank " + std::to_string(dst), ts, false);
  one_tensor(*op, ts.size());
  on_device(*op, ts[0]);
  at::Tensor s = source(ts[0]);
  op->keep(s);
  plait_buffer b = bytes(s);
  op->issue(PLAIT_SEND, &b, nullptr, PLAIT_SUM, 0, dst, tag);
  return op->launch();
}

Backend::WorkPtr Backend::recv(Tensors& ts, int src, int tag) {
  auto op = begin("recv from rank " + std::to_string(src), ts, false);
  one_tensor(*op, ts.size());
  on_device(*op, ts[0]);
  at::Tensor d = sink(*op, ts[0]);
  op->keep(d);
  plait_buffer b = bytes(d);
  op->issue(PLAIT_RECV, nullptr, &b, PLAIT_SUM, 0, src, tag);
  return op->launch();
}

Backend::WorkPtr Backend::recvAnysource(Tensors& ts, int tag) {
  auto op = begin("recv from any source", ts, false);
  one_tensor(*op, ts.size());
  on_device(*op, ts[0]);
  if (ts[0].is_cuda())
    unsupported(*op,
                "a CUDA tensor: plait's GPU path (NCCL) has no any-source receive; pass the "
                "source rank");
  at::Tensor d = sink(*op, ts[0]);
  op->keep(d);
  plait_buffer b = bytes(d);
  op->issue(PLAIT_RECV, nullptr, &b, PLAIT_SUM, 0, PLAIT_ANY_SOURCE, tag);
  return op->launch();
}

Backend::WorkPtr Backend::barrier(const c10d::BarrierOptions& o) {
  auto op = begin("barrier", {}, !o.asyncOp, o.timeout);
  op->issue(PLAIT_BARRIER, nullptr, nullptr, PLAIT_SUM, 0, -1, 0);
  return op->launch();
}

}  // namespace plait_torch
