"""``python -m selfspec.search``: find the skip plan with Optuna (Hydra entry point).

Composes ``conf/search.yaml``, turns it into typed settings, loads the model
and prompts, runs :func:`selfspec.searcher.search`, logs trials and the report
to W&B when ``logger=wandb`` (offline by default), prints the report.
Interrupt it at any time: rerunning the same command resumes the study.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .data import prompt_set_from_config
from .errors import SelfSpecError
from .models import load_model
from .searcher import HeldoutSettings, RetimeSettings, SearchSettings, format_report, search
from .wandb_logger import WandbLogger

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


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
