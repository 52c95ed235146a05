#include <sstream>

#include "kernels/embedding.h"
#include "ops/cases.h"

namespace mt::test {

OpCase embedding_case(int64_t vocab, int64_t dim, int64_t tokens) {
  std::ostringstream name;
  name << "embedding V=" << vocab << " D=" << dim << " N=" << tokens;
  // More tokens than rows for most cases, so ids repeat and gradients accumulate.
  std::vector<int32_t> ids = random_ints(vocab * 131 + tokens, tokens, 0, static_cast<int32_t>(vocab - 1));
  OpCase c;
  c.name = name.str();
  c.inputs = {{"table", {vocab, dim}}};
  c.outputs = {{"out"}};
  c.reference = [=](const Vecs& in) {
    Vec out(tokens * dim);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < dim; ++j) out[t * dim + j] = in[0][ids[t] * dim + j];
    return Vecs{out};
  };
  c.forward = [=](const Vecs& in) {
    auto table = HostTensor::f32({vocab, dim}, in[0]);
    auto id = HostTensor::i32({tokens}, ids);
    auto out = HostTensor::zeros({tokens, dim});
    cpu::embedding_forward(table.t, id.t, out.t);
    return Vecs{out.vec()};
  };
  c.backward = [=](const Vecs&, const Vecs& dout) {
    auto id = HostTensor::i32({tokens}, ids);
    auto dy = HostTensor::f32({tokens, dim}, dout[0]);
    auto dtable = HostTensor::zeros({vocab, dim});
    cpu::embedding_backward(id.t, dy.t, dtable.t);
    return Vecs{dtable.vec()};
  };
  return c;
}

}  // namespace mt::test
