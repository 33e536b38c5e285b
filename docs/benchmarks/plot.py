"""Draw the headline benchmark plots from docs/benchmarks/results.csv.

    python3 docs/benchmarks/plot.py [RESULTS_CSV] [--out DIR]

writes decode.png, train.png, serve.png and scaling.png into DIR (default docs/img/) and prints their paths.
Each plot picks its rows by `figure` name and `at` keys; a row that is missing leaves its point out, and a
row that cannot be read is skipped with a warning, so a partial file still draws.

A row's `at` is `key=value` pairs joined by `;`. Rows without `model=` are the Qwen3-30B-A3B shape, cut to
`layers=` layers; rows without `gpus=` ran on one GPU.
"""

import argparse
import csv
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CSV = HERE / "results.csv"
DEFAULT_OUT = HERE.parent / "img"
CAPTION = "from docs/benchmarks/results.csv"
WIDTH_IN, DPI = 10.0, 100  # 1000 px wide
MOEMESH = "#1f5fa8"
PEER_COLOURS = {
    "transformers": "#c0392b",
    "transformers+peft": "#c0392b",
    "transformers generate_batch": "#c0392b",
    "gpt-fast compiled": "#e08e0b",
    "gpt-fast int8": "#8e44ad",
    "engine alone": "#7f8c8d",
    "one GPU": "#7f8c8d",
}
PEER_MARKERS = {"gpt-fast compiled": "D", "gpt-fast int8": "s", "transformers": "^"}


@dataclass(frozen=True)
class Row:
    figure: str
    at: dict[str, str]
    value: float
    unit: str
    peer: str
    peer_value: float | None
    device: str
    command: str
    date: str
    commit: str


def parse_at(text: str) -> dict[str, str]:
    """`batch=64;layers=48` -> {"batch": "64", "layers": "48"}; raises ValueError on a part without `=`."""
    at = {}
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"at {text!r}: {part!r} is not key=value")
        at[key.strip()] = value.strip()
    return at


def read_rows(path: Path) -> list[Row]:
    rows = []
    with open(path, newline="") as f:
        for line, raw in enumerate(csv.DictReader(f), start=2):
            try:
                peer_value = (raw.get("peer_value") or "").strip()
                rows.append(
                    Row(
                        figure=raw["figure"].strip(),
                        at=parse_at(raw["at"]),
                        value=float(raw["value"]),
                        unit=(raw.get("unit") or "").strip(),
                        peer=(raw.get("peer") or "").strip(),
                        peer_value=float(peer_value) if peer_value else None,
                        device=(raw.get("device") or "").strip(),
                        command=(raw.get("command") or "").strip(),
                        date=(raw.get("date") or "").strip(),
                        commit=(raw.get("commit") or "").strip(),
                    )
                )
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                print(f"{path}:{line}: row skipped ({e})", file=sys.stderr)
    return rows


def pick(rows: Iterable[Row], figure: str, without: Iterable[str] = (), **at: str) -> list[Row]:
    """Rows of `figure` whose `at` holds every given key=value and none of the keys in `without`."""
    without = tuple(without)
    return [
        r
        for r in rows
        if r.figure == figure
        and all(r.at.get(k) == str(v) for k, v in at.items())
        and not any(k in r.at for k in without)
    ]


def latest(rows: Iterable[Row], key: str) -> dict[float, Row]:
    """For each value of the `at` key, the row measured last (the current figure)."""
    best: dict[float, Row] = {}
    for r in rows:
        try:
            x = float(r.at[key])
        except (KeyError, ValueError):
            continue
        if x not in best or r.date > best[x].date:
            best[x] = r
    return best


def peers(rows: Iterable[Row], key: str) -> dict[str, dict[float, Row]]:
    """peer name -> {x: row}, the latest row that measured that peer at each x."""
    out: dict[str, dict[float, Row]] = {}
    for r in rows:
        if r.peer and r.peer_value is not None:
            out.setdefault(r.peer, {})
            for x, row in latest([r], key).items():
                if x not in out[r.peer] or row.date > out[r.peer][x].date:
                    out[r.peer][x] = row
    return out


