#!/usr/bin/env python3
"""The GPU mesh check: `moetrain train` on the CUDA backend, one GPU against meshes.

    python3 tests/gpu/meshes.py BUILD/moetrain . [--gpus 1|2|4|8] [--ranks N] [--pipeline]
        [--extra="--section.key=value ..."] [--fixture NAME] [--ref-device cpu] [--dry-run]

Trains the qwen3_moe_a fixture (--fixture: another of tests/fixtures) for a few steps on
one GPU, then under `mpirun -np N` on every mesh (dp, cp, ep) of N = 2 .. --ranks ranks
(default: --gpus) that the fixture allows, and compares each step's loss, lb_loss,
grad_norm (and z_loss and val_loss where the run has them) with the one-GPU run
(relative tolerance --rtol) and its expert_counts (at most --count-slack slots moved per
layer), for both load-balance variants. The batch is the one tests/test_train.cpp's
Commands.MeshesMatchOneRank builds (the fixture's three sequences and its first again:
4 rows of 16 positions), so the meshes are those where dp * ep divides 4 rows, 2 * cp
divides 16 positions and ep divides the fixture's experts.

Ranks take GPUs local_rank % count, so more ranks than GPUs share them: their GPU
messages then go through host memory (comm/communicator.h), and every rank has its own
process and CUDA context. --ranks 4 on one GPU runs every four-rank mesh there.

--ref-device cpu: the reference run on the CPU backend instead of one GPU, so
`--meshes 1,1,1,1 --ref-device cpu` checks one GPU against the CPU for the flags of --extra.
@TOKENS@ in --extra and --mesh-extra stands for the batch's token file (validation.tokens).
--dry-run prints the runs it would make and exits (no GPU needed).

--mesh-extra: flags for the meshes only, against a one-GPU run without them (expert
replicas, which need ep > 1, must train exactly as without them).

--pipeline: the meshes (pp, dp, cp, ep) of Commands.PipelineMeshesMatchOneRank instead,
pp = 2 .. --gpus with each schedule of --schedules: the model of
tests/fixtures/pipeline/config.json (4 experts; --pipeline-config: another of that
folder's, such as deepseek_v3.json with a multi-token prediction depth), made 2 * pp layers deep where DualPipeV
needs it (two chunks a rank), from random weights, on that test's 32 x 17 token matrix
in micro-batches of one sequence (DualPipeV needs 2 * pp micro-batches a replica).
Prints a table; exits 1 on a mismatch, 2 when a run fails. Everything it starts has
NCCL_NVLS_ENABLE=0 in its environment (NVLink multicast stays off).

Tolerance. The CPU test compares at 1e-5 because the CPU backend is fp32 throughout.
On the GPU activations are bf16 (8 significant bits: one rounding is at most 2^-9,
about 2e-3 relative) with fp32 accumulation, and a mesh changes where roundings and
summation orders fall, not the mathematics: ring attention rounds each block's output
to bf16 before its fp32 merge (one kernel rounds once), the expert-parallel dispatch
backward rounds each rank's partial row sum to bf16 before it travels, smaller
per-rank batches let cuBLASLt pick other algorithms (another fp32 summation order),
and gradients are summed over ranks in another order. A handful of such 2e-3
differences through three layers, amplified by three AdamW steps (whose first updates
have magnitude lr whatever the gradient's size), stays well inside 2e-2 (about ten bf16
roundings), while a lost, duplicated or misplaced token, chunk or expert row changes
grad_norm and the routing counts by far more. The largest differences seen are printed,
so the tolerance can be tightened (--rtol) once a machine's numbers are known.
Routing: a bf16-sized difference in a router logit can flip a near-tie between two
experts, which moves one slot from one expert to another (an L1 difference of 2 in a
layer's counts). Flips compound over steps once the weights differ in their last bits:
the first 2-GPU run (H200 x2, cp = 2, whose ring attention sums in another order) moved
two slots of a layer's 128 at step 3 while loss and grad_norm agreed to 3e-3.
--count-slack (default 8: four slots, 3% of that fixture's slots per layer) allows that;
a lost or duplicated row moves counts by its k slots in every layer from step 1.
"""
import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

