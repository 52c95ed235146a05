#!/usr/bin/env python3
"""Per-kernel GPU time of one training step from Nsight Compute's raw CSV.

On the GPU machine (ncu from the CUDA toolkit), two steps of a short model:
  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv --page raw moetrain train ... --training.steps=2 > ncu.csv
  python3 bench/ncu_kernels.py ncu.csv
Sums the kernels of the last step (after the first AdamW launch, through the last)
by name, largest first. ncu serialises kernels, so the sum is the step's kernel time
with no overlap and no launch gaps.
"""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
hdr = rows[hdr_i]
k, t = hdr.index("Kernel Name"), hdr.index("gpu__time_duration.sum")
launches = []
for r in rows[hdr_i + 1:]:
    v = r[t].replace(",", "") if len(r) > max(k, t) else ""
    if v.replace(".", "", 1).isdigit():  # not the units row or program output
        launches.append((r[k], float(v)))
adam = [i for i, (name, _) in enumerate(launches) if "adamw_kernel" in name]
last = launches[adam[-2] + 1:adam[-1] + 1] if len(adam) >= 2 else launches
tot, cnt = collections.Counter(), collections.Counter()
for name, ns in last:
    tot[name[:110]] += ns
    cnt[name[:110]] += 1
print(f"last step: {sum(tot.values()) / 1e6:.1f} ms of kernels over {len(last)} launches")
for name, ns in tot.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
    print(f"{ns / 1e6:8.2f} ms {cnt[name]:5d}x  {name}")
