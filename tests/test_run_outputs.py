#!/usr/bin/env python3
"""What a run folder holds besides metrics.jsonl, read from outside:

  test_run_outputs.py tensorboard|plot MOETRAIN_BIN

tensorboard: trains the qwen3_moe_a fixture for 4 steps with metrics.tensorboard and a
checkpoint at step 2, resumes from step 2 in the same folder (steps 3 and 4 again, into
a second event file), and reads tb/ back with the tensorboard package's
EventAccumulator: every tag at steps 1-4 exactly once, equal (as float32) to
metrics.jsonl's values and to the expert-load statistics of its expert_counts, with
metrics.jsonl's time as the wall time, so steps 3 and 4 are the resumed run's (the
first file's are dropped by the START record).
plot: tools/plot_run.py on a short run (with the expert cache, offload.experts =
weights) writes valid, non-trivial PNG and SVG files with titles, axis labels and ticks,
and the cache's residency heatmaps beside the loads'; on a run of two ranks at ep 2 with
expert replicas (under mpirun, where there is one), the placement's heatmaps.
Exits 77 (skipped) when the package it needs cannot be imported.
"""
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "qwen3_moe_a")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def train(binary, dump, *extra):
    cmd = [binary, "train", f"--model.init=hf:{FIXTURE}", f"--data.tokens={FIXTURE}/tokens.npy",
           f"--job.dump_folder={dump}", "--training.load_balance_coef=0.01", "--optimizer.lr=3e-3", *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected_scalars(m):
    want = {k: m[k] for k in ("loss", "lb_loss", "grad_norm", "lr", "tokens_per_s", "memory_bytes", "dropped_slots",
                                 "expert_row_bytes", "routing_skew")}
    for layer, c in zip(m["moe_layers"], m["expert_counts"]):
        mean = sum(c) / len(c)
        want[f"expert_load/layer_{layer}/max_over_mean"] = max(c) / mean
        want[f"expert_load/layer_{layer}/min_over_mean"] = min(c) / mean
    return want


def test_tensorboard(binary):
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError as e:
        print(f"SKIP: the tensorboard package cannot be imported ({e}); scripts/setup.sh installs it")
        sys.exit(77)
    dump = tempfile.mkdtemp(prefix="moetrain_tb_")
    first = train(binary, dump, "--training.steps=4", "--checkpoint.interval=2", "--metrics.tensorboard=true")
    rows = train(binary, dump, "--training.steps=4", "--metrics.tensorboard=true",
                 f"--checkpoint.load={dump}/checkpoints/step-00000002")
    check([r["step"] for r in rows] == [1, 2, 3, 4], f"metrics.jsonl steps {[r['step'] for r in rows]}")
    check(rows[:2] == first[:2] and rows[2]["time"] > first[3]["time"], "steps 3 and 4 were not run again")
    files = sorted(glob.glob(os.path.join(dump, "tb", "events.out.tfevents.*")))
    check(len(files) == 2, f"two event files, one a run: {files}")
    # The first file holds the first run's steps 3 and 4, which the reader must drop.
    old = [e.step for e in EventFileLoader(files[0]).Load() if e.HasField("summary")]
    check(old == [1, 2, 3, 4], f"the first file's steps: {old}")

    acc = EventAccumulator(os.path.join(dump, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    want = [expected_scalars(m) for m in rows]
    check(sorted(acc.Tags()["scalars"]) == sorted(want[0]), f"tags {acc.Tags()['scalars']} vs {sorted(want[0])}")
    check(len(rows[0]["moe_layers"]) == 2 and rows[0]["moe_layers"] == [0, 2], f"moe_layers {rows[0]['moe_layers']}")
    for tag in want[0]:
        if tag not in acc.Tags()["scalars"]:
            continue
        events = acc.Scalars(tag)
        check([e.step for e in events] == [1, 2, 3, 4], f"{tag}: steps {[e.step for e in events]}")
        for e, m, w in zip(events, rows, want):
            check(e.value == f32(w[tag]), f"{tag} at step {e.step}: {e.value} in TensorBoard, {w[tag]} in metrics")
            check(e.wall_time == m["time"], f"{tag} at step {e.step}: wall time {e.wall_time} vs {m['time']}")
    check(any(w["expert_load/layer_0/max_over_mean"] > 1.0 for w in want), "no load imbalance to see")


def test_plot(binary):
    try:
        import matplotlib.image
    except ImportError as e:
        print(f"SKIP: matplotlib cannot be imported ({e}); scripts/setup.sh installs python3-matplotlib")
        sys.exit(77)
    dump = tempfile.mkdtemp(prefix="moetrain_plot_")
    rows = train(binary, dump, "--training.steps=12", "--lr_scheduler.warmup_steps=3", "--offload.experts=weights",
                 "--offload.gpu_expert_slots=3", "--training.expert_bias_update_rate=0.01")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), dump],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(p.returncode == 0, f"plot_run.py failed: {p.stdout}")
    for name, texts in [("metrics", ["loss (cross-entropy)", "learning rate", "gradient norm (before clipping)",
                                     "tokens/s", "step", "10"]),
                        ("expert_load", ["max / mean expert load", "layer 0: tokens per expert / mean",
                                         "layer 2: tokens per expert / mean", "expert", "7", "load (1 = balanced)"])]:
        png = os.path.join(dump, "plots", name + ".png")
        with open(png, "rb") as f:
            head = f.read(24)
        check(head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{png}: not a PNG")
        w, h = struct.unpack(">II", head[16:24])
        check(w >= 400 and h >= 300, f"{png}: {w} x {h}")
        pixels = matplotlib.image.imread(png)
        colours = {tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
        check(len(colours) > 50, f"{png}: only {len(colours)} colours")
        svg = os.path.join(dump, "plots", name + ".svg")
        root = ET.parse(svg).getroot()
        check(root.tag == "{http://www.w3.org/2000/svg}svg", f"{svg}: root element {root.tag}")
        found = {"".join(t.itertext()).strip() for t in root.iter("{http://www.w3.org/2000/svg}text")}
        for t in texts:
            check(t in found, f"{svg}: no text '{t}' (has {sorted(found)[:40]})")
        paths = sum(1 for _ in root.iter("{http://www.w3.org/2000/svg}path"))
        check(paths > 20, f"{svg}: {paths} paths")
    heatmaps = sum(1 for _ in ET.parse(os.path.join(dump, "plots", "expert_load.svg")).getroot().iter(
        "{http://www.w3.org/2000/svg}image"))
    check(heatmaps == len(rows[0]["moe_layers"]) + 1, f"expert_load.svg: {heatmaps} images (one a layer, a colour bar)")
    svg = ET.parse(os.path.join(dump, "plots", "expert_cache.svg")).getroot()
    found = {"".join(t.itertext()).strip() for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    for t in ["layer 0: passes finding it on the device", "layer 2: passes finding it on the device",
              "residency (share of its passes)", "expert", "step"]:
        check(t in found, f"expert_cache.svg: no text '{t}'")
    images = sum(1 for _ in svg.iter("{http://www.w3.org/2000/svg}image"))
    check(images == len(rows[0]["moe_layers"]) + 1, f"expert_cache.svg: {images} images (one a layer, a colour bar)")
    check(all(0 <= v <= 1 for r in rows for layer in r["expert_cache_residency"] for v in layer if v is not None)
          and any(0 < v < 1 for layer in rows[-1]["expert_cache_residency"] for v in layer if v is not None),
          "residency outside [0, 1], or no expert found sometimes on the device and sometimes not")
    svg = ET.parse(os.path.join(dump, "plots", "expert_bias.svg")).getroot()
    found = {"".join(t.itertext()).strip() for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    for t in ["max / mean expert load", "layer 0: routing bias of each expert", "layer 2: routing bias of each expert",
              "bias added to the score (top-k choice)"]:
        check(t in found, f"expert_bias.svg: no text '{t}'")
    check(any(v != 0 for layer in rows[-1]["expert_bias"] for v in layer), "no expert bias moved")
    if shutil.which("mpirun") is None:
        print("plot: no mpirun, so no expert-placement plot checked")
        return
    dump = tempfile.mkdtemp(prefix="moetrain_plot_replicas_")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_orte_tmpdir_base=tempfile.mkdtemp(prefix="moetrain-mpi."))  # a session folder of its own
    four = os.path.join(dump, "tokens4.npy")
    subprocess.run([sys.executable, "-c", "import numpy as np, sys; a = np.load(sys.argv[1]); "
                    "np.save(sys.argv[2], np.concatenate([a, a[:1]]))", f"{FIXTURE}/tokens.npy", four], check=True)
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", binary, "train", f"--model.init=hf:{FIXTURE}",
                        f"--data.tokens={four}", f"--job.dump_folder={dump}", "--training.steps=6",
                        "--training.micro_batch_size=1", "--parallelism.ep=2", "--parallelism.expert_replicas=2",
                        "--parallelism.replan_interval=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env)
    check(p.returncode == 0, f"train with replicas failed: {p.stdout[-2000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # 8 experts over 2 ranks with 2 replica slots each: every expert held once, at most 4 more.
    check(all(min(l) >= 1 and 8 <= sum(l) <= 12 for r in rows for l in r["expert_copies"]),
          f"copies {[r['expert_copies'] for r in rows]}")
    check(any(max(l) >= 2 for l in rows[-1]["expert_copies"]), "no expert got a replica")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), dump],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(p.returncode == 0, f"plot_run.py failed: {p.stdout}")
    svg = ET.parse(os.path.join(dump, "plots", "expert_placement.svg")).getroot()
    found = {"".join(t.itertext()).strip() for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    for t in ["max / mean rows an ep rank received", "layer 0: copies of each expert", "layer 2: copies of each expert",
              "copies over the ep ranks", "expert", "step"]:
        check(t in found, f"expert_placement.svg: no text '{t}'")
    images = sum(1 for _ in svg.iter("{http://www.w3.org/2000/svg}image"))
    check(images == 3, f"expert_placement.svg: {images} images (one a layer, a colour bar)")


if __name__ == "__main__":
    {"tensorboard": test_tensorboard, "plot": test_plot}[sys.argv[1]](sys.argv[2])
    if failures:
        sys.exit(f"{len(failures)} checks failed")
    print(f"{sys.argv[1]}: all checks passed")
