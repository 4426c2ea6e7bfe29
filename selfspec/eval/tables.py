"""Paper-style tables from raw results (``python -m selfspec.tables`` writes them).

Reads every ``samples.jsonl`` under ``--runs`` (written by
``experiments/evaluate.py``) and writes, per experiment name (the first
folder under ``--runs``), ``<name>.md``, ``<name>.tex`` and ``<name>.csv`` to
``--tables``: one row per model x dataset x run variant x method with the
sublayers the plan skips, acceptance rate, mean accepted length, tokens/s,
speedup over the run's baseline, the share of samples whose output equals
the baseline's, task quality where the rows carry references (HumanEval pass@1,
GSM8K accuracy) and ROUGE-L agreement with the baseline's outputs
(:mod:`selfspec.eval.quality`), and, where our methods ran beside transformers' methods, each of
ours over the run's fastest peer with a paired-bootstrap interval. Figures (PNG, ``--figures``): speedup and acceptance versus
the number of skipped sublayers, acceptance by draft position, and the
search history of every Optuna study under ``--studies``. Every number is
computed here from the raw rows; nothing is typed by hand. A run whose folder
holds ``FAILED`` is listed as "(failed, partial)" and left out of the method
comparison.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from selfspec.eval.quality import quality
from selfspec.eval.records import baseline_of, paired_bootstrap, read_jsonl, summarize

COLUMNS = ["model", "dataset", "variant", "method", "kernels", "samples", "attn_skipped", "mlp_skipped", "k",
           "acceptance_rate", "mean_accepted_length", "tokens_per_s", "speedup", "greedy_match", "task_quality",
           "rouge_l", "ttft_s", "tpot_s", "latency_p99_s", "extra_memory_mb", "reps", "pass_speedups", "drift", "over_peer"]
PASS_COLUMNS = ("reps", "pass_speedups", "drift")  # shown only in a table with a run of several passes
PEER_COLUMNS = ("over_peer",)  # shown only in a table where our methods ran beside a transformers method
HEADERS = {"model": "model", "dataset": "dataset", "variant": "run", "method": "method", "kernels": "kernels",
           "samples": "n",
           "attn_skipped": "attn skip", "mlp_skipped": "MLP skip", "k": "k", "acceptance_rate": "accept",
           "mean_accepted_length": "acc. len", "tokens_per_s": "tok/s", "speedup": "speedup",
           "greedy_match": "match AR", "task_quality": "quality", "rouge_l": "ROUGE-L vs AR",
           "ttft_s": "TTFT s", "tpot_s": "TPOT s", "latency_p99_s": "P99 s",
           "extra_memory_mb": "extra MB", "reps": "passes", "pass_speedups": "speedup per pass",
           "drift": "drift", "over_peer": "over fastest peer (95%)"}


@dataclass
class Run:
    experiment: str
    model: str
    dataset: str
    variant: str
    header: dict
    rows: list[dict]


def load_runs(root: Path) -> list[Run]:
    runs = []
    for path in sorted(root.glob("**/samples.jsonl")):
        header, rows = read_jsonl(path)
        if header is None or not rows:
            continue
        rel = path.parent.relative_to(root).parts
        variant = "/".join(rel[3:]) or "default"
        if (path.parent / "FAILED").is_file():  # its last attempt failed: its rows are partial, and not a headline
            variant += " (failed, partial)"
        runs.append(Run(rel[0], header["model"], header["dataset"], variant, header, rows))
    return runs


def table_rows(run: Run) -> list[dict]:
    """One table row per method of one run, derived from its raw rows."""
    fp = run.header["fingerprint"]
    baseline = baseline_of(run.header)
    summary = summarize(run.rows, baseline)
    base_rows = [r for r in run.rows if r["method"] == baseline]
    out = []
    for method in fp["methods"]:
        if method not in summary:
            continue
        s = summary[method]
        plan = fp.get("plans", {}).get(method)
        kernels = _kernels(fp, method)
        q = quality([r for r in run.rows if r["method"] == method], base_rows)
        task = next(((k, q[k]) for k in ("pass@1", "accuracy") if k in q), None)
        out.append({
            "model": run.model, "dataset": run.dataset, "variant": run.variant,
            "method": _shown_name(method, kernels),
            "kernels": kernels, "samples": s["samples"],
            "attn_skipped": len(plan["attn"]) if plan else None,
            "mlp_skipped": len(plan["mlp"]) if plan else None,
            "k": fp["decode"][method]["k"] if plan else None,
            "acceptance_rate": s["acceptance_rate"], "mean_accepted_length": s["mean_accepted_length"],
            "tokens_per_s": s["tokens_per_s"], "speedup": s["speedup"],
            "speedup_ci95": s.get("speedup_ci95") if method != baseline else None,
            "greedy_match": s["greedy_match"] if method != baseline else None,
            "task_quality": f"{task[0]} {task[1]:.2f}" if task else None,
            "rouge_l": q.get("rouge_l_vs_baseline") if method != baseline else None,
            "ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"], "latency_p99_s": s["latency_p99_s"],
            "extra_memory_mb": run.header.get("extra_memory_bytes", {}).get(method, 0) / 2**20,
            "acceptance_by_position": s["acceptance_by_position"],
            "reps": s["reps"],
            "pass_speedups": s["speedup_reps"] if method != baseline and s["reps"] > 1 else None,
            "drift": s["drift"],
            **_over_peer(method, summary, run.rows, baseline, fp),
        })
    return out


def _shown_name(method: str, kernels: str) -> str:
    """A transformers method of a run older than the packed variants ran on stock kernels: named so."""
    return f"{method}_stock" if kernels == "stock" and method.startswith("hf_") and not method.endswith("_stock") \
        else method


def _over_peer(method: str, summary: dict[str, dict], rows: list[dict], baseline: str, fp: dict) -> dict:
    """For one of our methods (not the baseline): its tokens/s over the fastest transformers method
    of the same run, with a paired-bootstrap 95% interval over the prompts both decoded; the
    direct test of "ahead of every peer" (two intervals against AR can overlap while this one
    stays above 1). Empty for the baseline, the peers and a run with no peer."""
    peers = [m for m in summary if m.startswith("hf_")]
    if method == baseline or method.startswith("hf_") or not peers:
        return {}
    peer = max(peers, key=lambda m: summary[m]["tokens_per_s"])
    ci = paired_bootstrap([r for r in rows if r["method"] == method], [r for r in rows if r["method"] == peer])
    return {"peer": _shown_name(peer, _kernels(fp, peer)),
            "over_peer": summary[method]["tokens_per_s"] / summary[peer]["tokens_per_s"], "over_peer_ci95": list(ci)}


def _kernels(fp: dict, method: str) -> str:
    """The kernels a method's linears ran on: ``packed`` (prepacked oneDNN weights), ``packed fp16`` / ``packed fp32``
    (fp16 / fp32 copies, on a CPU that cannot pack bf16) or ``stock``; ``+ decode attn`` where it attended through
    :mod:`selfspec.engine.attention` (runs before it recorded none: SDPA); ``+ int4-vnni draft`` where its draft's
    int4 products ran on :mod:`selfspec.kernels.vnni`, ``+ fused int4-vnni draft`` where its kept sublayers also ran
    as one call each (:mod:`selfspec.draft.fused`)."""
    decode = (fp.get("decode") or {}).get(method, {})
    extra = " + decode attn" if decode.get("attention") == "decode" else ""
    info = (fp.get("method_info") or {}).get(method) or {}
    if "kernels" in info:
        return info["kernels"] + extra
    if info.get("draft_kernel"):
        extra += f" + {info['draft_kernel']} draft"
    if method.startswith("hf_"):
        return "stock"  # runs before the packed variants existed
    packed = decode.get("packed_weights")
    return (f"packed {packed}" if isinstance(packed, str) else "packed" if packed else "stock") + extra


def speedup_text(speedup: float | None, ci: list | None = None) -> str:
    """A speedup as the tables print it: ``2.41x``, then ``±`` half the width of its 95% paired-bootstrap interval
    where it has one."""
    text = _fmt("speedup", speedup)
    if ci and not any(_missing(x) for x in ci):
        text += f" ±{(ci[1] - ci[0]) / 2:.2f}"
    return text


def _cell(r: dict, key: str) -> str:
    """A table row's column as printed (the speedup with its interval)."""
    if key == "speedup":
        return speedup_text(r["speedup"], r.get("speedup_ci95"))
    if key == "over_peer":
        if r.get("over_peer") is None:
            return "-"
        lo, hi = r["over_peer_ci95"]
        ci = "" if math.isnan(lo) else f" ({lo:.2f}-{hi:.2f})"
        return f"{r['over_peer']:.2f}x{ci} over {r['peer']}"
    return _fmt(key, r.get(key))


