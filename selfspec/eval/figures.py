"""Figures from raw results and Optuna studies (PNG): speedup and acceptance versus skipped
sublayers, acceptance by draft position, search history, and which search dimensions and
sublayers matter (Optuna's PED-ANOVA parameter importances, numbers beside the figure in
``search_importance.csv``). Every number comes from the rows or the studies."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path


def _study_trials(studies: Path) -> dict[str, list]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = {}
    for db in sorted(studies.glob("*.db")):
        storage = f"sqlite:///{db}"
        for name in optuna.get_all_study_names(storage):
            study = optuna.load_study(study_name=name, storage=storage)
            trials = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
            if trials:
                out[name] = trials
    return out


def param_importances(trials: list) -> dict[str, float]:
    """Optuna's PED-ANOVA importances of the parameters every trial has (they sum to 1): how much of the
    spread between the best trials and the rest each parameter explains."""
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    study = optuna.create_study(direction="maximize")
    study.add_trials(trials)
    return get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())


def dimension_of(param: str) -> str:
    """``attn_12`` -> ``attention skips``; ``mlp_3`` -> ``MLP skips``; an option stays itself."""
    if re.fullmatch(r"attn_\d+", param):
        return "attention skips"
    if re.fullmatch(r"mlp_\d+", param):
        return "MLP skips"
    return param


def ranked(importances: dict[str, float]) -> list[str]:
    """The names, largest importance first; those equal at the printed four decimals by name, so the CSV and
    the figure regenerated from the same study come out alike (the last digits vary from run to run)."""
    return sorted(importances, key=lambda name: (-round(importances[name], 4), name))


LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def write_figures(by_exp: dict[str, list[dict]], studies: Path | None, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    spec = [r for rows in by_exp.values() for r in rows if r["attn_skipped"] is not None]
    trials = _study_trials(studies) if studies and studies.is_dir() else {}

    # speedup and acceptance versus skipped sublayers: predicted by the searches, measured by the runs
    if spec or trials:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, ts in trials.items():
            n = [t.user_attrs.get("n_skipped") for t in ts]
            ax1.scatter(n, [t.value for t in ts], s=8, alpha=0.35, label=f"{name} (predicted)")
            ax2.scatter(n, [t.user_attrs.get("predicted_acceptance") for t in ts], s=8, alpha=0.35,
                        label=f"{name} (predicted)")
        for model in sorted({r["model"] for r in spec}):
            rs = [r for r in spec if r["model"] == model]
            n = [r["attn_skipped"] + r["mlp_skipped"] for r in rs]
            ax1.scatter(n, [r["speedup"] for r in rs], marker="x", s=40, label=f"{model} (measured)")
            ax2.scatter(n, [r["acceptance_rate"] for r in rs], marker="x", s=40, label=f"{model} (measured)")
        ax1.axhline(1.0, color="grey", lw=0.8)
        ax1.set(xlabel="sublayers skipped while drafting", ylabel="speedup over autoregressive")
        ax2.set(xlabel="sublayers skipped while drafting", ylabel="acceptance rate")
        ax2.legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "speedup_acceptance_vs_skipped.png"))

    # acceptance by draft position: a panel per model, a colour per task set, a line style per run
    with_pos = [(exp, r) for exp, rows in by_exp.items() for r in rows
                if r["attn_skipped"] is not None and len(r["acceptance_by_position"]) > 1]
    if with_pos:
        models = sorted({r["model"] for _, r in with_pos})
        datasets = sorted({r["dataset"] for _, r in with_pos})
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            exps = sorted({exp for exp, r in with_pos if r["model"] == model})
            for exp, r in with_pos:
                if r["model"] == model:
                    acc = r["acceptance_by_position"]
                    ax.plot(range(1, len(acc) + 1), acc, marker="o", ms=3, color=f"C{datasets.index(r['dataset'])}",
                            ls=LINE_STYLES[exps.index(exp) % len(LINE_STYLES)], label=f"{exp}: {r['dataset']} k={r['k']}")
            ax.set(title=model, xlabel="draft position", ylabel="acceptance (given the previous ones)", ylim=(0, 1.02))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=5, ncol=2, loc="lower left")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "acceptance_by_position.png"))

    # search history
    if trials:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ts in trials.items():
            ts = sorted(ts, key=lambda t: t.number)
            best, run = [], -math.inf
            for t in ts:
                run = max(run, t.value)
                best.append(run)
            ax.plot([t.number for t in ts], [t.value for t in ts], ".", alpha=0.3, ms=3)
            ax.plot([t.number for t in ts], best, label=name)
        ax.set(xlabel="trial", ylabel="predicted speedup (dots: trials, line: best so far)")
        ax.legend(fontsize=6)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "search_history.png"))

    # which dimensions and which sublayers matter
    importances = {name: param_importances(ts) for name, ts in trials.items() if len(ts) >= 10}
    importances = {name: imp for name, imp in importances.items() if imp}
    if importances:
        written.append(importance_csv(importances, out_dir / "search_importance.csv"))
        fig, axes = plt.subplots(len(importances), 2, figsize=(11, 3.6 * len(importances)), squeeze=False)
        for (ax1, ax2), (name, imp) in zip(axes, importances.items()):
            dims: dict[str, float] = {}
            for param, value in imp.items():
                dims[dimension_of(param)] = dims.get(dimension_of(param), 0.0) + value
            order = ranked(dims)[::-1]  # barh draws bottom up: the largest on top
            ax1.barh(order, [dims[d] for d in order])
            ax1.set(title=f"{name}\nby dimension (sum of its parameters)", xlabel="PED-ANOVA importance")
            top = ranked(imp)[:15][::-1]
            ax2.barh(top, [imp[p] for p in top], color="C1")
            ax2.set(title=f"{name}\nthe 15 most important parameters", xlabel="PED-ANOVA importance")
            for ax in (ax1, ax2):
                ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "search_importance.png"))
    return written


def importance_csv(importances: dict[str, dict[str, float]], path: Path) -> Path:
    """Each study's importances as CSV rows at ``path``, in :func:`ranked` order; returns ``path``."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["study", "parameter", "dimension", "importance"])
        for name, imp in importances.items():
            for param in ranked(imp):
                w.writerow([name, param, dimension_of(param), f"{imp[param]:.4f}"])
    return path


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=130)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
