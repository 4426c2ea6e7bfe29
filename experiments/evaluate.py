"""Evaluation runner (Hydra entry point): compose, build, call :func:`selfspec.evaluate.evaluate`, log.

    python experiments/evaluate.py model=qwen2.5-coder-1.5b dataset=gsm8k
    python experiments/evaluate.py -m dataset=humaneval,gsm8k,mtbench,summarization decoding.k=2,4,6
    python experiments/evaluate.py +experiment=main

Results: ``<run folder>/samples.jsonl`` (header + one row per sample and method),
``<run folder>/summary.json`` and, with ``logger=wandb``, an offline W&B run in
the same folder. A failed job prints its error, closes its W&B run as failed
and lets the rest of a sweep go on; a single run exits with status 2.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from selfspec import SelfSpecError, SkipPlan, layer_skipper
from selfspec.data import load_task_set
from selfspec.decoding import DecodeConfig
from selfspec.evaluate import EvalSettings, evaluate, summarize
from selfspec.methods import build_method
from selfspec.models import load_model
from selfspec.provenance import provenance
from selfspec.sampling import SamplingParams
from selfspec.search import WandbLogger

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
TABLE_COLUMNS = ["sample_id", "method", "turns", "prompt_tokens", "new_tokens", "wall_time_s", "tokens_per_s",
                 "ttft_s", "tpot_s", "rounds", "drafted", "accepted", "output_sha256"]


def decode_config(cfg: DictConfig, dataset_max_new: int, plan: SkipPlan | None) -> DecodeConfig:
    d = OmegaConf.to_container(cfg.decoding, resolve=True)
    k = d["k"]
    if k is None:
        k = int((plan.provenance or {}).get("k", 4)) if plan is not None else 4
    return DecodeConfig(
        max_new_tokens=d["max_new_tokens"] if d["max_new_tokens"] is not None else dataset_max_new, k=k,
        adaptive=d["adaptive"], threshold=d["threshold"], threshold_step=d["threshold_step"],
        target_acceptance=d["target_acceptance"], fallback=d["fallback"],
        fallback_min_rounds=d["fallback_min_rounds"], seed=d["seed"], packed_weights=d["packed_weights"],
        packed_only=d["packed_only"],
        sampling=SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"]),
    )


def run(cfg: DictConfig, out_dir: Path, logger: WandbLogger) -> dict:
    tasks = load_task_set(OmegaConf.to_container(cfg.dataset, resolve=True), cfg.model.cache_dir)
    methods = list(cfg.methods)
    plan = None
    lm = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=cfg.model.cache_dir)
    if "self_speculative" in methods and cfg.plan == "empty":  # draft = every sublayer, cheaper weights/head
        plan = SkipPlan.empty(layer_skipper(lm.model).num_layers, model=lm.name)
    elif "self_speculative" in methods:
        plan_path = Path(cfg.plan)
        if not plan_path.is_file():
            raise SelfSpecError(f"no skip plan at {plan_path}: run `python -m selfspec.search model={cfg.model.name}` "
                                "first, or set plan=<file> (or plan=empty)")
        plan = SkipPlan.load(plan_path)
        logger.artifact(plan_path, f"plan-{plan_path.stem}", "skip-plan")
    dcfg = decode_config(cfg, tasks.max_new_tokens, plan)
    options = OmegaConf.to_container(cfg.method_options, resolve=True)
    built = [build_method(m, lm, dcfg, plan, options.get(m)) for m in methods]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    header = {"provenance": provenance({"config": resolved, "model_source": lm.source}),
              "model": lm.name, "dataset": tasks.name, "dtype": lm.info.get("dtype"), "seed": cfg.seed}
    settings = EvalSettings(out_path=out_dir / "samples.jsonl", baseline=cfg.baseline, n_samples=cfg.n_samples,
                            warmup_tokens=cfg.warmup_tokens)
    rows = evaluate(lm, tasks, built, settings, header,
                    on_sample=lambda new: logger.log({f"{r['method']}/tokens_per_s": r["tokens_per_s"] for r in new}))
    summary = summarize(rows, cfg.baseline)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.table("samples", rows, TABLE_COLUMNS)
    logger.summary({f"{m}/{k}": v for m, s in summary.items() for k, v in s.items() if not isinstance(v, list)})
    return summary


def print_summary(summary: dict, baseline: str) -> None:
    print(f"{'method':<18}{'samples':>8}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'acc.len':>8}{'match':>7}")
    for m, s in summary.items():
        print(f"{m:<18}{s['samples']:>8}{s['tokens_per_s']:>8.2f}{s['speedup']:>8.2f}x"
              f"{s['acceptance_rate']:>8.2f}{s['mean_accepted_length']:>8.2f}{s['greedy_match']:>7.2f}")
    print(f"(speedup over {baseline}; match = share of samples whose output equals {baseline}'s)")


@hydra.main(config_path=CONF_DIR, config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    logger = WandbLogger(OmegaConf.to_container(cfg.logger, resolve=True), "evaluate",
                         OmegaConf.to_container(cfg, resolve=True),
                         name=f"{cfg.name}/{cfg.model.name}/{cfg.dataset.name}/{out_dir.name}")
    try:
        summary = run(cfg, out_dir, logger)
        (out_dir / "FAILED").unlink(missing_ok=True)  # a rerun that succeeds clears an earlier failure
        print(f"{cfg.model.name} / {cfg.dataset.name} -> {out_dir}")
        print_summary(summary, cfg.baseline)
        logger.finish()
    except KeyboardInterrupt:
        logger.finish(failed=True)
        print("\ninterrupted: finished samples are saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a failed job closes its run; a sweep goes on with the next job
        logger.finish(failed=True)
        msg = str(e) if isinstance(e, SelfSpecError) else "".join(traceback.format_exception(e))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "FAILED").write_text(msg + "\n")
        print(f"error in {out_dir}: {msg}", file=sys.stderr)
        if not multirun:
            sys.exit(2)

if __name__ == "__main__":
    main()
