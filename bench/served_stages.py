"""Join the stage timestamps of moemesh/inference/probe.py (this commit only) into a table of each
stage of a served request, ms p50 / p90 / mean, for the requests of one load (their id prefix,
e.g. serve_64_: bench/serve_load.py names them by pass and client count):

    rm -rf /tmp/probe; PYTHONPATH=. python3 bench/serve_load.py --layers 48 --clients 1,64 --long-prompt 0
    python3 bench/served_stages.py /tmp/probe serve_64_
"""

import glob
import statistics
import sys
from collections import defaultdict

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe"
prefix = sys.argv[2] if len(sys.argv) > 2 else "serve_64_"
by_pid, by_key = defaultdict(dict), defaultdict(dict)
for path in glob.glob(f"{root}/*.txt"):
    for line in open(path):
        f = line.split()
        kind = f[0]
        if kind == "client":
            by_pid[f[1]]["client_sent"], by_pid[f[1]]["client_first"] = float(f[2]), float(f[3])
        elif kind in ("asgi", "route", "sent", "client_req"):
            by_pid[f[1]].setdefault(kind, float(f[2]))
        elif kind == "accepted":
            by_pid[f[1]]["key"], by_pid[f[1]]["accepted"] = int(f[2]), float(f[3])
        else:
            by_key[int(f[1])].setdefault(kind, float(f[2]))
stages = [
    ("client_sent", "client_req"),
    ("client_req", "asgi"),
    ("asgi", "route"),
    ("route", "submit"),
    ("submit", "accepted"),
    ("submit", "first"),
    ("first", "delivered"),
    ("delivered", "dispatch"),
    ("dispatch", "yield"),
    ("yield", "sent"),
    ("sent", "client_first"),
    ("client_sent", "client_first"),
]
rows = defaultdict(list)
for pid, r in by_pid.items():
    if not pid.startswith(prefix) or "key" not in r or "client_first" not in r:
        continue
    r = {**r, **by_key[r["key"]]}
    for a, b in stages:
        if a in r and b in r:
            rows[(a, b)].append((r[b] - r[a]) * 1e3)
print(f"| stage ({prefix}) | n | p50 ms | p90 ms | mean ms |\n|---|---|---|---|---|")
for a, b in stages:
    v = sorted(rows[(a, b)])
    if v:
        print(
            f"| {a} → {b} | {len(v)} | {statistics.median(v):.2f} | {v[int(0.9 * (len(v) - 1))]:.2f} "
            f"| {statistics.mean(v):.2f} |"
        )