PIPELINE_CONFIG = "tests/fixtures/pipeline/config.json"
# Rows and positions of each batch below, and the pipeline model's expert count.
ROWS, POSITIONS = 4, 16
PIPELINE_ROWS, PIPELINE_EXPERTS = 32, 4


def fixture_experts(repo, fixture):
    """The routed experts of a fixture's config.json, by whichever name its family uses."""
    with open(os.path.join(repo, "tests/fixtures", fixture, "config.json")) as f:
        c = json.load(f)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if key in c:
            return c[key]
    raise SystemExit("tests/fixtures/%s/config.json names no expert count" % fixture)


def meshes_for(ranks, pipeline, experts):
    """(pp, dp, cp, ep) of 2 .. ranks ranks (powers of two) that the batch allows; pp > 1
    with --pipeline, pp = 1 otherwise."""
    rows, experts = (PIPELINE_ROWS, PIPELINE_EXPERTS) if pipeline else (ROWS, experts)
    out = []
    n = 2
    while n <= ranks:
        for pp, dp, cp, ep in itertools.product([1, 2, 4, 8], repeat=4):
            if pp * dp * cp * ep != n or (pp > 1) != pipeline:
                continue
            if rows % (dp * ep) or POSITIONS % (2 * cp) or experts % ep:
                continue
            out.append((pp, dp, cp, ep))
        n *= 2
    return out


