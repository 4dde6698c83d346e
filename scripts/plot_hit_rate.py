#!/usr/bin/env python3
"""Plots kvcm-bench results: hit rate vs cache capacity, one line per policy, one panel per
workload.

Needs matplotlib, which kvcm's build and tests do not: scripts/plot.sh runs this script
with matplotlib from a virtual environment of its own.

    build/test/bench/kvcm-bench --gpus=8 --csv=results.csv
    scripts/plot.sh results.csv -o hit_rate.png

When the CSV holds several cluster modes (global, local), each policy gets one line per mode:
solid for global, dashed for local. Capacity is on a log axis, as a percentage of the
workload's distinct pages.
"""

import argparse
import collections
import csv
import math
import sys

LINE_STYLES = {"global": "-", "local": "--"}
MARKERS = "osD^vP*X"


def read_rows(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: no result rows")
    required = {"workload", "policy", "mode", "capacity_fraction"}
    missing = required - set(rows[0])
    if missing:
        sys.exit(f"{path}: missing columns {sorted(missing)}; is it a kvcm-bench --csv file?")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="kvcm-bench --csv output")
    parser.add_argument("-o", "--output", default="hit_rate.png", help="PNG to write")
    parser.add_argument(
        "--metric",
        default="token_hit_rate",
        choices=["token_hit_rate", "request_hit_rate"],
        help="which hit rate to plot (default: token_hit_rate)",
    )
    parser.add_argument("--mode", choices=["global", "local"], help="plot only this mode")
    parser.add_argument(
        "--backing",
        default="index",
        choices=["index", "agent"],
        help="rows of this pool backing (kvcm-bench --backing=both writes both; default: index)",
    )
    args = parser.parse_args()

    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is missing: pip install matplotlib")

    rows = read_rows(args.csv)
    # Files from before --backing have no such column: index-only pools.
    rows = [r for r in rows if r.get("backing", "index") == args.backing]
    if not rows:
        sys.exit(f"{args.csv}: no rows of backing {args.backing}")
    if args.mode:
        rows = [r for r in rows if r["mode"] == args.mode]
        if not rows:
            sys.exit(f"{args.csv}: no rows of mode {args.mode}")

    # workload -> (policy, mode) -> [(capacity %, hit rate %)]
    series = collections.OrderedDict()
    policies = []
    gpus = sorted({r.get("gpus", "1") for r in rows})
    for r in rows:
        lines = series.setdefault(r["workload"], collections.OrderedDict())
        lines.setdefault((r["policy"], r["mode"]), []).append(
            (float(r["capacity_fraction"]) * 100, float(r[args.metric]) * 100)
        )
        if r["policy"] not in policies:
            policies.append(r["policy"])

    cols = min(3, len(series))
    nrows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (workload, lines) in zip(axes.flat, series.items()):
        for (policy, mode), points in lines.items():
            points.sort()
            i = policies.index(policy)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                LINE_STYLES.get(mode, ":"),
                color=colors[i % len(colors)],
                marker=MARKERS[i % len(MARKERS)],
                markersize=4,
                label=f"{policy} ({mode})",
            )
        ax.set_title(workload)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (% of distinct pages)")
        ax.set_ylabel(args.metric.replace("_", " ") + " (%)")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(series) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"kvcm-bench: {args.metric.replace('_', ' ')} vs capacity, {'/'.join(gpus)} GPU(s), "
        f"{'agent-backed' if args.backing == 'agent' else 'index-only'} pools"
    )
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
