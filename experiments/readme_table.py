"""The README's results table, generated from the reproductions' JSON (``python -m cde_nets.experiments.readme_table``).

Reads ``<dir>/<name>.json`` for every registered reproduction (default ``experiments/recorded_results``: the
committed runs, full setting where it was run, else quick) and rewrites the block between ``<!-- results:start -->``
and ``<!-- results:end -->`` of ``README.md`` (``--check`` only reports whether it is current). Rows print
"published | ours" as the runs wrote them; nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .margins import RECORDED, check
from .registry import REPRODUCTIONS
from .report import _fmt

START, END = "<!-- results:start -->", "<!-- results:end -->"
FOLD_ROWS = 40  # longer sections (the adjoint and conservation sweeps) are folded into <details>


def margin_table(results_dir: Path) -> list[str]:
    """Markdown: the issue-6 margins (:mod:`experiments.margins`) against the recorded runs."""
    out = ["**Margins** (full setting; `python -m cde_nets.experiments.margins` checks them)", "",
           "| reproduction | setting | margin | published | ours | |", "|---|---|---|---|---|---|"]
    for r in check(results_dir):
        ours = "—" if r["ours"] is None else f"{r['ours']:.8g}"
        out.append(f"| {r['reproduction']} | {r['setting']} | {r['margin']} | {r['published']} | {ours} | "
                   f"{r['status']} |")
    return out + [""]


def table(results_dir: Path) -> str:
    """Markdown: the margins, then one section per reproduction found: setting, time, rows and notes."""
    out = margin_table(results_dir)
    for name in REPRODUCTIONS:
        path = results_dir / f"{name}.json"
        if not path.exists():
            out.append(f"**{name}**: not run in this setting.\n")
            continue
        res = json.loads(path.read_text())
        where = f"({res['size']} setting, seed {res['seed']}, {res['time_s']:.0f} s)"
        n_rows = len(res["rows"])
        head = (f"<details><summary><b>{name}</b> {where}: {n_rows} rows</summary>" if n_rows > FOLD_ROWS
                else f"**{name}** {where}")
        out += [head, "", "| setting | published | ours |", "|---|---|---|"]
        out += [f"| {r['setting']} | {_fmt(r['published'], r.get('unit', ''))} | {_fmt(r['ours'], r.get('unit', ''))} |"
                for r in res["rows"]]
        out += [""] + [f"_{n}_\n" for n in res.get("notes", [])]
        out += ["</details>", ""] if n_rows > FOLD_ROWS else []
    return "\n".join(out).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    if START not in readme or END not in readme:
        raise ValueError(f"README.md has no {START} … {END} block to fill; add the two markers where the table goes.")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cde_nets.experiments.readme_table", description=__doc__)
    p.add_argument("--from", dest="src", default=str(RECORDED), help="folder of <name>.json results")
    p.add_argument("--readme", default="README.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the README's table is not the generated one")
    a = p.parse_args(argv)
    readme = Path(a.readme)
    new = splice(readme.read_text(), table(Path(a.src)))
    if a.check:
        current = new == readme.read_text()
        print("README results table is current" if current else "README results table is stale; rerun without --check")
        return 0 if current else 1
    readme.write_text(new)
    print(f"wrote the results table from {a.src} into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