def write_tokens(repo, folder, pipeline, fixture):
    """MeshesMatchOneRank's batch (the fixture's 3 x 17 token matrix and its first row
    again), or PipelineMeshesMatchOneRank's 32 x 17 one."""
    if pipeline:
        i = np.arange(PIPELINE_ROWS * (POSITIONS + 1))
        b = ((i * 29 + i // 5 + i // 17) % 80).astype("<i8").reshape(PIPELINE_ROWS, POSITIONS + 1)
    else:
        a = np.load(os.path.join(repo, "tests/fixtures", fixture, "tokens.npy")).astype("<i8")
        # qwen3_5_moe_b has 3 x 70 tokens (two chunks of its DeltaNet rule on the CPU's
        # test): its rows again, cut to 17 positions, as Commands.MeshesMatchOneRank does.
        b = np.concatenate([a, a], axis=0)[:ROWS, :POSITIONS + 1]
        assert b.shape[0] == ROWS and b.shape[1] == POSITIONS + 1, b.shape
    path = os.path.join(folder, "tokens.npy")
    np.save(path, b)
    return path


def write_pipeline_config(repo, folder, layers, source=PIPELINE_CONFIG):
    """A pipeline fixture's config.json, `layers` deep (at least its own 8)."""
    with open(os.path.join(repo, source)) as f:
        c = json.load(f)
    c["num_hidden_layers"] = max(layers, c["num_hidden_layers"])
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path


# The sizes --fp8-sizes rounds up to a multiple of 16 (FP8's e4m3 rows are 16-byte
# aligned: every product's K and output width must be a multiple of 16).
SIZE_KEYS = ["hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "shared_expert_intermediate_size",
             # Qwen3.5's DeltaNet: in_proj_b and in_proj_a are as wide as its value heads.
             "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"]


def write_fp8_config(repo, folder, source):
    """`source` (a config.json) with every size rounded up to a multiple of 16: the
    fixtures' widths (8, 12, 24) are below what the FP8 products take. Its runs start
    from random weights (seed 0), the same in every run."""
    with open(source if os.path.isabs(source) else os.path.join(repo, source)) as f:
        c = json.load(f)
    for key in SIZE_KEYS:
        if c.get(key):
            c[key] = -(-c[key] // 16) * 16
    path = os.path.join(folder, "config_fp8.json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path


def train_command(args, mesh, schedule, lb, tokens, dump, ref):
    """The command of one run: the reference (ref, on --ref-device) or a mesh (on --device)."""
    pp, dp, cp, ep = mesh
    np_ranks = pp * dp * cp * ep
    model = (["--model.config=" + args.model_config] if args.model_config
             else ["--model.init=hf:" + os.path.join(args.repo, "tests/fixtures", args.fixture)])
    cmd = [args.moetrain, "train"] + model + [
           "--data.tokens=" + tokens,
           "--training.device=" + (args.ref_device if ref else args.device),
           "--training.steps=%d" % args.steps,
           "--training.load_balance_coef=0.1",
           "--training.micro_batch_size=1",
           "--training.load_balance_type=" + lb,
           "--parallelism.pp=%d" % pp,
           "--parallelism.cp=%d" % cp,
           "--parallelism.ep=%d" % ep,
           "--job.dump_folder=" + dump] + args.extra.replace("@TOKENS@", tokens).split()
    if not ref:
        cmd += args.mesh_extra.replace("@TOKENS@", tokens).split()
    if schedule:
        cmd.append("--parallelism.pipeline_schedule=" + schedule)
    if np_ranks > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np_ranks),
               "-x", "NCCL_NVLS_ENABLE", "-x", "OMP_NUM_THREADS"] + cmd
    return cmd


def run_train(args, env, mesh, schedule, lb, tokens, dump, ref):
    cmd = train_command(args, mesh, schedule, lb, tokens, dump, ref)
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=args.timeout)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:  # its captured output is bytes even with text=True
        rc, out = 124, e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    steps = []
    path = os.path.join(dump, "metrics.jsonl")
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    if rc != 0 or len(steps) != args.steps:
        print("FAILED: %s (exit %d, %d of %d steps)\n%s" % (" ".join(cmd), rc, len(steps), args.steps, out[-6000:]),
              file=sys.stderr)
        return None
    return steps


def visible_gpus():
    """GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi -L), or None if unknown."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return None
    p = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return len([line for line in p.stdout.splitlines() if line.startswith("GPU ")]) if p.returncode == 0 else None


def rel(got, want):
    return abs(got - want) / max(abs(want), 1e-12)


def count_moves(got, want):
    """Per layer, the L1 distance between two routing count vectors; the largest."""
    if len(got) != len(want):
        return float("inf")
    worst = 0
    for g, w in zip(got, want):
        if len(g) != len(w):
            return float("inf")
        worst = max(worst, sum(abs(a - b) for a, b in zip(g, w)))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("moetrain", help="path of the moetrain binary (built with -DMOETRAIN_CUDA=ON)")
    ap.add_argument("repo", help="the repository root (for tests/fixtures)")
    ap.add_argument("--gpus", type=int, default=2, choices=[1, 2, 4, 8],
                    help="GPUs to use (default 2); the ranks of a mesh take them local_rank %% count")
    ap.add_argument("--ranks", type=int, default=0, choices=[0, 2, 4, 8],
                    help="the largest mesh (default: --gpus); more ranks than GPUs share them")
    ap.add_argument("--fixture", default="qwen3_moe_a", help="the model of tests/fixtures (not with --pipeline)")
    ap.add_argument("--ref-device", default="", choices=["", "cuda", "cpu"],
                    help="the reference run's device (default: --device)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance of loss, lb_loss, grad_norm")
    ap.add_argument("--count-slack", type=int, default=8,
                    help="largest L1 difference of a layer's expert counts (2 = one slot moved)")
    ap.add_argument("--lb", default="micro_batch,global_batch", help="load-balance variants, comma-separated")
    ap.add_argument("--meshes", default="",
                    help="dp,cp,ep triples or pp,dp,cp,ep quadruples separated by spaces (default: all for --gpus)")
    ap.add_argument("--pipeline", action="store_true",
                    help="pipeline meshes (pp > 1) of the pipeline fixture, with each of --schedules")
    ap.add_argument("--pipeline-config", default=PIPELINE_CONFIG,
                    help="with --pipeline: the model's config.json (of tests/fixtures/pipeline)")
    ap.add_argument("--schedules", default="1f1b,dualpipev", help="with --pipeline: schedules, comma-separated")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: try the script itself on the CPU backend (any build)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--fp8-sizes", action="store_true",
                    help="every size of the model's config.json rounded up to a multiple of 16, random weights "
                         "(the FP8 products' alignment)")
    ap.add_argument("--extra", default="",
                    help="flags appended to every moetrain command, the one-GPU run's too, separated by spaces "
                         "(e.g. --extra=--parallelism.zero3=true)")
    ap.add_argument("--mesh-extra", default="",
                    help="flags appended to the meshes' commands only, not the one-GPU run's (e.g. "
                         "--mesh-extra=--parallelism.expert_replicas=2 with --meshes of ep > 1: replicas "
                         "must leave the mathematics unchanged)")
    args = ap.parse_args()
    args.moetrain = os.path.abspath(args.moetrain)
    args.repo = os.path.abspath(args.repo)

    args.ranks = args.ranks or max(args.gpus, 2)
    args.ref_device = args.ref_device or args.device
    experts = fixture_experts(args.repo, args.fixture)
    meshes = ([tuple(int(x) for x in m.split(",")) for m in args.meshes.split()] if args.meshes
              else meshes_for(args.ranks, args.pipeline, experts))
    meshes = [m if len(m) == 4 else (1,) + m for m in meshes]
    need = max(pp * dp * cp * ep for pp, dp, cp, ep in meshes)
    have = visible_gpus() if args.device == "cuda" and not args.dry_run else None
    if have == 0:
        print("--device cuda, but no GPU is visible")
        return 2
    env = dict(os.environ)
    # Only the GPUs asked for: the ranks of a mesh share them (local_rank % count).
    if args.device == "cuda" and have is not None and have > args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(args.gpus))
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"

    work = tempfile.mkdtemp(prefix="moetrain_meshes_")
    tokens = write_tokens(args.repo, work, args.pipeline, args.fixture)
    dualpipev = args.pipeline and "dualpipev" in args.schedules.split(",")
    args.model_config = (write_pipeline_config(args.repo, work, 2 * need if dualpipev else 0, args.pipeline_config)
                         if args.pipeline else None)
    if args.fp8_sizes:
        args.model_config = write_fp8_config(args.repo, work, args.model_config or os.path.join(
            "tests/fixtures", args.fixture, "config.json"))
    # Each run: a mesh and, where pp > 1, a schedule.
    runs = [(m, s if m[0] > 1 else "") for m in meshes for s in (args.schedules.split(",") if m[0] > 1 else [""])]
    print("moetrain %s, %s, %d steps, meshes (pp,dp,cp,ep): %s%s%s on %s (%d GPU(s), up to %d ranks), reference on "
          "%s, rtol %g, count slack %d, runs in %s"
          % (args.moetrain, "pipeline model" if args.pipeline else args.fixture, args.steps,
             " ".join("(%d,%d,%d,%d)" % m for m in meshes), " with " + args.extra if args.extra else "",
             " (meshes also " + args.mesh_extra + ")" if args.mesh_extra else "", args.device, args.gpus, need,
             args.ref_device, args.rtol, args.count_slack, work))
    if args.dry_run:
        for lb in args.lb.split(","):
            print(" ".join(train_command(args, (1, 1, 1, 1), "", lb, tokens, os.path.join(work, "ref_" + lb), True)))
            for mesh, schedule in runs:
                print(" ".join(train_command(args, mesh, schedule, lb, tokens, os.path.join(work, "run"), False)))
        shutil.rmtree(work, ignore_errors=True)
        return 0
    # One line per (variant, mesh, step): the one-GPU value and the relative difference
    # of each metric, and the largest L1 difference of a layer's routing counts.
    header = "%-13s %-20s %4s  %-20s %-20s %-20s %-9s %s" % (
        "lb", "mesh", "step", "loss (rel diff)", "lb_loss (rel diff)", "grad_norm (rel diff)", "counts", "")
    failed_runs, mismatches = 0, 0
    worst = {"loss": 0.0, "lb_loss": 0.0, "grad_norm": 0.0, "expert_counts": 0}
    for lb in args.lb.split(","):
        ref = run_train(args, env, (1, 1, 1, 1), "", lb, tokens, os.path.join(work, "ref_" + lb), True)
        if ref is None:
            failed_runs += 1
            continue
        print("\n" + header)
        for mesh, schedule in runs:
            name = "(%d,%d,%d,%d)%s" % (mesh + (" " + schedule if schedule else "",))
            got = run_train(args, env, mesh, schedule, lb, tokens,
                            os.path.join(work, "run_%d%d%d%d%s_%s" % (mesh + (schedule, lb))), False)
            if got is None:
                failed_runs += 1
                print("%-13s %-20s  run failed (its output is above)" % (lb, name))
                continue
            for i, (w, g) in enumerate(zip(ref, got)):
                cells, bad = [], False
                for key in ("loss", "lb_loss", "grad_norm"):
                    d = rel(g[key], w[key])
                    worst[key] = max(worst[key], d)
                    bad = bad or not d <= args.rtol  # NaN is a mismatch
                    cells.append("%.6g (%.1e)" % (w[key], d))
                # The z-loss and the validation loss, where the reference has them.
                others = []
                for key in ("z_loss", "val_loss"):
                    if key in w:
                        d = rel(g.get(key, float("nan")), w[key])
                        worst[key] = max(worst.get(key, 0.0), d)
                        bad = bad or not d <= args.rtol
                        others.append("%s %.6g (%.1e)" % (key, w[key], d))
                # Multi-token prediction: each depth's loss.
                for k, want in enumerate(w.get("mtp_loss", [])):
                    have = g.get("mtp_loss", [])
                    d = rel(have[k] if k < len(have) else float("nan"), want)
                    worst["mtp_loss"] = max(worst.get("mtp_loss", 0.0), d)
                    bad = bad or not d <= args.rtol
                    others.append("mtp_loss[%d] %.6g (%.1e)" % (k, want, d))
                moved = count_moves(g.get("expert_counts", []), w.get("expert_counts", []))
                worst["expert_counts"] = max(worst["expert_counts"], moved)
                bad = bad or moved > args.count_slack
                mismatches += bad
                print("%-13s %-20s %4d  %-20s %-20s %-20s L1 %-6s %s%s"
                      % (lb, name, i + 1, cells[0], cells[1], cells[2], moved, "MISMATCH" if bad else "ok",
                         "  " + ", ".join(others) if others else ""))
                if moved > args.count_slack:
                    print("    expert_counts one GPU %s\n                  mesh    %s"
                          % (w.get("expert_counts"), g.get("expert_counts")))
    print("\nlargest differences: loss %.2e, lb_loss %.2e, grad_norm %.2e (relative), expert counts L1 %s%s"
          % (worst["loss"], worst["lb_loss"], worst["grad_norm"], worst["expert_counts"],
             "".join(", %s %.2e" % (k, worst[k]) for k in ("z_loss", "val_loss") if k in worst)))
    if not args.keep and failed_runs == 0 and mismatches == 0:
        shutil.rmtree(work, ignore_errors=True)
    if failed_runs:
        print("%d run(s) failed" % failed_runs)
        return 2
    if mismatches:
        print("%d mismatch(es); run folders kept in %s" % (mismatches, work))
        return 1
    print("all meshes match the one-GPU run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
