"""unit: the shared output of the benchmarks (``bench/report.py``): how each names the machine it ran
on, and how its figures keep their titles inside them."""

from __future__ import annotations

import builtins
import io

import pytest

from triode.bench.report import machine_description

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16

"""


@pytest.fixture
def cpuinfo(monkeypatch):
    def read(text):
        real_open = builtins.open
        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(text)
                            if path == "/proc/cpuinfo" else real_open(path, *a, **k))
    return read


def test_a_bare_model_name_gets_the_family_and_model(cpuinfo):
    """Under KVM a Zen 4 and a Zen 5 both say "AMD EPYC"; their speeds differ twofold."""
    cpuinfo(CPUINFO)
    assert machine_description().startswith("AMD EPYC family 26 model 2 (AVX2 AVX-512 VNNI BF16), ")


def test_the_first_cpu_alone_is_read_with_or_without_a_closing_blank_line(cpuinfo):
    cpuinfo(CPUINFO.split("\n\n")[0])
    assert machine_description().startswith("AMD EPYC family 26 model 2 (AVX2 AVX-512 VNNI BF16), ")
    cpuinfo("model name\t: Some CPU\nflags\t\t: fpu avx2\n")
    assert machine_description().startswith("Some CPU (AVX2), ")


def test_a_title_wider_than_the_figure_is_wrapped_within_it():
    """A long title (the vLLM comparison's, with its rounds) lost both ends in the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    from triode.bench.report import fit_title

    long = "Offline output tokens/s against vLLM's CPU build (bfloat16, each engine's best of 3 rounds)"
    for title, lines in ((long, 2), ("Decode step time, context 512", 1)):
        figure, axis = pyplot.subplots(figsize=(7, 4.5))
        axis.set_ylabel("output tokens / s")
        fit_title(figure, axis, title)
        shown = axis.get_title()
        extent = axis.title.get_window_extent(figure.canvas.get_renderer())
        pyplot.close(figure)
        assert shown.count("\n") + 1 == lines, shown
        assert shown.replace("\n", " ") == title
        assert 0 <= extent.x0 and extent.x1 <= figure.get_window_extent().width


def test_a_missing_figure_is_labelled_not_drawn_as_zero(tmp_path, monkeypatch):
    """A peer that failed in one setting was drawn as a bar labelled 0 tok/s: it gets no bar
    and the label "n/a" now, and the scale is set by the figures there are."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    from triode.bench.report import plot_bars

    closed = []
    monkeypatch.setattr(pyplot, "close", closed.append)
    plot_bars(tmp_path / "bars.png", title="t", y_label="tok/s", groups=["same", "defaults"],
              series={"triode": [512.0, 273.0], "vLLM": [442.0, None]})
    assert len(closed) == 1
    axis = closed[0].axes[0]
    assert [text.get_text() for text in axis.texts] == ["512", "273", "442", "n/a"]
    assert sorted(patch.get_height() for patch in axis.patches) == [0.0, 273.0, 442.0, 512.0]
    assert (tmp_path / "bars.png").stat().st_size > 0
