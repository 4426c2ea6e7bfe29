"""``python -m selfspec.search``: find the skip plan with Optuna (Hydra entry point).

Composes ``conf/search.yaml``, turns it into typed settings, loads the model
and prompts, runs :func:`selfspec.searcher.search`, logs trials and the report
to W&B when ``logger=wandb`` (offline by default), prints the report.
Interrupt it at any time: rerunning the same command resumes the study.

:class:`WandbLogger` also serves ``experiments/evaluate.py``: W&B stays in the
entry points, and the library modules never import it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .data import prompt_set_from_config
from .errors import SelfSpecError
from .models import load_model
from .searcher import HeldoutSettings, RetimeSettings, SearchSettings, format_report, search

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


class WandbLogger:
    """W&B logging for the entry points (search, evaluation).

    Offline by default: runs are written under the configured folder and can be
    uploaded later with ``wandb sync``. ``logger=none`` (or ``mode: disabled``)
    makes every call a no-op. ``finish(failed=True)`` closes a run with a
    non-zero exit code, so a failed job in a sweep leaves a closed run behind.
    """

    def __init__(self, logger_cfg: dict, job: str, config: dict, name: str | None = None,
                 dir: str | Path | None = None) -> None:
        self.run = None
        if logger_cfg.get("name") != "wandb" or logger_cfg.get("mode") == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        root = Path(dir or logger_cfg["dir"])
        root.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=logger_cfg["project"], entity=logger_cfg.get("entity"),
                              mode=logger_cfg["mode"], dir=str(root), job_type=job, name=name,
                              tags=list(logger_cfg.get("tags") or ()), config=config, reinit="finish_previous")

    def log(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(metrics)

    def summary(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.summary.update(metrics)

    def table(self, key: str, rows: list[dict], columns: list[str]) -> None:
        if self.run is not None and rows:
            self.run.log({key: self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})

    def artifact(self, path: str | Path, name: str, kind: str) -> None:
        if self.run is not None and path and Path(path).is_file():
            art = self.wandb.Artifact(name, type=kind)
            art.add_file(str(path))
            self.run.log_artifact(art)

    def finish(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


def settings_from_config(cfg: DictConfig) -> SearchSettings:
    s = OmegaConf.to_container(cfg.search, resolve=True)
    return SearchSettings(
        n_trials=s["n_trials"], sampler=s["sampler"], objective=s["objective"], k_max=s["k_max"],
        calibration_tokens=s["calibration_tokens"], min_skipped=s["min_skipped"], max_skipped=s["max_skipped"],
        protect_first_last=s["protect_first_last"], warm_start=tuple(s["warm_start"] or ()),
        storage=s["storage"], study_name=s["study_name"], cost_reps=s["cost_reps"], seed=cfg.seed,
        plans_dir=cfg.plans_dir, retime=RetimeSettings(**s["retime"]), heldout=HeldoutSettings(**s["heldout"]),
    )


def _logger(cfg: DictConfig) -> WandbLogger:
    return WandbLogger(OmegaConf.to_container(cfg.logger, resolve=True), "search",
                       OmegaConf.to_container(cfg, resolve=True), name=f"search-{cfg.search.study_name}")


def _on_trial(logger: WandbLogger):
    def log(study, trial) -> None:
        logger.log({"trial": trial.number, "objective": trial.value, "state": trial.state.name,
                    "n_skipped": trial.user_attrs.get("n_skipped"), "k": trial.user_attrs.get("k"),
                    "predicted_acceptance": trial.user_attrs.get("predicted_acceptance")})
    return log


@hydra.main(config_path=CONF_DIR, config_name="search", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logger = None
    try:
        settings = settings_from_config(cfg)
        prompts = prompt_set_from_config(OmegaConf.to_container(cfg.dataset, resolve=True), cfg.model.cache_dir)
        lm = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=cfg.model.cache_dir)
        logger = _logger(cfg)
        report = search(lm, prompts, settings, on_trial=_on_trial(logger),
                        extra_provenance={"config": OmegaConf.to_container(cfg, resolve=True)})
        print(format_report(report))
        logger.summary({k: v for k, v in report.to_dict().items() if k not in ("plan", "candidates")})
        logger.artifact(report.plan_path, f"plan-{Path(report.plan_path).stem}", "skip-plan")
        logger.finish()
    except SelfSpecError as e:
        if logger:
            logger.finish(failed=True)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if logger:
            logger.finish(failed=True)
        print("\ninterrupted: finished trials are saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
