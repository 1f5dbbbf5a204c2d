"""A figure a page quotes from a result file agrees with the file, to the precision the page shows.

The pages (README.md, docs/*.md, benchmarks/README.md, the README of each benchmarks/ folder, and the text a causal
model's card takes from ran_hf/model_cards/causal_memory.md) say where each checked figure comes from in an HTML
comment beside it, which a rendered page does not show:

* one figure: `61 s<!-- figure: benchmarks/commands/run_pipeline.json: only(d["results"]["wall_seconds"])["median"] -->`.
  The figure is the last number before the comment on its line; the expression gives the value it shows, from `d`,
  the result file.
* a table: a comment on the line before its header,

      <!-- table:
      m = benchmarks/memory/memory_cpu.json
      rows = m["results"]
      3 = r["tensor_peak_bytes"] / 2**20
      -->

  `NAME = PATH` loads a result file, `rows` gives one item per row of the table (None: the row is not checked), and
  `N = EXPRESSION` gives the value of column N (counting from 1) from the row's item `r`: the cell's first number, or
  no number where it gives None.

Expressions are Python over the loaded files and `only`, `pick` and `mean` below. A figure agrees with its value when
they differ by at most half a unit of its last digit ("1.000" is not 0.9933; "99%" is 0.985 to 0.995 as 98.5 to
99.5, the expression giving percent). Numbers may hold thousands separators; "K" after a number is not part of it.
"""

import json
import math
import re
import statistics
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "benchmarks").glob("*/README.md"), ROOT / "benchmarks" / "README.md"])
PAGES += sorted((ROOT / "docs").glob("*.md"))
PAGES += [ROOT / "src" / "ran_hf" / "model_cards" / "causal_memory.md"]  # a causal model's card: the design's table
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
FIGURE = re.compile(r"<!-- figure: (?P<path>\S+\.json): (?P<expression>.+?) -->")
TABLE = re.compile(r"^<!-- table:\n(?P<body>.*?)^-->\n", re.MULTILINE | re.DOTALL)
# Figures every one of these pages must keep checked (its markers, at least this many): removing a marker is no
# way to make a drifted figure pass.
CHECKED_AT_LEAST = {
    "README.md": 8,  # set-up, main job, test command, CI and import times; recall and passkey figures
    "docs/training.md": 6,  # the main job's metrics and time, in its section and in the summary table
    "docs/long-inputs.md": 56,  # the memory table: 14 rows of 4 figures
    "docs/memory.md": 20,  # the recall tables of the spread layout: RAN against its anchors
    "benchmarks/README.md": 6,  # the commands' times and the main job's metrics
    "benchmarks/memory_tasks/README.md": 35,  # issue 62's lever, grid-point, QA1 and LM tables
    "docs/architecture.md": 15,  # the memory tables: RAN beside its baselines, and the levers
    "docs/generation.md": 56,  # the per-call tables and the associative memory's step
    "src/ran_hf/model_cards/causal_memory.md": 12,  # the state-tracking table of a causal model's card
}


def only(mapping: dict):
    """The one value of a mapping (a result file's figures keyed by the command they timed)."""
    (value,) = mapping.values()
    return value


def pick(items: list, **fields):
    """The one item of `items` whose fields have these values."""
    found = [item for item in items if all(item.get(name) == value for name, value in fields.items())]
    assert len(found) == 1, f"{len(found)} items with {fields}"
    return found[0]


HELPERS = {"only": only, "pick": pick, "mean": statistics.fmean}


