"""Warp-stall shares of one kernel from an ncu source-page CSV export.

    ncu --import REPORT --page source --csv --print-source sass > k.csv
    python benches/attention/ncu_stalls.py k.csv [N]

Prints the first kernel's total stall samples, the share of each stall reason, and the N
instructions with the most samples (with the reasons holding over a fifth of each).
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys


def kernels(path: str) -> list[dict]:
    """The export's kernels: name, header row and instruction rows."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    out, cur = [], None
    for r in rows:
        if r and r[0] == "Kernel Name":
            cur = {"name": r[1], "rows": []}
            out.append(cur)
        elif r and r[0] == "Address" and cur is not None:
            cur["hdr"] = r
        elif r and cur is not None:
            cur["rows"].append(r)
    return out


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    k = kernels(path)[0]
    ix = {name: i for i, name in enumerate(k["hdr"])}
    reasons = [h for h in k["hdr"] if h.startswith("stall_") and "Not Issued" not in h]
    total, n, per = collections.Counter(), 0, []
    for r in k["rows"]:
        try:
            s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        except (ValueError, IndexError):
            continue
        n += s
        big = {}
        for h in reasons:
            v = int(r[ix[h]] or 0)
            total[h] += v
            if v > 0.2 * s:
                big[h] = v
        per.append((s, r[ix["Address"]], r[ix["Source"]][:70], big))
    print(k["name"], "samples", n)
    for h, v in total.most_common(10):
        print(f"  {h:22s} {v / n * 100:5.1f}%")
    per.sort(key=lambda p: p[0], reverse=True)
    for s, addr, src, big in per[:top]:
        print(f"  {s / n * 100:5.1f}% {addr} {src:70s} {big}")


if __name__ == "__main__":
    main()
