"""The generate command marks each emitted token by its source."""

from selfspec.cli.show import legend, render


def test_render_marks_runs_of_one_source():
    texts, sources = ["def", " f", "(x)", ":", "\n  return"], ["step", "copy", "copy", "draft", "verify"]
    assert render(texts, sources, color=False) == "def[ f(x)]{:}<\n  return>"
    colored = render(texts, sources, color=True)
    assert "\033[44;97m f(x)\033[0m" in colored and colored.startswith("def")
    assert "\033[43;30m\033[0m\n\033[43;30m  return\033[0m" not in colored  # a newline is never coloured
    assert "copied from the context: 2" in legend(sources, color=False)