def shown_number(text: str) -> tuple[float, int]:
    """A figure as a page writes it ("1,015", "0.993") and the number of decimals it shows."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text.replace(",", "")), decimals


def agrees(text: str | None, value) -> bool:
    """Whether a figure as shown (None: the cell shows no number) is the value (None: no number to show)."""
    if text is None or value is None:
        return text is None and value is None
    shown, decimals = shown_number(text)
    return math.isfinite(value) and abs(value - shown) <= 0.5 * 10**-decimals + 1e-9


def load(path: str) -> dict:
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    return json.loads(file.read_text())


def figures(page: Path) -> list[tuple[str, str, object]]:
    """(where, the figure as shown or None, the value from its result file) for every figure the page marks."""
    text = page.read_text()
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        start = 0
        for marker in FIGURE.finditer(line):
            before = NUMBER.findall(line[start : marker.start()])
            assert before, f"{page.name}:{number}: no figure before {marker.group(0)}"
            value = eval(marker["expression"], {**HELPERS, "d": load(marker["path"])})
            found.append((f"{page.name}:{number}", before[-1], value))
            start = marker.end()
    for table in TABLE.finditer(text):
        first_row = text[: table.end()].count("\n") + 3  # the line of the table's first row, after its header
        names, columns = dict(HELPERS), {}
        for statement in filter(None, map(str.strip, table["body"].splitlines())):
            name, expression = (part.strip() for part in statement.split("=", 1))
            if expression.endswith(".json"):
                names[name] = load(expression)
            elif name == "rows":
                names["rows"] = eval(expression, names)
            else:
                columns[int(name)] = expression
        rows = text[table.end() :].splitlines()
        rows = rows[2 : next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]
        assert len(rows) == len(names["rows"]), (
            f"{page.name}:{first_row}: {len(rows)} rows, {len(names['rows'])} items"
        )
        for row_number, (row, item) in enumerate(zip(rows, names["rows"]), start=first_row):
            if item is None:
                continue
            cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
            for column, expression in columns.items():
                value = eval(expression, {**names, "r": item})
                numbers = NUMBER.findall(re.sub(r"\[[^\]]*\]\([^)]*\)", "", cells[column - 1]))
                found.append((f"{page.name}:{row_number}, column {column}", numbers[0] if numbers else None, value))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_marked_figure_agrees_with_its_result_file(page):
    drifted = [
        f"{where}: the page shows {shown}, the file gives {value}"
        for where, shown, value in figures(page)
        if not agrees(shown, value)
    ]
    assert not drifted, "\n".join(drifted)


@pytest.mark.parametrize("name, least", CHECKED_AT_LEAST.items())
def test_the_pages_keep_their_figures_checked(name, least):
    assert len(figures(ROOT / name)) >= least


def test_a_drifted_figure_is_caught(tmp_path, monkeypatch):
    """The checks themselves: the figure before a marker, a table's cells, the precision shown."""
    result = tmp_path / "benchmarks" / "result.json"
    result.parent.mkdir()
    result.write_text(
        json.dumps({"results": {"accuracy": 0.9933, "runs": [{"n": 1024, "s": 2.34}, {"n": 2, "s": 0}]}})
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    page = tmp_path / "page.md"
    marker = '<!-- figure: benchmarks/result.json: 100 * d["results"]["accuracy"] -->'
    table = (
        "<!-- table:\nf = benchmarks/result.json\nrows = f['results']['runs']\n1 = r['n']\n2 = r['s'] or None\n-->\n"
        "| n | s |\n|---|---|\n| 1,024 (x) | 2.3 |\n| 2 | – |\n"
    )
    for figure, good in (("99.3%", True), ("99%", True), ("100.0%", False), ("99.4%", False)):
        page.write_text(f"validation accuracy **{figure}**{marker}, and 3 more.\n\n{table}")
        assert [(shown, agrees(shown, value)) for _, shown, value in figures(page)][0] == (figure[:-1], good)
    page.write_text(table.replace("| 2.3 |", "| 2.4 |").replace("| 2 | – |", "| 2 | 0.1 |"))
    checked = [(shown, value) for _, shown, value in figures(page)]
    assert checked == [("1,024", 1024), ("2.4", 2.34), ("2", 2), ("0.1", None)]
    assert [agrees(shown, value) for shown, value in checked] == [True, False, True, False]


def test_every_memory_task_result_is_listed_with_its_command():
    """The memory-tasks README's Files table names every result file of its folder (the command that wrote it beside
    it), and every file it names is there."""
    folder = ROOT / "benchmarks" / "memory_tasks"
    files_table = (folder / "README.md").read_text().split("\n## Files\n", 1)[1]
    listed = set(re.findall(r"\[`([\w.-]+?)\.(?:\{md,json,png\}|md|json)`\]", files_table))
    results = {path.stem for path in folder.glob("*.json")}
    assert not results - listed, f"result files missing from the Files table: {sorted(results - listed)}"
    assert not listed - results, f"the Files table names files that are not there: {sorted(listed - results)}"
