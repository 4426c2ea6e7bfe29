"""Evaluation runner (Hydra entry point): compose, build, call :func:`selfspec.evaluate.evaluate`, log.

    python experiments/evaluate.py model=qwen2.5-coder-1.5b dataset=gsm8k
    python experiments/evaluate.py -m dataset=humaneval,gsm8k,mtbench,summarization decoding.k=2,4,6
    python experiments/evaluate.py +experiment=headline

Results: ``<run folder>/samples.jsonl`` (header + one row per sample and method),
``<run folder>/summary.json`` and, with ``logger=wandb``, an offline W&B run in
the same folder. A failed job prints its error, closes its W&B run as failed
and lets the rest of a sweep go on (the sweep then exits with status 1 and lists
the failed jobs); a single run exits with status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from selfspec.assets.data import TaskSet, load_task_set
from selfspec.assets.models import load_model
from selfspec.cli import take_interrupts
from selfspec.cli.config import check_new_keys, conf_dir, dataset_config, decode_config, draft_options, plain
from selfspec.cli.jobs import job_failed, ran_in_child, save_config, set_threads
from selfspec.cli.wandb_logger import WandbLogger
from selfspec.draft.spec import LENGTH, DraftSpec
from selfspec.errors import SelfSpecError
from selfspec.eval.methods import build_method, method_options, split_variant
from selfspec.eval.records import summarize
from selfspec.eval.runner import EvalSettings, evaluate
from selfspec.model.plan import SkipPlan
from selfspec.provenance import provenance, strict_json

TABLE_COLUMNS = ["sample_id", "method", "rep", "turns", "prompt_tokens", "new_tokens", "wall_time_s", "tokens_per_s",
                 "ttft_s", "tpot_s", "rounds", "drafted", "accepted", "output_sha256"]


def run(cfg: DictConfig, out_dir: Path, logger: WandbLogger) -> dict:
    check_new_keys("evaluate", list(HydraConfig.get().overrides.task))
    set_threads(cfg)
    tasks = load_task_set(dataset_config(cfg), cfg.model.cache_dir)
    if cfg.split == "calibration":  # tuning a setting on the rows the search uses; never for reported numbers
        tasks = TaskSet(tasks.name, (), tasks.calibration, tasks.max_new_tokens)
    elif cfg.split != "eval":
        raise SelfSpecError(f"split must be eval or calibration, got {cfg.split!r}")
    methods = list(cfg.methods)
    ours = [m for m in methods if split_variant(m)[0] == "self_speculative"]
    lm = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=cfg.model.cache_dir)
    options = plain(cfg.method_options)
    chosen = {m: dict(method_options(m, options) or {}) for m in methods}
    own_drafts = {m: chosen[m].pop("draft") for m in ours if "draft" in chosen[m]}
    uses_run_draft = any(m not in own_drafts for m in ours)
    spec = _load_draft(cfg.plan, lm, cfg.model.name) if uses_run_draft else None
    dcfg = decode_config(cfg, tasks.max_new_tokens, spec)
    plans, decodings = {}, {}
    for m in ours:
        own = chosen[m]
        decoding = own.pop("decoding", None)  # per-method decoding settings (build_method checks them)
        if m in own_drafts:  # a variant with a draft file of its own: its plan, options and length policy
            mine = _load_draft(own_drafts[m], lm, cfg.model.name, f"method_options.{m}.draft")
            policy = decode_config(cfg, tasks.max_new_tokens, mine)
            decoding = {**{key: getattr(policy, key) for key in LENGTH}, **(decoding or {})}
        else:
            mine = spec
        plans[m] = mine.plan
        chosen[m], decodings[m] = draft_options(mine, own, f"method_options.{m}"), decoding
    built = [build_method(m, lm, dcfg, plans.get(m), chosen[m], decodings.get(m)) for m in methods]
    resolved = plain(cfg)
    header = {"provenance": provenance({"config": resolved, "model_source": lm.source}),
              "model": lm.name, "dataset": tasks.name, "dtype": lm.info.get("dtype"), "seed": cfg.decoding.seed,
              "split": cfg.split}
    settings = EvalSettings(out_path=out_dir / "samples.jsonl", baseline=cfg.baseline, n_samples=cfg.n_samples,
                            warmup_tokens=cfg.warmup_tokens, reps=cfg.reps)
    rows = evaluate(lm, tasks, built, settings, header,
                    on_sample=lambda new: logger.log({f"{r['method']}/tokens_per_s": r["tokens_per_s"] for r in new}),
                    on_accepted=lambda: _accepted(cfg, out_dir, logger, spec))
    summary = summarize(rows, cfg.baseline)
    (out_dir / "summary.json").write_text(json.dumps(strict_json(summary), indent=2, allow_nan=False) + "\n")
    logger.table("samples", rows, TABLE_COLUMNS)
    logger.summary({f"{m}/{k}": v for m, s in summary.items() for k, v in s.items() if not isinstance(v, list)})
    return summary


def _load_draft(where: str, lm, model_name: str, key: str = "plan") -> DraftSpec:
    """The draft file at ``where``, or ``empty``: every sublayer kept (a draft made cheaper by its options only)."""
    if where == "empty":
        return DraftSpec(SkipPlan(lm.num_layers, model=lm.name))
    path = Path(where)
    if not path.is_file():
        raise SelfSpecError(f"no draft file at {path} ({key}): run `python -m selfspec.search model={model_name}` "
                            f"first, or set {key}=<file> (or {key}=empty)")
    return DraftSpec.load(path)


def _accepted(cfg: DictConfig, out_dir: Path, logger: WandbLogger, spec: DraftSpec | None) -> None:
    """The run folder took this run: record its config, start its W&B run."""
    save_config(cfg, out_dir)
    logger.start()
    if spec is not None and cfg.plan != "empty":
        logger.artifact(cfg.plan, f"draft-{Path(cfg.plan).stem}", "draft")


def print_summary(summary: dict, baseline: str) -> None:
    w = max([18, *(len(m) + 2 for m in summary)])  # variants' names (self_speculative-min2) stay in their column
    print(f"{'method':<{w}}{'samples':>8}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'acc.len':>8}{'match':>7}"
          f"{'passes':>7}{'drift':>7}")
    for m, s in summary.items():
        drift = "-" if s["drift"] != s["drift"] else f"{(s['drift'] - 1) * 100:+.0f}%"
        print(f"{m:<{w}}{s['samples']:>8}{s['tokens_per_s']:>8.2f}{s['speedup']:>8.2f}x"
              f"{s['acceptance_rate']:>8.2f}{s['mean_accepted_length']:>8.2f}{s['greedy_match']:>7.2f}"
              f"{s['reps']:>7}{drift:>7}")
    print(f"(speedup over {baseline}; match = share of samples whose output equals {baseline}'s; "
          "drift = a method's tokens/s in its last pass over its first)")


@hydra.main(config_path=str(conf_dir()), config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    take_interrupts()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    logger = None
    try:
        if ran_in_child(cfg, "selfspec.cli.evaluate"):
            return
        logger = WandbLogger(plain(cfg.logger), "evaluate", plain(cfg),
                             name=f"{cfg.name}/{cfg.model.name}/{cfg.dataset.name}/{out_dir.name}")
        summary = run(cfg, out_dir, logger)
        (out_dir / "FAILED").unlink(missing_ok=True)  # a rerun that succeeds clears an earlier failure
        print(f"{cfg.model.name} / {cfg.dataset.name} -> {out_dir}")
        print_summary(summary, cfg.baseline)
        logger.finish()
    except KeyboardInterrupt:
        if logger:
            logger.finish(failed=True)
        print("\ninterrupted: finished samples are saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a failed job closes its run; a sweep goes on with the next job, and exits 1 at the end
        if logger:
            logger.finish(failed=True)
        job_failed(e, out_dir, f"Every sample finished before it is kept in {out_dir / 'samples.jsonl'}: make room (or "
                               "make the folder writable) and rerun the same command to resume")


if __name__ == "__main__":
    main()
