"""The tables of docs/benchmarks/*.md, rendered from the JSON results in docs/benchmarks/results/.

Each results file holds a list of tables; a table names its machine, date, command and source
(the run it comes from), and carries its columns and rows. A page marks where a table goes:

    <!-- table: ID -->
    ...generated, do not edit...
    <!-- /table -->

    python scripts/benchmark_tables.py            # rewrite every page's tables from the JSON
    python scripts/benchmark_tables.py --check    # exit 1 naming the pages whose tables differ

A new measurement goes into the JSON (``--out`` of a benchmark gives the record to copy the
figures, machine and command from), then this script puts it on the page; tests/test_scripts.py
fails where a page's tables differ from what this renders.

The README's results are a summary of these tables: ``docs/benchmarks/summary.json`` picks rows
(a table id, the row's first cell, the columns read for tokens per forward and for speed, and
what the row is), and the README marks its place with ``<!-- summary -->`` ... ``<!-- /summary -->``.
Each picked row names its source: the table's machine, date, command, note and the speed
column's header, and the page the table is on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks"
RESULTS = DOCS / "results"
SUMMARY = DOCS / "summary.json"
README = REPO / "README.md"
PICK = ("what", "table", "row", "tokens_per_forward", "speed")
REQUIRED = ("id", "machine", "date", "command", "source", "columns", "rows")
MARKER = re.compile(r"(<!-- table: (?P<id>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
SUMMARY_MARKER = re.compile(r"(<!-- summary -->\n)(.*?)(<!-- /summary -->)", re.S)


def load_tables(results: Path = RESULTS) -> dict[str, dict]:
    """Every table of every results file, by id; a table missing a field or a duplicate id is an error."""
    tables: dict[str, dict] = {}
    for path in sorted(results.glob("*.json")):
        for table in json.loads(path.read_text())["tables"]:
            missing = [k for k in REQUIRED if k not in table]
            if missing:
                raise SystemExit(f"error: {path.name}: table {table.get('id', '?')} lacks {', '.join(missing)}")
            if table["id"] in tables:
                raise SystemExit(f"error: {path.name}: table id {table['id']} is used twice")
            if any(len(row) != len(table["columns"]) for row in table["rows"]):
                raise SystemExit(f"error: {path.name}: table {table['id']} has a row of another width than its columns")
            tables[table["id"]] = {**table, "file": path.name}
    return tables


def render(table: dict) -> str:
    """The caption (machine first: one machine per table) and the markdown table."""
    date = table["date"] or "undated in its source"
    caption = f"*{table['machine']}; {date}; `{table['command']}`.*"
    if table.get("note"):
        caption += f" {table['note']}"
    lines = [caption, "", "| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]]
    lines += ["", f"<sub>Source: {table['source']} (results/{table['file']}, `{table['id']}`).</sub>"]
    return "\n".join(lines) + "\n"


def fill(page: str, tables: dict[str, dict]) -> str:
    """``page`` with every marked table rendered anew; an unknown id is an error."""
    def one(match: re.Match) -> str:
        key = match["id"]
        if key not in tables:
            raise SystemExit(f"error: a page marks table {key}, which no results file holds")
        return match[1] + render(tables[key]) + match[4]
    return MARKER.sub(one, page)


def marked(page: str) -> list[str]:
    return [m["id"] for m in MARKER.finditer(page)]


def cell(table: dict, row: str, column: str) -> str:
    """The cell of ``table`` in the row whose first cell is ``row`` and the column headed ``column``."""
    rows = [r for r in table["rows"] if r[0] == row]
    if not rows or column not in table["columns"]:
        missing = f"no row {row!r}" if not rows else f"no column {column!r}"
        raise SystemExit(f"error: summary.json picks {missing} of table {table['id']}")
    return str(rows[0][table["columns"].index(column)])


def render_summary(picks: list[dict], tables: dict[str, dict], pages: dict[str, str]) -> str:
    """The README's table: a row per pick (what, tokens per forward, speed, its source's number),
    then the sources: machine, date, command, the table's note, the speed column's header, its page."""
    sources: list[tuple[str, str]] = []  # (table id, speed column), numbered in order of first use
    lines = ["| what | tokens / forward | speed | source |", "|---|---|---|---|"]
    for pick in picks:
        missing = [k for k in PICK if k not in pick]
        if missing or pick["table"] not in tables:
            raise SystemExit(f"error: summary.json: a pick lacks {', '.join(missing)}" if missing else
                             f"error: summary.json picks table {pick['table']}, which no results file holds")
        table = tables[pick["table"]]
        key = (pick["table"], pick["speed"])
        sources += [key] if key not in sources else []
        tpf = cell(table, pick["row"], pick["tokens_per_forward"]) if pick["tokens_per_forward"] else "-"
        lines.append(f"| {pick['what']} | {tpf} | {cell(table, pick['row'], pick['speed'])} | {sources.index(key) + 1} |")
    lines.append("")
    for n, (key, column) in enumerate(sources, 1):
        table = tables[key]
        note = f" {table['note']}" if table.get("note") else ""
        page = pages[key]
        lines.append(f"{n}. *{table['machine']}; {table['date'] or 'undated'}; `{table['command']}`.*{note} "
                     f"Speed: {column}. ([{page}](docs/benchmarks/{page}))")
    return "\n".join(lines) + "\n"


def fill_summary(readme: str, tables: dict[str, dict], picks: list[dict], pages: dict[str, str]) -> str:
    """``readme`` with its summary rendered anew (unchanged where it marks none)."""
    return SUMMARY_MARKER.sub(lambda m: m[1] + render_summary(picks, tables, pages) + m[3], readme)


def table_pages() -> dict[str, str]:
    """Table id -> the page (file name) that marks it."""
    return {key: page.name for page in sorted(DOCS.glob("*.md")) for key in marked(page.read_text())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only say which pages differ from the JSON (exit 1 if any)")
    args = p.parse_args(argv)
    tables = load_tables()
    stale = []
    picks = json.loads(SUMMARY.read_text())["rows"]
    for page in [*sorted(DOCS.glob("*.md")), README]:
        text = page.read_text()
        new = fill_summary(text, tables, picks, table_pages()) if page == README else fill(text, tables)
        if new != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"error: tables differ from docs/benchmarks/results in {', '.join(stale)}; "
              "run python scripts/benchmark_tables.py", file=sys.stderr)
        return 1
    print(("rewrote " if stale else "up to date: ") + (", ".join(stale) or f"{len(tables)} tables"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
