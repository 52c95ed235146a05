#!/usr/bin/env python3
"""A MoE model cut to N layers on one GPU: moetrain against transformers, same run.

The model is a config.json (--config; default Qwen3-30B-A3B cut to --layers 8 or 4):
qwen3_moe, deepseek_v2 (bench/configs/deepseek_v2_lite_8l.json: DeepSeek-V2-Lite as
released, cut to 8 layers) or gpt_oss (bench/configs/gpt_oss_20b_4l.json: GPT-OSS-20B
in bf16, cut to 4 layers; eager attention in transformers, whose sdpa takes no sinks) or
deepseek_v3 (bench/configs/moonlight_16b_a3b_8l.json: Moonlight-16B-A3B as released, cut
to 8 layers, as released without multi-token prediction (--mtp 1 adds a depth); bench/configs/deepseek_v3_4l.json: DeepSeek-V3's
own shape cut to its 3 dense layers and 1 MoE layer (and its MTP depth: --mtp 0 for none)
or qwen3_5_moe_text (bench/configs/qwen3_5_35b_a3b_8l.json: Qwen3.5-35B-A3B cut to 6 gated
DeltaNet and 2 gated full-attention layers; 149 GiB with fp32 moments, so --state-dtypes
bf16 on one H200 (120 GiB by `moetrain plan`); qwen3_5_35b_a3b_4l.json, 3 + 1 layers, for
transformers, whose fp32 AdamW does not hold the 8 layers).
One H200 holds it only without the depth (another MoE layer of 256 experts: 215.7 GiB
even offloaded), with --mtp 0 --extra "--offload.experts=optimizer" --state-dtypes bf16
--batch 1 --micro-batches 16 (128.1 GiB on the GPU, 84 GiB of host memory by `moetrain
plan`) and --skip-baseline: transformers needs 253 GiB).

Each optimizer step accumulates --micro-batches M micro-batches of --batch x --seq tokens
(default 8 of 2 x 4096: a real training batch, where the optimizer is a small share of
the step), moetrain and the baseline alike.

Measures, in one process tree on one GPU:
  - the bf16 GEMM peak (torch.matmul 8192^3), the denominator of MFU;
  - the baseline: transformers' model for the config (sdpa attention, grouped_mm
    experts, bf16 autocast over fp32 master weights, fused AdamW), eager and under
    torch.compile;
  - moetrain: `moetrain train --training.device=cuda` on the same shapes (bf16
    compute, fp32 master weights, AdamW with fp32 moments, or bf16 ones with
    --state-dtypes), learned routing and forced-balanced routing. Its memory is what
    the process holds on the device (measured: pools, workspaces, handles), against
    torch's max_memory_allocated for the baseline.
Model FLOPs per token = 6 * active parameters + attention (6 * H * (Dqk + Dv) per layer and
visible key: (S + 1) / 2 keys causal, at most the window on sliding layers), active =
attention + router + top-k and shared experts + dense MLPs + LM head.
Prints one markdown row per system for bench/RESULTS.md.

  python3 bench/moe_bench.py --moetrain build/moetrain --layers 8 [--skip-baseline] [--micro-batches 1]
  python3 bench/moe_bench.py --moetrain build/moetrain --config bench/configs/deepseek_v2_lite_8l.json
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def flops_per_token(cfg, seq):
    d, h, v, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"], cfg["num_hidden_layers"]
    k, i = cfg["num_experts_per_tok"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    if cfg["model_type"] in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        dn, dr, dv, r, rq = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"],
                             cfg.get("q_lora_rank") or 0)
        dq = dn + dr
        q = d * rq + rq * h * dq if rq else d * h * dq
        attention = q + d * (r + dr) + r * h * (dn + dv) + h * dv * d
        e, shared = cfg["n_routed_experts"], cfg.get("n_shared_experts") or 0
        dense = min(cfg.get("first_k_dense_replace", 0), layers)
        mlp = (layers - dense) * (d * e + (k + shared) * 3 * d * i) + dense * 3 * d * cfg["intermediate_size"]
    else:
        dq = dv = cfg["head_dim"]
        gate = 2 if cfg.get("attn_output_gate") else 1  # Qwen3.5: q_proj also yields the output gate
        attention = gate * d * h * dq + 2 * d * cfg["num_key_value_heads"] * dq + h * dq * d
        shared = cfg.get("shared_expert_intermediate_size") or 0
        mlp = layers * (d * cfg.get("num_experts", cfg.get("num_local_experts", 0)) + k * 3 * d * i
                        + (3 * d * shared + d if shared else 0))
    # Attention: 12 * H * (Dqk + Dv) / 2 FLOPs per visible key (QK and PV, forward and
    # backward); a causal row sees (S + 1) / 2 keys on average, a sliding one at most W.
    # Qwen3.5's linear_attention layers (gated DeltaNet) have no keys to count: their
    # projections ([qkv | z | b | a] and out) count as parameters, and the rule as its
    # recurrent form's three Dk x Dv products a token and value head (S^T k, the rank-one
    # update, S^T q), times 3 for training; the chunked form does more (its C x C blocks),
    # as flash attention's recomputation is not counted either.
    window = cfg.get("sliding_window") or seq
    kinds = cfg.get("layer_types") or ["full_attention"] * layers
    linear = sum(kind == "linear_attention" for kind in kinds)
    keys = [sum(min(t + 1, window if kind == "sliding_attention" else seq) for t in range(seq)) / seq
            for kind in kinds if kind != "linear_attention"]
    active = (layers - linear) * attention + mlp + v * d
    rule = 0
    if linear:
        hk, hv, dk_, dv_ = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                            cfg["linear_value_head_dim"])
        active += linear * (d * (2 * hk * dk_ + 2 * hv * dv_ + 2 * hv) + hv * dv_ * d)
        rule = linear * 3 * hv * 2 * 3 * dk_ * dv_
    # DeepSeek-V3's multi-token prediction depths, where moetrain builds them: each one
    # more MoE layer, eh_proj [D, 2D] and the head again, on every position.
    depths = (cfg.get("num_nextn_predict_layers") or 0) if cfg["model_type"] in ("deepseek_v3", "kimi_k2") else 0
    if depths:
        active += depths * (attention + d * e + (k + shared) * 3 * d * i + 2 * d * d + v * d)
        keys += keys[-1:] * depths
    return 6 * active + sum(6 * h * (dq + dv) * n for n in keys) + rule, active


def gemm_peak(fp8=False):
    """An 8192^3 product's TFLOPS: bf16, or e4m3 through torch._scaled_mm (one scale per
    tensor, the fastest FP8 form there is, so block-scaled rows compare against it)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        one = torch.ones((), device="cuda")
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        mm = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        mm = lambda: a @ b
    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        mm()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / sorted(times)[len(times) // 2] / 1e12


def baseline(cfg, batch, seq, steps, warmup, compiled, micro_batches=1):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                      if k not in ("architectures", "model_type", "torch_dtype")})
    conf._attn_implementation = "eager" if cfg["model_type"] == "gpt_oss" else "sdpa"  # sdpa takes no sinks
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(conf).float()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm")
    for m in model.modules():  # Qwen3.5: which gated delta rule transformers runs
        rule = getattr(m, "chunk_gated_delta_rule", None)
        if rule is not None:
            print(f"  transformers' gated delta rule: {getattr(rule, '__module__', '?')}."
                  f"{getattr(rule, '__name__', type(rule).__name__)}", flush=True)
            break
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, cfg["vocab_size"], (micro_batches, batch, seq + 1), device="cuda")

    def micro(t):
        # The mean over the step's tokens: each micro-batch's loss weighs 1 / M.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=t[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))
        (loss / micro_batches).backward()
        return loss

    # Compiled: each micro-batch's forward and backward (one graph, reused M times); the
    # fused AdamW runs as it is.
    run_micro = torch.compile(micro) if compiled else micro

    def fn():
        for m in range(micro_batches):
            run_micro(tokens[m])
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return micro_batches * batch * seq / dt, peak