def devices(rows: Iterable[Row]) -> str:
    """`1x NVIDIA H200` or, for several counts of one kind, `1x/2x/4x NVIDIA H200`."""
    names = sorted({r.device for r in rows if r.device})
    if not names:
        return "no rows"
    counts, kinds = zip(*(n.split(" ", 1) if re.fullmatch(r"\d+x .+", n) else ("", n) for n in names))
    if len(set(kinds)) == 1 and all(counts):
        return "/".join(sorted(counts, key=lambda c: int(c[:-1]))) + " " + kinds[0]
    return ", ".join(names)


def dates(rows: Iterable[Row]) -> str:
    ds = sorted({r.date for r in rows if r.date})
    if not ds:
        return ""
    return ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}"


def fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.4g}"


def new_figure(ncols: int, height: float = 5.6, widths: list[float] | None = None):
    fig, axes = plt.subplots(
        1, ncols, figsize=(WIDTH_IN, height), dpi=DPI, squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax in axes[0]:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:g}"))
    return fig, list(axes[0])


def finish(fig, title: str, rows: list[Row], path: Path) -> Path:
    fig.suptitle(title, fontsize=12, fontweight="bold")
    span = dates(rows)
    fig.text(0.01, 0.01, CAPTION + (f" ({len(rows)} rows, measured {span})" if rows else ""), fontsize=8, color="0.35")
    fig.tight_layout(rect=(0, 0.035, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no rows for {what}", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def label_points(ax, xs, ys, colour, dy: int = 7, above: bool = True) -> None:
    for x, y in zip(xs, ys):
        ax.annotate(
            fmt(y),
            (x, y),
            textcoords="offset points",
            xytext=(0, dy if above else -dy),
            ha="center",
            va="bottom" if above else "top",
            fontsize=8,
            color=colour,
        )


def log2_axis(ax, ticks: Iterable[float]) -> None:
    ticks = sorted(set(ticks))
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt(t) for t in ticks])
        ax.set_xlim(ticks[0] / 1.6, ticks[-1] * 1.6)
    ax.minorticks_off()


