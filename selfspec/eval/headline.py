"""The README's headline block, built from the ``headline`` run's table rows (never typed by hand).

One line per task set and for the mean of the four: our AR's tokens/s, each method's speedup over it with half a
95% paired-bootstrap interval, the searched draft's share of outputs equal to AR's, and the searched draft over the
fastest transformers peer with its paired interval. The block sits between two HTML comments in the README, so
``python -m selfspec.tables --readme`` can rewrite it in place.
"""

from __future__ import annotations

from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.eval.tables import speedup_text

BEGIN, END = "<!-- headline: begin (python -m selfspec.tables --readme) -->", "<!-- headline: end -->"
SETS = ["humaneval", "gsm8k", "mtbench", "summarization"]
# method -> column ("searched draft": the run's plan; "-avx2": a draft searched on the other CPU kind, where run)
SHOWN = {"autoregressive": None, "self_speculative": "searched draft", "self_speculative-avx2": "AVX2 search",
         "self_speculative-skiponly": "layer skip only", "hf_prompt_lookup-n5": "prompt lookup",
         "hf_assisted-n8": "assisted (0.5B)"}


def headline_table(rows: list[dict]) -> str:
    """The compact Markdown table of the headline run's rows (as :func:`selfspec.eval.tables.table_rows` gives)."""
    cell = {(r["dataset"], r["method"]): r for r in rows if r["variant"] == "default"}
    methods = [m for m in SHOWN if any(k[1] == m for k in cell) and SHOWN[m]]
    heads = ["task set", "AR tok/s", *(SHOWN[m] for m in methods), "match AR", "searched over fastest peer (95%)"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    sets = [d for d in [*SETS, "unseen"] if (d, "autoregressive") in cell]
    for d in sets:
        ar, sp = cell[(d, "autoregressive")], cell.get((d, "self_speculative"), {})
        peer = (f"{sp['over_peer']:.2f}x ({sp['over_peer_ci95'][0]:.2f}-{sp['over_peer_ci95'][1]:.2f})"
                if sp.get("over_peer") else "-")
        lines.append("| " + " | ".join([
            "unseen prompt kinds" if d == "unseen" else d, f"{ar['tokens_per_s']:.2f}",
            *(speedup_text(cell[(d, m)]["speedup"], cell[(d, m)].get("speedup_ci95")) if (d, m) in cell else "-"
              for m in methods),
            f"{sp['greedy_match']:.2f}" if sp.get("greedy_match") is not None else "-", peer]) + " |")
        if d == SETS[-1] and all((s, "autoregressive") in cell for s in SETS):
            means = [sum(cell[(s, m)]["speedup"] for s in SETS) / len(SETS)
                     if all((s, m) in cell for s in SETS) else None for m in methods]
            cells = [f"**{speedup_text(v)}**" if v is not None else "-" for v in means]
            lines.append("| **mean of the four** | | " + " | ".join(cells) + " | | |")
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, rows: list[dict], table_md: str) -> None:
    """Rewrite the block between :data:`BEGIN` and :data:`END` in ``readme``: the headline's conditions (the
    provenance list at the top of ``table_md``, the full table) and :func:`headline_table`."""
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SelfSpecError(f"{readme} has no headline block ({BEGIN} ... {END})")
    conditions = [line for line in table_md.splitlines() if line.startswith("- ")]
    block = "\n".join([BEGIN, "", headline_table(rows), *conditions, "- full table: `results/tables/headline.md`", "",
                       END])
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + block + rest.split(END, 1)[1], encoding="utf-8")