def columns_of(rows: list[dict]) -> list[str]:
    """The table's columns: the pass columns only where some run decoded its samples more than once,
    the peer column only where some row has a peer."""
    several = any((r.get("reps") or 1) > 1 for r in rows)
    peers = any(r.get("over_peer") is not None for r in rows)
    return [c for c in COLUMNS if (several or c not in PASS_COLUMNS) and (peers or c not in PEER_COLUMNS)]


def _fmt(key: str, v) -> str:
    if _missing(v):
        return "-"
    if key == "pass_speedups":  # each pass's speedup, lowest to highest
        return f"{min(v):.2f}-{max(v):.2f}x" if v else "-"
    if key == "drift":  # the method's tokens/s, last pass over first
        return f"{(v - 1) * 100:+.0f}%"
    if key == "speedup":
        return f"{v:.2f}x"
    if key in ("acceptance_rate", "greedy_match", "mean_accepted_length", "tokens_per_s", "rouge_l"):
        return f"{v:.2f}"
    if key in ("ttft_s", "tpot_s", "latency_p99_s"):
        return f"{v:.3f}"
    if key == "extra_memory_mb":
        return f"{v:.0f}"
    return str(v)


def to_markdown(rows: list[dict]) -> str:
    cols = columns_of(rows)
    lines = ["| " + " | ".join(HEADERS[c] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_latex(rows: list[dict]) -> str:
    def esc(s: str) -> str:
        return s.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("%", "\\%").replace("&", "\\&")

    cols = columns_of(rows)
    lines = ["\\begin{tabular}{" + "l" * 4 + "r" * (len(cols) - 4) + "}", "\\toprule",
             " & ".join(esc(HEADERS[c]) for c in cols) + " \\\\", "\\midrule"]
    lines += [" & ".join(esc(_cell(r, c)) for c in cols) + " \\\\" for r in rows]
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def _missing(v) -> bool:
    """No value: None, or a float that is not finite (a CSV cell stays empty, for strict readers)."""
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    cols = columns_of(rows)
    peer = ["peer", "over_peer_lo95", "over_peer_hi95"] if "over_peer" in cols else []
    w = csv.DictWriter(buf, fieldnames=[*cols, "speedup_lo95", "speedup_hi95", *peer], extrasaction="ignore",
                       lineterminator="\n")
    w.writeheader()
    for r in rows:
        ci = r.get("speedup_ci95") or ["", ""]
        cells = {c: ("" if _missing(r.get(c)) else " ".join(f"{x:.4f}" for x in r[c]) if c == "pass_speedups" else r[c])
                 for c in cols}
        if peer:
            lo, hi = r.get("over_peer_ci95") or ["", ""]
            cells.update(peer=r.get("peer", ""), over_peer_lo95=lo, over_peer_hi95=hi)
        w.writerow({**cells, **{k: "" if _missing(v) else v for k, v in (("speedup_lo95", ci[0]), ("speedup_hi95", ci[1]))}})
    return buf.getvalue()


def provenance_lines(name: str, runs: list[Run], command: str | None = None) -> list[str]:
    """What a table's reader needs to trust and redo it: the command, the model, commits, dates and CPUs of its runs."""
    provs = [r.header.get("provenance") or {} for r in runs]
    shas = [p.get("git_commit") or "unknown" for p in provs]
    commits = sorted({sha[:7] + ("-dirty" if sha.endswith("-dirty") else "") for sha in shas})
    dates = sorted({(p.get("time") or "unknown")[:10] for p in provs})
    cpus = sorted({", ".join(str(m.get(k)) for k in ("cpu", "isa", "kernels", "int4_kernel") if m.get(k))
                   + (f", weight copies on {m['weight_pages']} pages" if m.get("weight_pages") else "")
                   + (f", {m['cores']} cores" if m.get("cores") else "")
                   for m in (p.get("machine") or {} for p in provs)})
    tokens = sorted({str(r.header.get("fingerprint", {}).get("max_new_tokens", "?")) for r in runs})
    models = []
    for r in runs:
        packaged = str((r.header.get("provenance") or {}).get("model_source", "")).startswith("packaged")
        label = f"{r.model} ({r.header.get('dtype', '?')}{', from a 4-bit GGUF' if packaged else ''})"
        if label not in models:
            models.append(label)
    return [f"# {name}", "",
            f"- command: `{command}`, then `python -m selfspec.tables`" if command else "- command: not recorded",
            f"- model: {'; '.join(models)}",
            f"- commit: {', '.join(commits)}; date: {', '.join(dates)}",
            f"- CPU: {'; '.join(cpus) or 'not recorded'}",
            f"- new tokens: at most {', '.join(tokens)} a turn; task quality scores the answers as cut there",
            "- speedup: tokens/s over the run's autoregressive loop, in one process on the same prompts and kernels; "
            "± is half the width of a 95% paired-bootstrap interval over the prompts", ""]


def write_tables(runs: list[Run], out_dir: Path, commands: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Write ``<experiment>.{md,tex,csv}``, the Markdown and LaTeX with their provenance; returns the rows per
    experiment. ``commands`` maps an experiment to the command that reproduces it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    by_exp: dict[str, list[dict]] = {}
    runs_of: dict[str, list[Run]] = {}
    for run in runs:
        by_exp.setdefault(run.experiment, []).extend(table_rows(run))
        runs_of.setdefault(run.experiment, []).append(run)
    for name, rows in by_exp.items():
        rows.sort(key=lambda r: (r["model"], r["dataset"], r["variant"]))
        head = provenance_lines(name, runs_of[name], (commands or {}).get(name))
        (out_dir / f"{name}.md").write_text("\n".join(head) + "\n" + to_markdown(rows))
        (out_dir / f"{name}.tex").write_text("".join(f"% {line}\n" for line in head if line) + to_latex(rows))
        (out_dir / f"{name}.csv").write_text(to_csv(rows))
    return by_exp


def methods_overview(by_exp: dict[str, list[dict]]) -> list[dict]:
    """Every method of every run side by side: one row per run x model x method, its speedup on each task set
    over the autoregressive loop *of its own run* and the mean over the sets. Runs marked failed are left out;
    the numbers of two rows are comparable only within one run (one process, the same prompts and kernels)."""
    out: dict[tuple[str, str, str], dict] = {}
    for name in sorted(by_exp):
        for r in by_exp[name]:
            if r["variant"] != "default" or r.get("speedup") is None:
                continue
            row = out.setdefault((name, r["model"], r["method"]),
                                 {"run": name, "model": r["model"], "method": r["method"], "sets": {}})
            row["sets"][r["dataset"]] = r["speedup"]
    for row in out.values():
        row["mean"] = sum(row["sets"].values()) / len(row["sets"])
    return list(out.values())


def write_methods_overview(rows: list[dict], out: Path) -> None:
    """``out.md`` and ``out.csv`` from :func:`methods_overview`."""
    sets = sorted({d for r in rows for d in r["sets"]})
    heads = ["run", "model", "method", *sets, "mean"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(heads)
    for r in rows:
        cells = [r["run"], r["model"], r["method"],
                 *(_fmt("speedup", r["sets"][d]) if d in r["sets"] else "-" for d in sets), _fmt("speedup", r["mean"])]
        lines.append("| " + " | ".join(cells) + " |")
        w.writerow([r["run"], r["model"], r["method"], *(r["sets"].get(d, "") for d in sets), r["mean"]])
    out.with_suffix(".md").write_text(
        "Every method of every run under results/runs: speedup in wall-clock tokens/s over the autoregressive loop "
        "of the same run (one process, the same prompts and kernels). Compare rows within one run only; each run's "
        "table (`<run>.md`) gives its conditions, intervals and provenance.\n\n" + "\n".join(lines) + "\n")
    out.with_suffix(".csv").write_text(buf.getvalue())
