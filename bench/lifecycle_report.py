"""The lifecycle matrix as tables: ``python bench/lifecycle_report.py out.json [more.json ...]``.

Reads the ``--json`` files of ``bench/lifecycle.py`` runs (one run, or one per worker class) and
prints, per worker class, a Markdown table: a row per event, a column per clients × app, and in
each cell forkserve's lost requests of those sent beside gunicorn's (``n/a`` where gunicorn has
no such event, ``not run`` where the run left it out). A cell whose verdict is not ``pass`` is marked ``✗`` and its reasons are listed
under the table, with the failures by kind, for both servers.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lifecycle import APP_NAMES, CLASSES, CLIENT_MODES, EVENTS, GUNICORN_EVENTS  # noqa: E402

Key = tuple[str, str, str, str]  # class, event, clients, app


def side(cell: dict[str, Any] | None, event: str) -> str:
    if cell is None:
        return "not run" if event in GUNICORN_EVENTS else "n/a"
    mark = "" if cell["verdict"] == "pass" else " ✗"
    return f"{cell['lost']}/{cell['sent']:,}{mark}"


def reasons(cell: dict[str, Any]) -> str:
    failures = " ".join(f"{k}={n}" for k, n in cell["failures"].items()) or "no failures"
    extra = []
    if cell["event"] == "term" and cell.get("exit_after_last_response") is not None:
        extra.append(f"exit {cell['exit_after_last_response'] * 1000:.0f} ms after the last response")
    if cell.get("replacement"):
        extra.append("replaced in " + ", ".join("never" if r is None else f"{r * 1000:.0f} ms"
                                                for r in cell["replacement"]))
    notes = "; ".join(cell.get("notes", []))
    return (f"{cell['verdict']} ({failures}{', ' if extra else ''}{', '.join(extra)})"
            + (f"; notes: {notes}" if notes else ""))


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    cells: dict[str, dict[Key, dict[str, Any]]] = defaultdict(dict)
    for path in paths:
        for cell in json.loads(Path(path).read_text()):
            key = (cell["worker_class"], cell["event"], cell["clients"], cell["app"])
            cells[cell["server"]][key] = cell
    fs, gu = cells.get("forkserve", {}), cells.get("gunicorn", {})
    columns = [(m, a) for m in CLIENT_MODES for a in APP_NAMES
               if any(k[2] == m and k[3] == a for k in {**fs, **gu})]
    totals = {"forkserve": [0, 0, 0, 0], "gunicorn": [0, 0, 0, 0]}  # cells, failing, lost, sent
    for server, table in cells.items():
        for cell in table.values():
            t = totals[server]
            t[0] += 1
            t[1] += cell["verdict"] != "pass"
            t[2] += cell["lost"]
            t[3] += cell["sent"]
    for cls in CLASSES:
        events = [e for e in EVENTS if any(k[0] == cls and k[1] == e for k in fs)]
        if not events:
            continue
        print(f"\n### {cls} (forkserve lost/sent · gunicorn lost/sent)\n")
        print("| event | " + " | ".join(f"{m} {a}" for m, a in columns) + " |")
        print("|---|" + "---|" * len(columns))
        failing = []
        for event in events:
            row = []
            for mode, app in columns:
                key = (cls, event, mode, app)
                f, g = fs.get(key), gu.get(key)
                if f is None and g is None:
                    row.append("")
                    continue
                row.append(f"{side(f, event)} · {side(g, event)}")
                failing += [(key, c) for c in (f, g) if c is not None and c["verdict"] != "pass"]
            times = next((c["times"] for k, c in fs.items() if k[:2] == (cls, event)), 1)
            print(f"| {event}{f' ×{times}' if times != 1 else ''} | " + " | ".join(row) + " |")
        if failing:
            print()
            for key, cell in failing:
                print(f"- {cell['server']} {' '.join(key)}: {reasons(cell)}")
    print()
    for server, (n, failing_n, lost, sent) in totals.items():
        if n:
            print(f"{server}: {n} cells, {failing_n} not passing, {lost:,} requests lost of {sent:,} sent")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
