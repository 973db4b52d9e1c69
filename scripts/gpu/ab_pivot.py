# SPDX-License-Identifier: MIT OR Apache-2.0
"""The A/B rows of `speed.sh ab` (ab-rows.md: `| <binary> <row> | <value> |`) as one table: a line
per row, a column per binary in the order of $AB, so that each row's values sit side by side.

    python3 scripts/gpu/ab_pivot.py ab-rows.md met met_p met-METRALE_GEMV_NORM-all
"""

import sys
from pathlib import Path


def main():
    rows_file, binaries = Path(sys.argv[1]), sys.argv[2:]
    # Longest names first, so that "met_p" is not read as "met" with a row starting "_p".
    by_length = sorted(binaries, key=len, reverse=True)
    table, order = {}, []
    for line in rows_file.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2:
            continue
        label, value = cells
        binary = next((b for b in by_length if label.startswith(b + " ")), None)
        if binary is None:
            continue
        row = label[len(binary) + 1:]
        if row not in table:
            table[row] = {}
            order.append(row)
        table[row][binary] = value
    print("| row | " + " | ".join(binaries) + " |")
    print("|---|" + "---|" * len(binaries))
    for row in sorted(order):
        print(f"| {row} | " + " | ".join(table[row].get(b, "-") for b in binaries) + " |")


if __name__ == "__main__":
    main()