def plot_decode(rows: list[Row], out: Path) -> Path:
    """decode ms/token against batch, one GPU, the 48-layer shape: moemesh beside each peer."""
    sel = pick(rows, "decode ms/token", without=("gpus", "model", "base"), layers="48")
    fig, (ax,) = new_figure(1)
    if not sel:
        empty(ax, "decode ms/token")
        return finish(fig, "Decode ms/token against batch", sel, out / "decode.png")

    current = latest(sel, "batch")
    xs = sorted(current)
    ys = [current[x].value for x in xs]
    ax.plot(xs, ys, "o-", color=MOEMESH, lw=2.2, ms=7, label="moemesh, the latest run at each batch", zorder=5)
    label_points(ax, xs, ys, MOEMESH, above=False)

    for k, (name, points) in enumerate(sorted(peers(sel, "batch").items())):
        pxs = sorted(points)
        pys = [points[x].peer_value for x in pxs]
        colour = PEER_COLOURS.get(name, "0.3")
        # how much faster moemesh was than this peer in the run that measured both
        ratios = ", ".join(f"{points[x].peer_value / points[x].value:.2f}× at {fmt(x)}" for x in pxs)
        label = f"{name} ({dates(points.values())}); moemesh {ratios}"
        ax.plot(
            pxs,
            pys,
            marker=PEER_MARKERS.get(name, "o"),
            ls="--" if len(pxs) > 1 else "",
            color=colour,
            ms=8,
            label=label,
        )
        right = k % 2 == 0  # peers measured at one batch alternate sides so that their labels stay apart
        for x, y in zip(pxs, pys):
            ax.annotate(
                fmt(y),
                (x, y),
                textcoords="offset points",
                xytext=(9 if right else -9, 0),
                ha="left" if right else "right",
                va="center",
                fontsize=8,
                color=colour,
            )
        # moemesh's own figure in the run that measured this peer, where the current one is a later run
        own = [
            (x, points[x].value)
            for x in pxs
            if (points[x].date, points[x].value) != (current[x].date, current[x].value)
        ]
        if own:
            oxs, oys = [x for x, _ in own], [y for _, y in own]
            ax.plot(
                oxs,
                oys,
                "o",
                mfc="none",
                mec=colour,
                mew=1.5,
                ms=8,
                label=f"moemesh in the run beside {name} ({dates(points[x] for x in oxs)})",
            )
            for x, y in own:
                ax.annotate(
                    fmt(y),
                    (x, y),
                    textcoords="offset points",
                    xytext=(-9 if right else 9, 0),
                    ha="right" if right else "left",
                    va="center",
                    fontsize=8,
                    color=colour,
                )
    log2_axis(ax, [float(r.at["batch"]) for r in sel])
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences decoded together)")
    ax.set_ylabel("ms/token: one decode step (log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    title = f"Decode latency against batch: {devices(sel)}, Qwen3-30B-A3B shape (48 layers), bf16"
    return finish(fig, title, sel, out / "decode.png")


def bars(ax, groups: list[str], series: list[tuple[str, list[float | None], str]], notes=None) -> None:
    """Grouped bars; a None value leaves its bar out. notes[i][j]: text under bar j of group i."""
    n = max(len(series), 1)
    width = 0.8 / n
    for j, (name, values, colour) in enumerate(series):
        labelled = False
        for i, v in enumerate(values):
            if v is None:
                continue
            x = i + (j - (n - 1) / 2) * width
            ax.bar(x, v, width * 0.92, color=colour, label=None if labelled else name)
            labelled = True
            ax.annotate(fmt(v), (x, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9)
            if notes and notes[i][j]:
                ax.text(
                    x,
                    v * 0.5,
                    notes[i][j],
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                    fontweight="bold",
                    rotation=90,
                )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)


def plot_train(rows: list[Row], out: Path) -> Path:
    """Training tokens/s against transformers (MFU and memory on the bars); LoRA against PEFT."""
    fig, (ax1, ax2) = new_figure(2, height=5.8, widths=[1, 1.6])
    used: list[Row] = []

    step = pick(rows, "train tokens/s", without=("gpus", "model", "recompute"), layers="6")
    step = max(step, key=lambda r: r.date, default=None)
    if step is None:
        empty(ax1, "train tokens/s")
    else:
        used.append(step)
        mfu = max(pick(rows, "train MFU", without=("gpus",), layers="6"), key=lambda r: r.date, default=None)
        mem = max(
            pick(rows, "train peak memory GiB", without=("gpus",), layers="6"), key=lambda r: r.date, default=None
        )
        used += [r for r in (mfu, mem) if r is not None]

        def note(r, own):
            if r is None:
                return ""
            v = r.value if own else r.peer_value
            return "" if v is None else f"{v:.1f}{'%' if r.unit == '%' else ' ' + r.unit}"

        peer = step.peer or "peer"
        notes = [[f"MFU {note(mfu, True)}, {note(mem, True)}", f"MFU {note(mfu, False)}, {note(mem, False)}"]]
        bars(
            ax1,
            ["forward, backward, AdamW\n(bars: MFU, peak memory)"],
            [("moemesh", [step.value], MOEMESH), (peer, [step.peer_value], PEER_COLOURS.get(peer, "0.5"))],
            notes,
        )
        if step.peer_value:
            ax1.set_title(f"Whole step, 6 layers: {step.value / step.peer_value:.2f}× {peer}", fontsize=10)
        ax1.set_xlabel(f"4 × 4,096 tokens a step ({step.date})")
        ax1.set_ylabel("training tokens/s (one GPU)")
        ax1.legend(fontsize=9, loc="upper right")
        ax1.set_ylim(0, max(step.value, step.peer_value or 0) * 1.3)

    lora = pick(rows, "lora tokens/s", without=("gpus", "model", "base", "packed"), layers="48")
    if not lora:
        empty(ax2, "lora tokens/s")
    else:
        by_target = {r.at.get("targets", "?"): r for r in sorted(lora, key=lambda r: r.date)}
        targets = sorted(by_target, key=lambda t: -len(t))
        mems = {
            r.at.get("targets"): r
            for r in pick(rows, "lora peak memory GiB", without=("gpus", "model", "base", "packed"), layers="48")
        }
        used += list(by_target.values()) + list(mems.values())
        notes = []
        for t in targets:
            m = mems.get(t)
            notes.append([f"{m.value:.1f} GiB" if m else "", f"{m.peer_value:.1f} GiB" if m and m.peer_value else ""])
        peer = next((r.peer for r in by_target.values() if r.peer), "peer")
        bars(
            ax2,
            [t.replace("+", " +\n") for t in targets],
            [
                ("moemesh", [by_target[t].value for t in targets], MOEMESH),
                (peer, [by_target[t].peer_value for t in targets], PEER_COLOURS.get(peer, "0.5")),
            ],
            notes,
        )
        ratios = ", ".join(
            f"{by_target[t].value / by_target[t].peer_value:.2f}×" for t in targets if by_target[t].peer_value
        )
        ax2.set_title(f"LoRA r=16, 48 layers: {ratios} {peer}", fontsize=10)
        ax2.set_ylabel("LoRA training tokens/s (one GPU)")
        ax2.set_xlabel(f"adapters on; 4,096 tokens a step ({dates(by_target.values())}); bars: peak memory")
        ax2.legend(fontsize=9, loc="upper left")
        top = max(max(r.value, r.peer_value or 0) for r in by_target.values())
        ax2.set_ylim(0, top * 1.3)
    title = f"Training against transformers: {devices(used)}, Qwen3-30B-A3B shape, bf16"
    return finish(fig, title, used, out / "train.png")


def pair_labels(ax, xs, ys, colour, others: dict[float, float], dx: int = 0) -> None:
    """Value labels above a point that is above its pair in `others` (or has none), else below it;
    dx < 0 puts them up-left or down-left of the point."""
    for x, y in zip(xs, ys):
        above = y >= others.get(x, float("-inf"))
        ax.annotate(
            fmt(y),
            (x, y),
            textcoords="offset points",
            xytext=(dx, 9 if above else -9),
            ha="center" if dx == 0 else ("right" if dx < 0 else "left"),
            va="bottom" if above else "top",
            fontsize=8,
            color=colour,
        )


def plot_serve(rows: list[Row], out: Path) -> Path:
    """Served tokens/s and first-token time p50 against clients, beside the engine alone."""
    fig, (ax1, ax2) = new_figure(2)
    used: list[Row] = []
    grey = PEER_COLOURS["engine alone"]
    for ax, figure, ylabel in (
        (ax1, "serve tokens/s", "tokens/s delivered to all clients"),
        (ax2, "serve TTFT p50 ms", "time to first token, p50 (ms)"),
    ):
        sel = pick(rows, figure, without=("gpus", "model", "base"), layers="48")
        if not sel:
            empty(ax, figure)
            continue
        used += sel
        # one line a workload (requests a client); the one measured at the most client counts first
        groups: dict[str, list[Row]] = {}
        for r in sel:
            groups.setdefault(r.at.get("requests", ""), []).append(r)
        order = sorted(groups, key=lambda k: (-len(latest(groups[k], "clients")), k))
        for k, requests in enumerate(order):
            current = latest(groups[requests], "clients")
            xs = sorted(current)
            ys = [current[x].value for x in xs]
            engine = {x: r for x, r in current.items() if r.peer == "engine alone" and r.peer_value is not None}
            exs = sorted(engine)
            eys = [engine[x].peer_value for x in exs]
            what = f"{requests} requests a client, {dates(current.values())}"
            if k == 0:
                ax.plot(xs, ys, "o-", color=MOEMESH, ms=8, lw=2, label=f"moemesh serve ({what})")
                ax.plot(exs, eys, "s--", color=grey, ms=7, label=f"its engine alone, no HTTP ({what})")
                pair_labels(ax, xs, ys, MOEMESH, dict(zip(exs, eys)))
                pair_labels(ax, exs, eys, grey, dict(zip(xs, ys)), dx=-6)
                continue
            colour = ("#16a085", "#8e44ad", "#e08e0b")[(k - 1) % 3]
            ax.plot(xs, ys, "*", color=colour, ms=14, label=f"moemesh serve ({what})")
            ax.plot(exs, eys, "s", mfc="none", mec=colour, mew=1.5, ms=8, label=f"its engine alone ({what})")
            for x in xs:
                text = f"{what}:\nserved {fmt(current[x].value)}"
                if x in engine:
                    text += f", engine alone {fmt(engine[x].peer_value)}"
                ax.annotate(
                    text,
                    (x, current[x].value),
                    xytext=(0.05, 0.62 - 0.12 * (k - 1)),
                    textcoords="axes fraction",
                    fontsize=8,
                    color=colour,
                    arrowprops={"arrowstyle": "->", "color": colour, "lw": 1},
                )
        log2_axis(ax, [float(r.at["clients"]) for r in sel if "clients" in r.at])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(max(r.value, r.peer_value or 0) for r in sel) * 1.45)
    title = f"moemesh serve under load: {devices(used)}, Qwen3-30B-A3B shape (48 layers), 512-token prompts"
    return finish(fig, title, used, out / "serve.png")


