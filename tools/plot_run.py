#!/usr/bin/env python3
"""Plots a moetrain run folder's metrics.jsonl with matplotlib (Debian's
python3-matplotlib, which scripts/setup.sh installs):

  python3 tools/plot_run.py RUN_DIR [--output DIR]      (default DIR: RUN_DIR/plots)

writes, each as .png and .svg:
  metrics      loss, learning rate, gradient norm and tokens/s against step
  expert_load  (a run with MoE layers) the most loaded expert's tokens over the mean,
               per layer, against step; then per MoE layer a heatmap, expert against
               step, of each expert's tokens over the layer's mean (1 = balanced),
               averaged over bins of steps when the run has more than 1000
  expert_cache (offload.experts = weights) beside it, the same heatmaps of each
               expert's residency: the share of its passes that found it on the device
  expert_placement (parallelism.expert_replicas) the rows the busiest ep rank got over
               the mean, per layer, against step; then the same heatmaps of each
               expert's copies over the ep ranks (1: its owner's alone)
  expert_bias  (training.expert_bias_update_rate) the max / mean expert load again, then
               the same heatmaps of each expert's routing bias
and prints one line per file written. The file is read line by line, so a long run
of a large model needs memory for its bins, not for every step's counts.
"""
import argparse
import json
import math
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s")
COLUMNS = 1000  # the most heatmap columns


def read_run(path):
    """Every step's scalars and each layer's max/mean load; the load per expert in bins."""
    with open(path) as f:
        n = sum(1 for line in f if line.strip())
    if n == 0:
        raise SystemExit(f"{path}: no steps")
    per_bin = math.ceil(n / COLUMNS)
    run = {"step": [], "max_over_mean": [], "bins": [], "bin_steps": [], "layers": [], "resident": [],
           "copies": [], "rank_rows": [], "bias": []}
    run.update({k: [] for k in SCALARS})
    with open(path) as f:
        for i, line in enumerate(line for line in f if line.strip()):
            r = json.loads(line)
            run["step"].append(r["step"])
            for k in SCALARS:
                run[k].append(r[k])
            c = np.asarray(r.get("expert_counts", []), dtype=np.float64)  # [moe layer, expert]
            if c.size == 0:
                continue
            load = c / np.maximum(c.mean(axis=1, keepdims=True), 1e-30)
            run["layers"] = r.get("moe_layers", list(range(len(c))))
            run["max_over_mean"].append(load.max(axis=1))
            if i % per_bin == 0:
                run["bins"].append(np.zeros_like(load))
                run["bin_steps"].append([r["step"], 0])
            run["bins"][-1] += load
            run["bin_steps"][-1][1] += 1
            if "expert_cache_residency" in r:  # null (no pass used the expert): NaN, left out of the mean
                res = np.asarray([[np.nan if v is None else v for v in layer] for layer in r["expert_cache_residency"]])
                if i % per_bin == 0:
                    run["resident"].append([np.zeros_like(res), np.zeros_like(res)])
                seen = ~np.isnan(res)
                run["resident"][-1][0] += np.where(seen, res, 0.0)
                run["resident"][-1][1] += seen
            if "expert_bias" in r:
                bias = np.asarray(r["expert_bias"], dtype=np.float64)
                if i % per_bin == 0:
                    run["bias"].append(np.zeros_like(bias))
                run["bias"][-1] += bias
            if "expert_copies" in r:
                copies = np.asarray(r["expert_copies"], dtype=np.float64)
                if i % per_bin == 0:
                    run["copies"].append(np.zeros_like(copies))
                run["copies"][-1] += copies
                run["rank_rows"].append(r["ep_rows_max_over_mean"])
    return run


def save(fig, out, name):
    for ext in ("png", "svg"):
        path = os.path.join(out, f"{name}.{ext}")
        fig.savefig(path, dpi=110)
        print(path)
    plt.close(fig)


def plot_metrics(run, out, title):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, layout="constrained")
    panels = [("loss", "loss (cross-entropy)", False), ("lr", "learning rate", False),
              ("grad_norm", "gradient norm (before clipping)", True), ("tokens_per_s", "tokens/s", False)]
    for ax, (key, label, log) in zip(axes.flat, panels):
        ax.plot(run["step"], run[key], color="#1f77b4", linewidth=1.5)
        ax.set_title(label)
        ax.set_ylabel(key)
        if log and min(run[key]) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    save(fig, out, "metrics")


