"""docs/benchmarks/results.csv, the headline figures as data, and docs/benchmarks/plot.py, which draws them."""

import csv
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks" / "results.csv"
PLOT = ROOT / "docs" / "benchmarks" / "plot.py"
HEADER = ["figure", "at", "value", "unit", "peer", "peer_value", "device", "command", "date", "commit"]
OPTIONAL = {"peer", "peer_value"}
PLOTS = {"decode.png", "train.png", "serve.png", "scaling.png"}


def rows():
    with open(RESULTS, newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == HEADER
        return [dict(zip(HEADER, r)) | {"_line": n, "_width": len(r)} for n, r in enumerate(reader, start=2)]


def load_plot():
    """docs/benchmarks/plot.py as a module (it is no package's; a dataclass needs it in sys.modules)."""
    if "benchmark_plot" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmark_plot", PLOT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["benchmark_plot"]


def test_every_row_is_complete_and_well_formed():
    all_rows = rows()
    assert len(all_rows) >= 30
    for r in all_rows:
        where = f"results.csv:{r['_line']}"
        assert r["_width"] == len(HEADER), f"{where}: {r['_width']} columns"
        for column in HEADER:
            if column not in OPTIONAL:
                assert r[column].strip(), f"{where}: {column} is empty"
        float(r["value"])  # numeric
        assert bool(r["peer"].strip()) == bool(r["peer_value"].strip()), f"{where}: a peer without its value or back"
        if r["peer_value"]:
            float(r["peer_value"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), f"{where}: date {r['date']!r}"
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]), f"{where}: commit {r['commit']!r}"
        assert re.search(r"(^|[\s/])bench/\S+|(^|\s)(-m )?moemesh(\s|$)", r["command"]), (
            f"{where}: command names no script under bench/ nor moemesh: {r['command']!r}"
        )
        keys = []
        for part in r["at"].split(";"):
            key, sep, value = part.partition("=")
            assert sep and key and value and key == key.strip(), f"{where}: at {r['at']!r}"
            keys.append(key)
        assert keys == sorted(set(keys)), f"{where}: at's keys sorted and once each: {r['at']!r}"


def test_no_figure_is_there_twice():
    seen = {}
    for r in rows():
        key = (r["figure"], r["at"], r["peer"], r["device"])
        assert key not in seen, f"results.csv:{r['_line']} repeats line {seen[key]}: {key}"
        seen[key] = r["_line"]


def test_plot_draws_the_four_pngs(tmp_path, capsys):
    paths = load_plot().main([str(RESULTS), "--out", str(tmp_path)])
    assert {p.name for p in paths} == PLOTS
    for name in PLOTS:
        png = tmp_path / name
        assert png.stat().st_size > 10_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.split() == [str(p) for p in paths]


@pytest.mark.parametrize("keep", [0, 5])
def test_plot_survives_a_partial_file(tmp_path, keep):
    """A file with few rows, and one it cannot read, still gives four plots (points left out)."""
    lines = RESULTS.read_text().splitlines()
    partial = tmp_path / "partial.csv"
    partial.write_text("\n".join([lines[0], *lines[1 : 1 + keep], "decode ms/token,batch=2,not a number"]) + "\n")
    paths = load_plot().main([str(partial), "--out", str(tmp_path / "img")])
    assert all(p.stat().st_size > 0 for p in paths) and len(paths) == 4