def ours(binary, cfg_path, batch, seq, steps, warmup, balanced, vocab, ranks=1, ep=1, cp=1, extra=(), pp=1,
         schedule="dualpipev", micro_batches=1):
    """`micro_batches` micro-batches of `batch` sequences per data rank (dp x ep = ranks /
    (pp x cp) of them) a step; tokens/s for the job. With pp > 1 a pipeline stage a GPU,
    micro-batches of one sequence (DualPipeV needs 2 x pp of them per data rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = micro_batches * batch * ranks // (cp * pp)
        extra = (f"--training.global_batch_size={rows}", f"--training.micro_batch_size={1 if pp > 1 else batch}",
                 *extra)
        if pp > 1:
            extra = (f"--parallelism.pp={pp}", f"--parallelism.pipeline_schedule={schedule}", *extra)
        tokens = np.random.default_rng(0).integers(0, vocab, size=(rows, seq + 1), dtype=np.int64)
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        launch = []
        if ranks > 1:
            # One process per GPU; NVLink multicast stays off (the device README says why).
            launch = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), "-x", "NCCL_NVLS_ENABLE=0",
                      "-x", "LD_LIBRARY_PATH"]
        cmd = launch + [binary, "train", f"--parallelism.ep={ep}", f"--parallelism.cp={cp}", f"--model.config={cfg_path}", f"--data.tokens={tmp}/tokens.npy",
               f"--training.steps={warmup + steps}", "--training.device=cuda", f"--job.dump_folder={tmp}/run",
               "--optimizer.lr=1e-4", "--training.clip_grad_norm=1.0", "--training.load_balance_coef=0.001",
               f"--training.force_balanced_routing={'true' if balanced else 'false'}", "--metrics.profile=true",
               "--checkpoint.save_final=false", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
        if out.returncode != 0:
            raise RuntimeError(f"moetrain failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows = [json.loads(l) for l in open(f"{tmp}/run/metrics.jsonl")]  # rank 0's
        timed = rows[warmup:]
        tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
        breakdown = rows[-1].get("breakdown_ms", {})
        total = sum(breakdown.values()) or 1.0
        print("  step time by stage: " + ", ".join(f"{k} {v:.1f} ms ({100*v/total:.0f}%)"
                                                   for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1])),
              flush=True)
        if "offload_bytes_in" in rows[-1]:
            last = rows[-1]
            gbs = (last["offload_bytes_in"] + last["offload_bytes_out"]) / max(last["offload_s"], 1e-9) / 1e9
            print(f"  offload: {last['host_memory_bytes']/1e9:.1f} GB in host memory; offload moved "
                  f"{last['offload_bytes_in']/1e9:.1f} GB in and {last['offload_bytes_out']/1e9:.1f} GB out in "
                  f"a step; the update took {1e3*last['offload_s']:.0f} ms ({gbs:.1f} GB/s both ways together if all were its own)", flush=True)
        if "expert_cache_hit_rate" in rows[-1]:
            # offload.experts = weights: offload_bytes_* count the cache's moves and the
            # update's in-place reads of the gradients too (train/trainer.cpp).
            print(f"  expert cache: hit rate {rows[-1]['expert_cache_hit_rate']:.3f}; the compute waited "
                  f"{1e3*rows[-1].get('expert_cache_wait_s', 0):.0f} ms for its copies", flush=True)
        if "host_waits" in rows[-1]:
            print(f"  host waits for the device in the last step: {rows[-1]['host_waits']}", flush=True)
        planned = max(r["memory_bytes"] for r in rows)
        held = max(r.get("device_memory_bytes", 0) for r in rows)
        print(f"  memory: planned arenas {planned/1e9:.1f} GB, held on the device (measured) {held/1e9:.1f} GB",
              flush=True)
        # The measured figure (pools, workspaces and handles included) is the peak.
        return tps, held or planned


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moetrain", required=True)
    p.add_argument("--layers", type=int, default=8, help="Qwen3-30B-A3B cut to this many layers")
    p.add_argument("--config", help="a config.json instead of Qwen3-30B-A3B (its num_hidden_layers counts)")
    p.add_argument("--batch", type=int, default=2, help="sequences a micro-batch")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches accumulated an optimizer step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--skip-moetrain", action="store_true")
    p.add_argument("--ranks", type=int, default=1, help="moetrain on this many GPUs (mpirun, one process each)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (--ranks counts them too)")
    p.add_argument("--schedule", default="dualpipev", choices=("dualpipev", "1f1b"), help="with --pp > 1")
    p.add_argument("--learned-only", action="store_true", help="skip moetrain's balanced-routing run")
    p.add_argument("--extra", default="", help="more moetrain flags, space-separated (e.g. --parallelism.zero3=true)")
    p.add_argument("--state-dtypes", default="fp32",
                   help="comma-separated optimizer.state_dtype values to run moetrain with (fp32, bf16)")
    p.add_argument("--fp8", default="none", help="comma-separated training.fp8 values (none, blockwise)")
    p.add_argument("--mtp", type=int, default=None,
                   help="DeepSeek-V3: this many multi-token prediction depths (the config's num_nextn_predict_layers "
                        "rewritten; moetrain only: transformers runs none)")
    args = p.parse_args()
    cfg_path = args.config or os.path.join(HERE, "configs", f"qwen3_30b_a3b_{args.layers}l.json")
    if not os.path.exists(cfg_path) and not args.config:
        # Another cut of the whole model (offload's 14 and 20 layers): written for the run.
        cfg = json.load(open(os.path.join(HERE, "configs", "qwen3_30b_a3b.json")))
        cfg["num_hidden_layers"] = args.layers
        cfg_path = os.path.join(tempfile.mkdtemp(), f"qwen3_30b_a3b_{args.layers}l.json")
        json.dump(cfg, open(cfg_path, "w"))
    cfg = json.load(open(cfg_path))
    name_of_model = os.path.splitext(os.path.basename(cfg_path))[0]
    if args.mtp is not None:
        cfg["num_nextn_predict_layers"] = args.mtp
        name_of_model += f" with {args.mtp} MTP depths"
        cfg_path = os.path.join(tempfile.mkdtemp(), "config.json")
        json.dump(cfg, open(cfg_path, "w"))
        args.skip_baseline = args.skip_baseline or args.mtp > 0
    fpt, active = flops_per_token(cfg, args.seq)
    peak = gemm_peak()
    fp8_peak = gemm_peak(fp8=True) if "blockwise" in args.fp8 else 0.0
    gpu = torch.cuda.get_device_name()
    if fp8_peak:
        print(f"{gpu}: FP8 GEMM peak (torch._scaled_mm, per-tensor scales) {fp8_peak:.0f} TFLOPS", flush=True)
    print(f"{gpu}: bf16 GEMM peak {peak:.0f} TFLOPS; {name_of_model}, {cfg['num_hidden_layers']} layers, active params {active/1e6:.0f}M, "
          f"{fpt/1e9:.2f} GFLOP/token", flush=True)
    results = []
    runs = []
    if not args.skip_baseline:
        if not args.skip_eager:
            runs.append(("transformers eager",
                         lambda: baseline(cfg, args.batch, args.seq, args.steps, args.warmup, False, args.micro_batches)))
        if not args.skip_compile:
            runs.append(("transformers torch.compile",
                         lambda: baseline(cfg, args.batch, args.seq, args.steps, args.warmup, True, args.micro_batches)))
    pipeline = f"pp {args.pp} {args.schedule}, " if args.pp > 1 else ""
    mesh = f" on {args.ranks} GPUs ({pipeline}ep {args.ep}, cp {args.cp}), per GPU" if args.ranks > 1 else ""
    balances = () if args.skip_moetrain else (False,) if args.learned_only else (False, True)
    for fp8, state, balanced in itertools.product(args.fp8.split(","), args.state_dtypes.split(","), balances):
        name = ("moetrain " + ("fp8 " if fp8 != "none" else "") + ("balanced routing" if balanced else "learned routing") +
                mesh + (f", {state} AdamW moments" if state != "fp32" else ""))
        # Per GPU: the job's tokens/s over its GPUs (each rank reports the same step time).
        runs.append((name, lambda b=balanced, st=state, f8=fp8: (lambda tps, mem: (tps / args.ranks, mem))(
            *ours(args.moetrain, cfg_path, args.batch, args.seq, args.steps, args.warmup, b, cfg["vocab_size"],
                  args.ranks, args.ep, args.cp,
                  (f"--optimizer.state_dtype={st}", f"--training.fp8={f8}", *args.extra.split()),
                  args.pp, args.schedule, args.micro_batches))))
    for name, fn in runs:
        try:
            tps, mem = fn()
        except Exception as e:  # report and go on: one system failing must not hide the others
            print(f"{name}: FAILED: {e}", flush=True)
            continue
        tflops = tps * fpt / 1e12
        results.append((name, tps, tflops, tflops / peak, mem))
        against_fp8 = f" ({100*tflops/fp8_peak:.1f}% of the FP8 peak)" if " fp8 " in name and fp8_peak else ""
        print(f"{name}: {tps:,.0f} tokens/s, {tflops:.1f} model TFLOPS, MFU {100*tflops/peak:.1f}%{against_fp8}, "
              f"peak memory {mem/1e9:.1f} GB", flush=True)
    date = time.strftime("%Y-%m-%d")
    commit = os.environ.get("MOETRAIN_COMMIT", "unknown")
    for name, tps, tflops, mfu, mem in results:
        print(f"| {date} | {commit} | {gpu} | {name_of_model} seq {args.seq}, {args.micro_batches} micro-batches of "
              f"{args.batch} a step: {name} | "
              f"{tps:,.0f} tokens/s, {tflops:.1f} TFLOPS, MFU {100*mfu:.1f}% of {peak:.0f}, peak {mem/1e9:.1f} GB |")


if __name__ == "__main__":
    sys.exit(main())
