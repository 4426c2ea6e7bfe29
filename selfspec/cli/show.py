"""An answer with each token marked by where it came from (:data:`selfspec.engine.decoding.SOURCES`).

In a terminal each source has a colour; elsewhere (``color=False``: a pipe, a file, ``NO_COLOR``) copied tokens
stand in ``[...]``, drafted ones in ``{...}`` and the verify pass's own in ``<...>``; plain steps stay unmarked.
"""

from __future__ import annotations

COLORS = {"copy": "\033[44;97m", "draft": "\033[42;30m", "verify": "\033[43;30m", "step": ""}  # blue, green, yellow
RESET = "\033[0m"
MARKS = {"copy": ("[", "]"), "draft": ("{", "}"), "verify": ("<", ">"), "step": ("", "")}
NAMES = {"copy": "copied from the context", "draft": "drafted and accepted", "verify": "from the verify pass",
         "step": "a plain full-model step"}


def pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds (decoding the whole prefix each time, so a character split over tokens stays whole)."""
    out, before = [], ""
    for i in range(len(tokens)):
        text = tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
        out.append(text[len(before):] if text.startswith(before) else text)
        before = text
    return out


def render(texts: list[str], sources: list[str], color: bool) -> str:
    """Join ``texts``, each marked by its source; runs of one source share one mark."""
    out, i = [], 0
    while i < len(texts):
        j = i
        while j < len(texts) and sources[j] == sources[i]:
            j += 1
        run, kind = "".join(texts[i:j]), sources[i]
        if color and COLORS.get(kind):
            out.append("\n".join(f"{COLORS[kind]}{part}{RESET}" if part else "" for part in run.split("\n")))
        else:
            left, right = MARKS.get(kind, ("", ""))
            out.append(f"{left}{run}{right}" if run else "")
        i = j
    return "".join(out)


def legend(sources: list[str], color: bool) -> str:
    """One line naming each source with its mark and how many tokens came from it."""
    parts = []
    for kind in ("copy", "draft", "verify", "step"):
        n = sources.count(kind)
        sample = render([kind], [kind], color) if kind != "step" else "plain"
        parts.append(f"{sample} {NAMES[kind]}: {n}")
    return "   ".join(parts)


SHORT = {"copy": "copied", "draft": "drafted, accepted", "verify": "verify pass", "step": "plain step"}
FILL = {"copy": "#9ec5fe", "draft": "#a3e4a1", "verify": "#ffe08a", "step": None}  # the terminal's colours, lighter


def save_png(texts: list[str], sources: list[str], path, width: int = 96) -> None:
    """Draw the marked answer into a PNG at ``path``: a monospace grid ``width`` characters wide, each character on
    its token's colour, and a legend line under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cells, row, col = [], 0, 0
    for text, kind in zip(texts, sources):
        for ch in text:
            if ch == "\n" or col >= width:
                row, col = row + 1, 0
                if ch == "\n":
                    continue
            cells.append((row, col, ch, kind))
            col += 1
    rows = row + 3
    fig = plt.figure(figsize=(width * 0.11, rows * 0.22), dpi=110)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(rows, -0.5)
    ax.axis("off")
    for r, c, ch, kind in cells:
        if FILL.get(kind):
            ax.add_patch(Rectangle((c, r - 0.5), 1, 1, color=FILL[kind], linewidth=0))
        ax.text(c + 0.5, r, ch, family="monospace", fontsize=9, ha="center", va="center")
    x = 0.0
    for kind in ("copy", "draft", "verify", "step"):
        label = f" {SHORT[kind]}: {sources.count(kind)} "
        ax.add_patch(Rectangle((x, rows - 1.5), len(label), 1, color=FILL[kind] or "#eeeeee", linewidth=0))
        ax.text(x, rows - 1, label, family="monospace", fontsize=9, va="center")
        x += len(label) + 2
    fig.savefig(path)
    plt.close(fig)
