// The expert exchanges of parallel/expert_parallel.h run whole, start then finish at once,
// as the tests call them (the decoder finishes each a stage after its start).
#pragma once

#include "parallel/expert_parallel.h"

namespace mt::test {

inline void ep_dispatch_forward(comm::Communicator& ep, const parallel::EpPlan& plan, const Tensor& x,
                                const Tensor& xs) {
  parallel::EpExchange ex = parallel::ep_dispatch_forward_start(ep, plan, x);
  parallel::ep_dispatch_forward_finish(ex, plan, xs);
}

inline void ep_dispatch_backward(comm::Communicator& ep, const parallel::EpPlan& plan, const Tensor& dxs,
                                 const Tensor& dx) {
  parallel::EpExchange ex = parallel::ep_dispatch_backward_start(ep, plan, dxs);
  parallel::ep_dispatch_backward_finish(ex, plan, dx);
}

inline void ep_combine_forward(comm::Communicator& ep, const parallel::EpPlan& plan, const Tensor& ys,
                               const Tensor& weight, const Tensor& back, const Tensor& y) {
  parallel::EpExchange ex = parallel::ep_combine_forward_start(ep, plan, ys, back);
  parallel::ep_combine_forward_finish(ex, plan, weight, y);
}

inline void ep_combine_backward(comm::Communicator& ep, const parallel::EpPlan& plan, const Tensor& back,
                                const Tensor& weight, const Tensor& dy, const Tensor& dys, const Tensor& dweight) {
  parallel::EpExchange ex = parallel::ep_combine_backward_start(ep, plan, back, weight, dy, dweight);
  parallel::ep_combine_backward_finish(ex, plan, dys);
}

}  // namespace mt::test
