// moetrain plan: the mesh and the memory a run will hold, from the same allocation
// code that training uses (arenas in counting mode), before anything is launched; with
// --schedule, each pp rank's timeline of the step played out by train/schedule.h's
// simulate, drawn as SVG, with the bubble and (given a profile) the step time; with
// --routing, a run's recorded expert loads played against replica placements. What
// it reads back from a run (a profiled step, the routing) is train/profile.h's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>

#include "cli/commands.h"
#include "comm/mesh.h"
#include "core/arena.h"
#include "core/check.h"
#include "io/file.h"
#include "models/interface.h"
#include "parallel/sharding.h"
#include "parallel/zero3.h"
#include "train/config.h"
#include "train/optimizer.h"
#include "train/profile.h"
#include "train/progress.h"
#include "train/schedule.h"
#include "train/trainer.h"

namespace mt::cli {

namespace {

// F (forward, blue), B (input gradient, green), W (weight gradient, orange), each in a
// dark shade for a rank's first chunk and a light one for its second; grey for the rest.
char kind_of(Op op) {
  switch (op) {
    case Op::load: case Op::embed_forward: case Op::forward: case Op::finish_forward:
    case Op::head_forward: case Op::statistics: return 'F';
    case Op::head_backward_input: case Op::backward_input: case Op::finish_backward_input: return 'B';
    case Op::head_backward_weight: case Op::backward_weight: case Op::embed_backward: return 'W';
    default: return 'o';
  }
}

std::string timeline_svg(const Timeline& t, const Pipeline& p, const std::string& title) {
  const double left = 60, width = 1100, row = 34, top = 48;
  const double scale = t.step > 0 ? width / t.step : 0;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 10 << "\" height=\""
    << top + row * static_cast<double>(t.ranks.size()) + 10 << "\" font-family=\"sans-serif\" font-size=\"10\">\n"
    << "<text x=\"4\" y=\"14\" font-size=\"12\">" << title << "</text>\n";
  const std::map<std::string, std::string> colour = {{"F0", "#2f6db5"}, {"F1", "#8fb8e8"}, {"B0", "#2f8f3a"},
                                                     {"B1", "#95d68f"}, {"W0", "#d9730d"}, {"W1", "#f7bf7f"},
                                                     {"o0", "#777777"}, {"o1", "#777777"}};
  const char* legend[] = {"F0", "F1", "B0", "B1", "W0", "W1"};
  for (int i = 0; i < 6; ++i)
    s << "<rect x=\"" << left + 80 * i << "\" y=\"22\" width=\"12\" height=\"12\" fill=\"" << colour.at(legend[i])
      << "\"/><text x=\"" << left + 80 * i + 16 << "\" y=\"32\">" << legend[i][0] << " chunk " << legend[i][1] - '0' + 1
      << "</text>\n";
  s << "<text x=\"" << left + 500 << "\" y=\"32\">grey: idle; numbers: micro-batches</text>\n";
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    const double y = top + row * static_cast<double>(r);
    s << "<text x=\"4\" y=\"" << y + 16 << "\">rank " << r << "</text><rect x=\"" << left << "\" y=\"" << y
      << "\" width=\"" << width << "\" height=\"" << row - 4 << "\" fill=\"#d8d8d8\"/>\n";
    // A lane each for F, B and W (and the rest); boxes of one kind, chunk and micro-batch
    // with no idle time between them are one bar, so a forward interleaved stage by stage
    // with another micro-batch's backward shows as two bars side by side.
    struct Bar {
      double start, end;
    };
    std::map<std::string, Bar> open;
    double busy_since = 0;  // the end of the rank's latest idle time
    auto draw = [&](const std::string& k, const Bar& b) {
      const double lane = (row - 4) / 3, x = left + b.start * scale, w = (b.end - b.start) * scale;
      const double dy = lane * static_cast<double>(std::string("FBW").find(k[0]) % 3);
      const std::string label = k.substr(2);
      s << "<rect x=\"" << x << "\" y=\"" << y + dy << "\" width=\"" << w << "\" height=\"" << lane << "\" fill=\""
        << colour.at(k.substr(0, 2)) << "\"/>";
      if (w >= 6.0 * static_cast<double>(label.size()))
        s << "<text x=\"" << x + w / 2 << "\" y=\"" << y + dy + lane - 1.5 << "\" font-size=\"8\" "
          << "text-anchor=\"middle\" fill=\"" << (k[1] == '1' ? "#000" : "#fff") << "\">" << label << "</text>";
      s << "\n";
    };
    double previous_end = 0;
    for (const Timeline::Box& b : t.ranks[r]) {
      if (b.start > previous_end + 1e-9 * t.step) busy_since = b.start;
      previous_end = b.end;
      std::string k(1, kind_of(b.action.op));  // kind, chunk, micro-batch: "F13"
      k.append(std::to_string(p.phase_of(static_cast<int>(r), b.action.layer)))
          .append(std::to_string(b.action.micro_batch));
      auto it = open.find(k);
      if (it != open.end() && it->second.end + 1e-9 * t.step >= busy_since) {
        it->second.end = b.end;
        continue;
      }
      if (it != open.end()) draw(k, it->second);
      open[k] = {b.start, b.end};
    }
    for (const auto& [k, bar] : open) draw(k, bar);
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace

int run_plan(const Args& args) {
  Options o("plan", args, {"config", "world", "schedule?", "profile", "output", "routing-skew", "routing"});
  Config cfg = load_config(o.get("config"), o.dotted());
  MT_CHECK(o.has("schedule") || (!o.has("profile") && !o.has("output")))
      << "--profile and --output describe the schedule's picture: add --schedule";
  const int world = static_cast<int>(o.integer("world", 1, 1, int64_t{1} << 20));
  comm::MeshShape mesh = comm::mesh_shape(world, static_cast<int>(cfg.parallelism.pp),
                                          static_cast<int>(cfg.parallelism.cp), static_cast<int>(cfg.parallelism.ep));
  ModelOptions options = model_options(cfg);
  options.plan_only = true;
  const std::unique_ptr<Model> whole = make_model(model_config_path(cfg), options);
  const int64_t L = whole->num_layers();
  const Pipeline pipeline = Trainer::pipeline_of(cfg, L);
  // The hottest rank's expert rows over the mean, for the bound printed beside the balanced
  // figure. The default: UltraEP (arXiv 2606.04101) measured the busiest rank at 1.30-4.01
  // times the mean for MoE models of 106B-671B without rebalancing, at large ep; at ep 8
  // with a balance term a trained model sits near the low end, and 1.5 leaves room above it.
  const double skew = o.has("routing-skew") ? std::stod(o.get("routing-skew")) : 1.5;
  MT_CHECK(skew >= 1.0 && skew <= 1e6) << "--routing-skew " << skew
                                       << ": the hottest rank's rows over the mean, at least 1";
  const StepShape sizes = step_shape(cfg, mesh);
  const int64_t seq = sizes.seq, global = sizes.global_batch, micro = sizes.micro_batch;
  const bool zero3 = cfg.parallelism.zero3 && world > 1;
  const ScheduleShape shape = schedule_shape(cfg, L, sizes.micro_batches, zero3, mesh.dp * mesh.cp * mesh.ep > 1);
  std::vector<std::vector<Action>> schedules;
  for (int r = 0; r < mesh.pp; ++r) schedules.push_back(make_schedule(shape, pipeline, r));

  std::printf("mesh: world %d = pp %d x dp %d x cp %d x ep %d\n", world, mesh.pp, mesh.dp, mesh.cp, mesh.ep);
  std::printf("model: %lld layers, %s parameters (%s active per token), device %s\n", static_cast<long long>(L),
              count_text(static_cast<double>(whole->param_count())).c_str(),
              count_text(static_cast<double>(whole->active_param_count())).c_str(), cfg.training.device.c_str());
  if (mesh.pp > 1) {
    std::printf("pipeline: %s, %d chunks of layers", pipeline.dualpipev ? "dualpipev" : "1f1b", pipeline.chunks());
    for (int c = 0; c < pipeline.chunks(); ++c)
      std::printf(" %lld-%lld", static_cast<long long>(pipeline.bounds[c]),
                  static_cast<long long>(pipeline.bounds[c + 1] - 1));
    if (L % pipeline.chunks() != 0)
      std::printf(" (%lld layers do not divide into %d chunks: the first %lld hold one more)",
                  static_cast<long long>(L), pipeline.chunks(), static_cast<long long>(L % pipeline.chunks()));
    std::printf(", %d micro-batches a step\n", shape.micro_batches);
  }
  if (zero3)
    std::printf("per rank (with zero3 the layers' weights live in the AdamW shards, the embedding and\n"
                "head in full):\n");
  else
    std::printf("per rank (1/ep of the experts; weights and accumulating gradients are sharded only\n"
                "with zero3):\n");
  std::vector<size_t> offload_traffic;  // each pp rank's, for the step's prediction below
  for (int r = 0; r < mesh.pp; ++r) {
    const MemoryPlan m = plan_memory(cfg, world, r, skew);
    offload_traffic.push_back(m.offload_traffic + std::max(m.cache_in, m.cache_out));
    const size_t total = m.total();
    // One unit for the table, the one train's step line would use for the total.
    const bool mib = total < (size_t{1} << 30);
    const char* unit = mib ? "MiB" : "GiB";
    auto in = [&](size_t bytes) {
      return static_cast<double>(bytes) / static_cast<double>(size_t{1} << (mib ? 20 : 30));
    };
    if (mesh.pp > 1)
      std::printf(" pp rank %d: %zu layers%s%s\n", r, m.layers, m.embedding ? ", the embedding" : "",
                  m.head ? ", the head" : "");
    std::printf("  master weights (f32)      %10.3f %s%s\n", in(m.weights), unit, zero3 ? " (embedding and head)" : "");
    std::printf("  gradients (f32)           %10.3f %s%s\n", in(m.gradients), unit, zero3 ? " (embedding and head)" : "");
    if (m.sharded) {
      // Experts shard over dp x cp; a group of one has no gradient shard (sharding.h).
      const int experts = mesh.ep > 1 ? mesh.dp * mesh.cp : m.replicas;
      std::string also;
      if (experts == 1 && !zero3)
        also = "; the experts' moments only, over 1: their own gradients are their sums";
      else if (experts != m.replicas)
        also = "; the experts' over " + std::to_string(experts);
      std::printf("  AdamW shards              %10.3f %s (moments and summed gradients%s over %d ranks%s)\n",
                  in(m.optimizer), unit, zero3 ? ", layers' weights" : "", m.replicas, also.c_str());
    } else {
      std::printf("  AdamW moments (2 x %s)  %10.3f %s\n", cfg.optimizer.state() == DType::bf16 ? "bf16" : "f32 ",
                  in(m.optimizer), unit);
    }
    std::printf("  %-26s%10.3f %s\n", cfg.training.fp8 == "blockwise" ? "bf16 and fp8 weight copies" : "bf16 weight copies",
                in(m.compute), unit);
    if (zero3)
      std::printf("  zero3 layer slots         %10.3f %s (two layers' weights and copies, two layers' gradients)\n",
                  in(m.slot), unit);
    std::printf("  activations               %10.3f %s (micro-batches of %lld x %lld tokens in flight: %s)\n",
                in(m.activations), unit, static_cast<long long>(micro), static_cast<long long>(seq / mesh.cp),
                m.in_flight.c_str());
    std::printf("  expert rows               %10.3f %s (balanced routing; the most held at once)\n", in(m.rows), unit);
    if (cfg.offload.experts == "weights")
      std::printf("  expert cache              %10.3f %s (offload.gpu_expert_slots' experts: weights and gradients)\n",
                  in(m.expert_cache), unit);
    if (m.expert_replicas > 0)
      std::printf("  expert replicas           %10.3f %s (parallelism.expert_replicas' slots a MoE layer: weights and "
                  "gradients)\n", in(m.expert_replicas), unit);
    std::printf("  total                     %10.3f %s (%zu bytes)\n", in(total), unit, total);
    std::printf("  at routing skew %-9g %10.3f %s (%zu bytes; expert rows %zu bytes: the hottest rank gets %g x its "
                "share)\n",
                skew, in(m.total_skewed()), unit, m.total_skewed(), m.rows_skewed, skew);
    if (m.host > 0) {
      // The update streams the offloaded blocks in and out once a step (train/offload.h),
      // at the rate measured on the H200 machine's pinned buffers.
      std::printf("  host memory (offload)     %10.3f %s (%zu bytes: the routed experts' master weights and moments%s; "
                  "the host has %.3f GiB free)\n",
                  in(m.host), unit, m.host,
                  cfg.offload.experts == "weights" ? ", compute copies and gradients" : "",
                  static_cast<double>(available_host_memory()) / (1 << 30));
      std::printf("  offload traffic a step    %10.3f %s each way: %.1f ms a direction at %.0f GB/s\n",
                  in(m.offload_traffic), unit,
                  1e3 * static_cast<double>(m.offload_traffic) / kPcieBytesPerSecond, kPcieBytesPerSecond / 1e9);
      if (cfg.offload.experts == "weights")
        std::printf("  expert cache a step       %10.3f %s in, %.3f %s out (at most): %.1f ms at %.0f GB/s\n",
                    in(m.cache_in), unit, in(m.cache_out), unit,
                    1e3 * static_cast<double>(std::max(m.cache_in, m.cache_out)) / kPcieBytesPerSecond,
                    kPcieBytesPerSecond / 1e9);
    }
    if (cfg.training.device_memory_limit > 0) {
      const double limit = cfg.training.device_memory_limit * static_cast<double>(size_t{1} << 30);
      std::printf("  training.device_memory_limit %7.3f GiB: %s\n", cfg.training.device_memory_limit,
                  static_cast<double>(total) > limit             ? "the plan does not fit (train refuses it)"
                  : static_cast<double>(m.total_skewed()) > limit ? "the plan fits, not at the skew"
                                                                  : "the plan fits, at the skew too");
    }
  }
  // A replica slot's traffic a step: its bf16 weights in after the update, its f32
  // gradients out to the owner (models/expert_replicas.h), per MoE layer the busiest pp
  // rank holds. The ep links' rate is assumed: no multi-GPU machine measured it yet.
  constexpr double kEpLinkBytesPerSecond = 350e9;  // NVLink 4, about 450 GB/s a way, at NCCL's ~75%
  double expert_elements = 0;  // one expert's parameters, all MoE layers
  for (const Param& p : whole->params())
    if (p.expert) expert_elements += static_cast<double>(p.value.numel()) / static_cast<double>(whole->num_experts());
  int64_t moe_layers = 0, most_moe = 0;
  for (int64_t l = 0; l < whole->all_layers(); ++l) moe_layers += whole->is_moe_layer(l);
  for (int r = 0; r < mesh.pp; ++r) {
    int64_t n = 0;
    for (int64_t l : pipeline.layers_of(r)) n += whole->is_moe_layer(l);
    for (int64_t l = L; l < whole->all_layers() && pipeline.owner(L) == r; ++l) n += whole->is_moe_layer(l);  // MTP's
    most_moe = std::max(most_moe, n);
  }
  const double slot_bytes = moe_layers > 0 ? 6.0 * expert_elements / static_cast<double>(moe_layers) *
                                                 static_cast<double>(most_moe)
                                           : 0.0;  // a replica slot of every MoE layer a rank holds
  std::vector<RoutingSkew> skews;
  if (o.has("routing")) {
    int64_t steps = 0;
    skews = routing_skews(o.get("routing"), whole->num_experts(), mesh.ep, cfg.parallelism.replan_interval, &steps);
    std::printf("routing of %s (%lld steps) at ep %d, the placement planned from the moving average of the steps "
                "before (parallel/placement.h), again every %lld steps (parallelism.replan_interval), the copies' "
                "shares of the rows every step:\n",
                o.get("routing").c_str(), static_cast<long long>(steps), mesh.ep,
                static_cast<long long>(cfg.parallelism.replan_interval));
    for (const RoutingSkew& k : skews)
      std::printf("  expert_replicas %lld: %lld expert slots a rank, the busiest rank's rows %.3f x the mean (worst %.3f)"
                  "; the replicas move %.1f MB a rank a step\n", static_cast<long long>(k.replicas),
                  static_cast<long long>(whole->num_experts() / mesh.ep + k.replicas), k.mean, k.worst,
                  static_cast<double>(k.replicas) * slot_bytes / 1e6);
  }
  if (!o.has("schedule")) return 0;

  // Without a profile every layer's F, B and W cost one unit (spread over its stages),
  // the embedding and head nothing: the DualPipe paper's comparison.
  const bool profiled = o.has("profile");
  const StepCosts costs = profiled ? read_profile(o.get("profile")) : StepCosts{};
  auto cost = [&](int, const Action& a) {
    if (profiled) {
      auto it = costs.per_action.find(profile_name(a));
      return it == costs.per_action.end() ? 0.0 : it->second;
    }
    return a.op == Op::forward || a.op == Op::backward_input || a.op == Op::backward_weight ? 0.2 : 0.0;
  };
  const Timeline t = simulate(schedules, pipeline, cost);
  const char* unit = profiled ? " ms" : " units (one layer's F)";
  const std::string name = mesh.pp == 1 && !pipeline.dualpipev ? "sequential" : pipeline.dualpipev ? "dualpipev" : "1f1b";
  std::printf("schedule: %s, pp %d, %d micro-batches of %lld x %lld tokens\n", name.c_str(), mesh.pp,
              shape.micro_batches, static_cast<long long>(micro), static_cast<long long>(seq / mesh.cp));
  std::printf("  forward and backward  %.3f%s, bubble %.2f%% (idle share of pp x that time)\n", t.step, unit,
              100.0 * t.bubble());
  if (profiled) {
    // Each rank then updates its own layers' weights: the profile's optimizer and norm
    // time per layer, times the rank's layers; the slowest rank ends the step.
    // With offload.experts the offloaded blocks' transfers come on top, in at the
    // rate a direction (the copies out overlap the next chunk's in).
    double step = 0, offload = 0;
    for (int r = 0; r < mesh.pp; ++r) {
      const double moved = 1e3 * static_cast<double>(offload_traffic[static_cast<size_t>(r)]) / kPcieBytesPerSecond;
      offload = std::max(offload, moved);
      step = std::max(step, t.step + moved +
                                costs.optimizer_per_layer * static_cast<double>(pipeline.layers_of(r).size()));
    }
    if (offload > 0)
      std::printf("  offloaded update's transfers  %.3f ms (at %.0f GB/s), against %.3f ms of forward and backward\n",
                  offload, kPcieBytesPerSecond / 1e9, t.step);
    const double tokens = static_cast<double>(global * seq);
    std::printf("  step (with the optimizer)  %.3f ms: %.0f tokens/s, %.0f tokens/s a GPU\n", step,
                tokens / (step / 1e3), tokens / (step / 1e3) / world);
    // The expert stages wait for the busiest rank: the profile's times (one GPU's,
    // balanced as it ran) times its rows over the mean; the replicas' weight copies and
    // gradient sums come on top, unhidden, at the assumed ep link rate.
    for (const RoutingSkew& k : skews) {
      const Timeline sk = simulate(schedules, pipeline, [&](int r, const Action& a) {
        return cost(r, a) * (std::string(profile_name(a)).rfind("experts", 0) == 0 ? k.mean : 1.0);
      });
      const double moves = 1e3 * static_cast<double>(k.replicas) * slot_bytes / kEpLinkBytesPerSecond;
      std::printf("  with the routing, expert_replicas %lld: forward and backward %.3f ms, replica moves %.3f ms "
                  "(at an assumed %.0f GB/s), step %.3f ms\n", static_cast<long long>(k.replicas), sk.step, moves,
                  kEpLinkBytesPerSecond / 1e9, step - t.step + sk.step + moves);
    }
  }
  const std::string out = o.get("output", "schedule.svg");
  char title[256];
  std::snprintf(title, sizeof title, "%s, pp %d, %d micro-batches: %.3f%s forward and backward, bubble %.2f%%",
                name.c_str(), mesh.pp, shape.micro_batches, t.step, unit, 100.0 * t.bubble());
  io::write_file_atomic(out, {timeline_svg(t, pipeline, title)});
  std::printf("  timeline written to %s\n", out.c_str());
  return 0;
}

}  // namespace mt::cli
