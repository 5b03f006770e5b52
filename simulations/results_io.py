"""What every experiment script in ``simulations/`` writes into its results folder:
``<stem>.md`` (title, table lines, notes), ``<stem>.csv``, ``runs.json`` and ``command.txt``
(the command that produced them, when, how long, on what machine)."""

from __future__ import annotations

import csv
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path


def markdown(title: str, lines: list[str], notes: list[str]) -> str:
    return f"# {title}\n\n" + "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def write_csv(table: list[dict], path: Path, drop: tuple = ()) -> None:
    """The table's rows as CSV (``None`` as empty; fields with commas quoted)."""
    keys = [k for k in table[0] if k not in drop]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: ("" if t[k] is None else t[k]) for k in keys} for t in table)


def write_results(out: Path, stem: str, md: str, table: list[dict], runs: dict, script: str,
                  argv, total: float, drop: tuple = (), note: str = "") -> None:
    """Write ``<stem>.md``, ``<stem>.csv`` (without the ``drop`` columns), ``runs.json`` and
    ``command.txt`` into ``out``."""
    (out / f"{stem}.md").write_text(md)
    write_csv(table, out / f"{stem}.csv", drop)
    (out / "runs.json").write_text(json.dumps(runs, indent=2, default=str))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    args = " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:]))
    (out / "command.txt").write_text(
        f"$ python simulations/{Path(script).name} {args}\n"
        f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, {total:.0f} s wall, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), 1-min load average at the end {load:.1f}"
        + (f"; {note}" if note else "") + "\n")