def heatmaps(run, axes, maps, label, vmax, vmin=0.0, cmap="viridis"):
    """One panel a MoE layer: maps[layer] is [expert, bin], against the bins' steps."""
    first, last = run["step"][0], run["step"][-1]
    image = None
    for i, layer in enumerate(run["layers"]):
        ax = axes[i]
        image = ax.imshow(maps[i], aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax,
                          interpolation="nearest", extent=(first - 0.5, last + 0.5, -0.5, maps.shape[1] - 0.5))
        ax.set_title(f"layer {layer}: {label}")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    return image


def grid(panels):
    cols = min(4, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[panels:]:
        ax.axis("off")
    return fig, axes.flat


def peaks(ax, run, values, title):
    """One line a MoE layer of values [step, layer] (a max over a mean) against step."""
    values = np.asarray(values)
    for i, layer in enumerate(run["layers"]):
        ax.plot(run["step"], values[:, i], label=f"layer {layer}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("max over mean")
    ax.grid(alpha=0.3)
    if len(run["layers"]) <= 12:
        ax.legend(fontsize=7)


def plot_expert_load(run, out, title):
    layers = run["layers"]
    if not layers or len(run["max_over_mean"]) != len(run["step"]):
        return
    # [layer, expert, bin]: each bin's mean load
    load = np.stack([b / n for b, (_, n) in zip(run["bins"], run["bin_steps"])], axis=-1)
    fig, axes = grid(len(layers) + 1)
    peaks(axes[0], run, run["max_over_mean"], "max / mean expert load")
    image = heatmaps(run, axes[1:], load, "tokens per expert / mean", max(float(load.max()), 1.0))
    fig.suptitle(title)
    fig.colorbar(image, ax=axes[1:len(layers) + 1], shrink=0.8, label="load (1 = balanced)")
    save(fig, out, "expert_load")
    if len(run["resident"]) != len(run["bins"]):
        return
    with np.errstate(invalid="ignore"):  # a bin in which no pass used an expert stays NaN
        resident = np.stack([s / n for s, n in run["resident"]], axis=-1)
    fig, axes = grid(len(layers))
    image = heatmaps(run, axes, resident, "passes finding it on the device", 1.0)
    fig.suptitle(title + " (expert cache)")
    fig.colorbar(image, ax=axes[:len(layers)], shrink=0.8, label="residency (share of its passes)")
    save(fig, out, "expert_cache")


def plot_expert_placement(run, out, title):
    layers = run["layers"]
    if not layers or len(run["copies"]) != len(run["bins"]) or len(run["rank_rows"]) != len(run["step"]):
        return
    copies = np.stack([c / n for c, (_, n) in zip(run["copies"], run["bin_steps"])], axis=-1)
    fig, axes = grid(len(layers) + 1)
    peaks(axes[0], run, run["rank_rows"], "max / mean rows an ep rank received")
    image = heatmaps(run, axes[1:], copies, "copies of each expert", max(float(copies.max()), 1.0))
    fig.suptitle(title + " (expert placement)")
    fig.colorbar(image, ax=axes[1:len(layers) + 1], shrink=0.8, label="copies over the ep ranks")
    save(fig, out, "expert_placement")


def plot_expert_bias(run, out, title):
    layers = run["layers"]
    if not layers or len(run["bias"]) != len(run["bins"]) or len(run["max_over_mean"]) != len(run["step"]):
        return
    bias = np.stack([b / n for b, (_, n) in zip(run["bias"], run["bin_steps"])], axis=-1)
    reach = max(float(np.abs(bias).max()), 1e-12)
    fig, axes = grid(len(layers) + 1)
    peaks(axes[0], run, run["max_over_mean"], "max / mean expert load")
    image = heatmaps(run, axes[1:], bias, "routing bias of each expert", reach, -reach, "coolwarm")
    fig.suptitle(title + " (expert bias)")
    fig.colorbar(image, ax=axes[1:len(layers) + 1], shrink=0.8, label="bias added to the score (top-k choice)")
    save(fig, out, "expert_bias")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder (job.dump_folder) holding metrics.jsonl")
    p.add_argument("--output", help="where the plots go (default: RUN/plots)")
    a = p.parse_args()
    out = a.output or os.path.join(a.run, "plots")
    os.makedirs(out, exist_ok=True)
    run = read_run(os.path.join(a.run, "metrics.jsonl"))
    title = f"{os.path.basename(os.path.abspath(a.run))}: steps {run['step'][0]}-{run['step'][-1]}"
    plot_metrics(run, out, title)
    plot_expert_load(run, out, title)
    plot_expert_placement(run, out, title)
    plot_expert_bias(run, out, title)


if __name__ == "__main__":
    main()