def plot_scaling(rows: list[Row], out: Path) -> Path:
    """Training tokens/s per GPU against GPUs; tensor-parallel decode's speed-up over one GPU."""
    fig, (ax1, ax2) = new_figure(2)
    used: list[Row] = []

    train = pick(rows, "train tokens/s per GPU", without=("model",), layers="6")
    if not train:
        empty(ax1, "train tokens/s per GPU")
    else:
        used += train
        one = latest([r for r in train if r.at.get("gpus", "1") == "1" and "layout" not in r.at], "gpus").get(1.0)
        if one is not None:
            ax1.plot([1], [one.value], "o", color="black", ms=8, label=f"one GPU ({one.date})", zorder=6)
            ax1.annotate(
                fmt(one.value), (1, one.value), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8
            )
            ax1.axhline(one.value, color="0.5", ls=":", lw=1.2, label="one GPU's tokens/s per GPU (linear)")
        layouts = sorted({r.at["layout"] for r in train if "layout" in r.at})
        for k, layout in enumerate(layouts):
            current = latest([r for r in train if r.at.get("layout") == layout], "gpus")
            xs = sorted(current)
            ys = [current[x].value for x in xs]
            # a layout measured against the one GPU of its own call starts from it
            base = next((current[x].peer_value for x in xs if current[x].peer == "one GPU"), None)
            if base is not None and 1.0 not in xs:
                xs, ys = [1.0] + xs, [base] + ys
            colour = (MOEMESH, "#16a085", "#e08e0b")[k % 3]
            ax1.plot(xs, ys, "o-" if base else "o--", color=colour, lw=2, ms=7, label=f"moemesh train, {layout}")
            for x in xs:
                if x not in current:
                    continue
                r = current[x]
                share = f" ({r.value / r.peer_value:.0%})" if r.peer == "one GPU" and r.peer_value else ""
                ax1.annotate(
                    fmt(r.value) + share,
                    (x, r.value),
                    textcoords="offset points",
                    xytext=(0, -10),
                    ha="center",
                    va="top",
                    fontsize=8,
                    color=colour,
                )
        full = pick(rows, "train tokens/s per GPU", without=("model",), layers="48")
        if full:
            f = max(full, key=lambda r: r.date)
            used.append(f)
            mfu = pick(rows, "train MFU", layers="48", gpus=f.at.get("gpus", "1"))
            ax1.text(
                0.03,
                0.05,
                f"full 48-layer model, {f.at.get('layout', '')} on {f.at.get('gpus', '1')} GPUs ({f.date}):\n"
                f"{fmt(f.value)} tokens/s per GPU" + (f", MFU {mfu[0].value:g}%" if mfu else ""),
                transform=ax1.transAxes,
                fontsize=8,
                color="0.25",
            )
        ticks = [float(r.at.get("gpus", "1")) for r in train]
        log2_axis(ax1, ticks + [1.0])
        ax1.set_ylim(0, max(r.value for r in train) * 1.35)
        ax1.set_xlabel("GPUs")
        ax1.set_ylabel("training tokens/s per GPU")
        ax1.set_title("Training (moemesh train), 6 layers, 4 × 4,096 tokens a GPU\n(% of one GPU's)", fontsize=10)
        ax1.grid(True, alpha=0.3)
        ax1.legend(fontsize=8, loc="upper right")

    series = []
    for figure, batch, ms in (("decode ms/token", "1", True), ("decode tokens/s", "64", False)):
        for r in pick(rows, figure, without=("model", "base"), layers="48", batch=batch):
            if "gpus" in r.at and r.peer == "one GPU" and r.peer_value:
                speedup = r.peer_value / r.value if ms else r.value / r.peer_value
                series.append((batch, r.at.get("layout", "tp"), float(r.at["gpus"]), speedup, r))
    if not series:
        empty(ax2, "decode against one GPU")
    else:
        used += [s[-1] for s in series]
        styles = {"1": "o-", "64": "s-"}
        colours = {"tp": MOEMESH, "tp-ep": "#16a085"}
        names = {"tp": "--tp N", "tp-ep": "--tp N --ep N"}
        for batch, layout in sorted({(s[0], s[1]) for s in series}, key=lambda k: (int(k[0]), k[1])):
            pts = sorted((s[2], s[3]) for s in series if s[0] == batch and s[1] == layout)
            xs, ys = [1.0] + [p[0] for p in pts], [1.0] + [p[1] for p in pts]
            colour = colours.get(layout, "0.3")
            ax2.plot(
                xs,
                ys,
                styles.get(batch, "o-"),
                color=colour,
                lw=2,
                ms=7,
                alpha=1.0 if batch == "64" else 0.75,
                label=f"{names.get(layout, layout)}, batch {batch}",
            )
            for x, y in zip(xs[1:], ys[1:]):
                right = layout == "tp"  # the two layouts' labels on either side of their points
                ax2.annotate(
                    f"{y:.2f}×",
                    (x, y),
                    textcoords="offset points",
                    xytext=(8 if right else -8, 0),
                    ha="left" if right else "right",
                    va="center",
                    fontsize=8,
                    color=colour,
                )
        ax2.plot([1, 4], [1, 4], ":", color="0.5", lw=1.2, label="linear")
        log2_axis(ax2, [1.0, 2.0, 4.0])
        ax2.set_ylim(0.8, 4.3)
        ax2.set_xlabel("GPUs (tensor parallel; batch 1: ms/token, batch 64: tokens/s)")
        ax2.set_ylabel("decode speed-up over one GPU")
        ax2.set_title("Decoding, 48 layers: the engine's step\nagainst one GPU in the same call", fontsize=10)
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8, loc="upper left")
    title = f"Scaling over GPUs: {devices(used)}, Qwen3-30B-A3B shape, bf16"
    return finish(fig, title, used, out / "scaling.png")


PLOTS = (plot_decode, plot_train, plot_serve, plot_scaling)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_CSV, help=f"default: {DEFAULT_CSV}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    rows = read_rows(args.results)
    paths = [draw(rows, args.out) for draw in PLOTS]
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
