"""Shared output of the benchmark commands: an aligned table on stdout, JSON, and a PNG."""

from __future__ import annotations

import json
import os
import platform
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# The CPU features a figure here depends on, as /proc/cpuinfo names them and as docs write them.
_CPU_FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16",
                 "amx_tile": "AMX"}


def cpu_fields(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The first CPU's fields in ``cpuinfo`` ("model name", "flags", ...); empty where it
    cannot be read."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    first_cpu = lines[:lines.index("")] if "" in lines else lines
    return dict(tuple(part.strip() for part in line.split(":", 1)) for line in first_cpu if ":" in line)


def machine_description() -> str:
    fields = cpu_fields()
    cpu = fields.get("model name", platform.processor() or platform.machine())
    # Under a hypervisor the model name can be as bare as "AMD EPYC": the family and model
    # tell a Zen 4 (family 25) from a Zen 5 (family 26), whose speeds differ twofold.
    if "cpu family" in fields and "model" in fields:
        cpu += f" family {fields['cpu family']} model {fields['model']}"
    flags = set(fields.get("flags", "").split())
    features = " ".join(name for flag, name in _CPU_FEATURES.items() if flag in flags)
    threads = torch.get_num_threads()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}{f' ({features})' if features else ''}, {os.cpu_count()} cores, torch {torch.__version__} " \
        f"({threads} threads){gpu}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_format(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_description(), **payload}, indent=2))


def plot_lines(
    path: Path,
    *,
    title: str,
    x_label: str,
    y_label: str,
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    log_x: bool = False,
    tick_labels: Sequence[str] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        axis.plot(x, values, marker="o", label=label)
    if log_x:
        axis.set_xscale("log", base=2)
    axis.set_xticks(list(x), list(tick_labels) if tick_labels is not None else [str(v) for v in x])
    axis.set_xlabel(x_label)
    axis.set_ylabel(y_label)
    axis.grid(True, alpha=0.3)
    axis.legend()
    fit_title(figure, axis, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def plot_bars(
    path: Path,
    *,
    title: str,
    y_label: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
) -> None:
    """Grouped bars, one series a colour, each labelled with its value; a None (a peer that
    failed, a ceiling not measured) gets no bar and the label "n/a", never a bar of 0."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(7, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        positions = [g + i * width for g in range(len(groups))]
        bars = axis.bar(positions, [0.0 if v is None else v for v in values], width=width, label=label)
        axis.bar_label(bars, labels=["n/a" if v is None else f"{v:.0f}" for v in values])
    axis.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], list(groups))
    axis.set_ylabel(y_label)
    # The legend in one row where its labels fit the width, else one label a row; headroom
    # above the tallest bar for it, so that it never hides a bar's label.
    columns = len(series) if sum(len(label) for label in series) <= 80 else 1
    rows = -(-len(series) // columns)
    axis.set_ylim(top=(1.15 + 0.1 * rows) * max((v for values in series.values() for v in values if v is not None), default=1))
    axis.legend(loc="upper center", ncols=columns)
    fit_title(figure, axis, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def fit_title(figure: Any, axis: Any, title: str) -> None:
    """Sets ``title`` on ``axis``, wrapped onto as few lines as keep it within ``figure`` (a
    title wider than the figure lost both its ends in the PNG), and lays the figure out."""
    figure.tight_layout()  # where the axis will be: the title is centred on it, not the figure
    renderer, right = figure.canvas.get_renderer(), figure.get_window_extent().width
    for width in range(len(title), 9, -1):
        extent = axis.set_title(textwrap.fill(title, width)).get_window_extent(renderer)
        if extent.x0 >= 0 and extent.x1 <= right:
            break
    figure.tight_layout()


def load_hf_reference(model_path: Path, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """transformers' model of a resolved model directory. A directory that triode converted
    from GGUF holds quantized blocks transformers cannot read; where it keeps the source file
    (the default model does), transformers reads that, dequantizing it as it loads."""
    from transformers import AutoModelForCausalLM

    ggufs = sorted(Path(model_path).glob("*.gguf"))
    source = {"gguf_file": ggufs[0].name} if ggufs else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **source)
    return model.to(device).eval()
