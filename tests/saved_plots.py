"""Read back what a benchmark plotted: each figure saved through matplotlib is kept, with its path and dpi, so a test
can compare the drawn data with the result file it was drawn from, and the PNG on disk with the figure."""

from pathlib import Path

from PIL import Image


def record_saved_figures(monkeypatch) -> list:
    """[(path, figure, dpi)] of every `Figure.savefig` call from now to the test's end, the figure left readable."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def recording_savefig(figure, path, *args, **kwargs):
        savefig(figure, path, *args, **kwargs)
        saved.append((Path(path), figure, kwargs.get("dpi", figure.dpi)))

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return saved


def assert_png_of(path: Path, figure, dpi: float) -> None:
    """`path` is a whole PNG of `figure`: the format, and the size in pixels its inches at `dpi` give."""
    with Image.open(path) as image:
        image.verify()  # the whole file decodes (a truncated PNG fails here)
        assert image.format == "PNG"
        width, height = (round(inches * dpi) for inches in figure.get_size_inches())
        assert image.size == (width, height), (image.size, (width, height))
