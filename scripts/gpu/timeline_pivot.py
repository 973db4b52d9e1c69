#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Side by side: the batch-1 timelines of `met bench-model --timeline` (a trace build) run under
several variants, one column per variant.

Each argument is NAME=FILE, FILE the output of one run. A row per launch label: the mean span (the
launch's share of the step's critical path, from its block 0's release to the next launch's) and,
in brackets, how long block 0 waited in its programmatic-launch wait (it was resident that long
before the launch before it finished). Then the summed spans of the step and the step's device
time as bench-model timed it (outside the trace).
"""
import re
import sys


def parse(path):
    """(per-label {label: (waited, span)} in order, total span µs, device ms) of the batch-1
    timeline in one run's output."""
    labels, total, device_ms = {}, None, None
    section = False
    for line in open(path, encoding="utf-8", errors="replace"):
        m = re.match(r"\| decode step, device time only \| 1 \| \d+ \| ([0-9.]+) ", line)
        if m:
            device_ms = float(m.group(1))
        if line.startswith("timeline: decode batch"):
            section = line.startswith("timeline: decode batch 1,")
            m = re.search(r"([0-9.]+) µs from the first wait", line)
            if section and m:
                total = float(m.group(1))
            continue
        if not section:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| # "):
            section = False  # the per-launch table follows the per-label one
            continue
        if len(cells) == 5 and re.fullmatch(r"\d+", cells[1]):
            labels[cells[0]] = (float(cells[2]), float(cells[3]))
    return labels, total, device_ms


def main():
    runs = []
    for arg in sys.argv[1:]:
        name, _, path = arg.partition("=")
        if not path:
            sys.exit(f"expected NAME=FILE, got {arg!r}")
        runs.append((name, parse(path)))
    if not runs:
        sys.exit(__doc__)
    order = []
    for _, (labels, _, _) in runs:
        order += [label for label in labels if label not in order]
    print("| launch (batch 1): span µs (waited µs) | " + " | ".join(name for name, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for label in order:
        cells = []
        for _, (labels, _, _) in runs:
            got = labels.get(label)
            cells.append(f"{got[1]:.2f} ({got[0]:.2f})" if got else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| first release to last, µs | " + " | ".join(
        f"{total:.1f}" if total is not None else "-" for _, (_, total, _) in runs) + " |")
    print("| step, device time only, ms | " + " | ".join(
        f"{ms:.3f}" if ms is not None else "-" for _, (_, _, ms) in runs) + " |")


if __name__ == "__main__":
    main()
