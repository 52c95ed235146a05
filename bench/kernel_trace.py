#!/usr/bin/env python3
"""The GPU's idle time in one training step, from bench/kernel_trace.cpp's CSV.

  python3 bench/kernel_trace.py trace.csv [ROWS]

The step is the last one whose AdamW ran: from the end of the AdamW launch before it to
the end of its own. Busy time is the union of the kernels, copies and sets on every
stream; idle is the rest. Idle gaps are summed by the pair of kernels around them, with
the host's waits (synchronising runtime calls) that overlap each, largest first, so the
cause of each gap can be read off its neighbours.
"""
import collections
import csv
import sys


def short(name):
    name = (name[5:] if name.startswith("void ") else name).replace("<unnamed>::", "")
    name = name.split("(")[0].split("<")[0]
    return name.replace("mt::", "").replace("cutlass::device_kernel", "cutlass")[:60]


rows = list(csv.DictReader(open(sys.argv[1])))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
work = sorted((int(r["start"]), int(r["end"]), r["name"]) for r in rows if r["kind"] != "wait")
waits = [(int(r["start"]), int(r["end"]), r["name"]) for r in rows if r["kind"] == "wait"]
adam = [i for i, w in enumerate(work) if "adamw_kernel" in w[2]]
if len(adam) < 2:
    sys.exit("kernel_trace.py: fewer than two AdamW launches in the trace")
t0, t1 = work[adam[-2]][1], work[adam[-1]][1]
step = [w for w in work if w[0] >= t0 and w[1] <= t1]
busy, end, gaps = 0, t0, collections.defaultdict(lambda: [0, 0, collections.Counter()])
prev = "adamw_kernel"
for s, e, name in step:
    if s > end:
        g = gaps[(short(prev), short(name))]
        g[0] += s - end
        g[1] += 1
        for ws, we, wn in waits:
            if ws < s and we > end:
                g[2][wn] += 1
    if e > end:
        busy += e - max(s, end)
        end = e
    prev = name
span = t1 - t0
kernel_sum = sum(e - s for s, e, _ in step)
print(f"step {span / 1e6:.2f} ms: GPU busy {busy / 1e6:.2f} ms, idle {(span - busy) / 1e6:.2f} ms "
      f"({100 * (span - busy) / span:.1f}%); {len(step)} launches, their sum {kernel_sum / 1e6:.2f} ms; "
      f"{sum(1 for w in waits if w[0] >= t0 and w[1] <= t1)} host waits of 5 us or more")
print("idle ms, gaps, between, and the host's waits in them:")
for (a, b), (ns, n, w) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{ns / 1e6:8.3f} {n:5d}  {a} -> {b}  {dict(w) if w else ''}")
