"""``python -m selfspec.search``: find the skip plan with Optuna (Hydra entry point).

Composes ``conf/search.yaml``, turns it into typed settings, loads the model
and prompts, runs :func:`selfspec.search.pipeline.search`, logs trials and the report
to W&B when ``logger=wandb`` (offline by default), prints the report.
Interrupt it at any time: rerunning the same command resumes the study.
Start it several times on one study (``search.storage``: SQLite, a journal file
or a database URL) to run the trials on several workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from selfspec.assets.data import prompt_set_from_config
from selfspec.assets.models import load_model
from selfspec.cli.config import conf_dir, dataset_config, plain, search_settings
from selfspec.cli.wandb_logger import WandbLogger
from selfspec.errors import SelfSpecError
from selfspec.search.pipeline import format_report, search


def _logger(cfg: DictConfig) -> WandbLogger:
    return WandbLogger(plain(cfg.logger), "search", plain(cfg), name=f"search-{cfg.search.study_name}")


def _on_trial(logger: WandbLogger):
    def log(study, trial) -> None:
        logger.log({"trial": trial.number, "objective": trial.value, "state": trial.state.name,
                    "n_skipped": trial.user_attrs.get("n_skipped"), "k": trial.user_attrs.get("k"),
                    "predicted_acceptance": trial.user_attrs.get("predicted_acceptance")})
    return log


@hydra.main(config_path=str(conf_dir()), config_name="search", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logger = None
    try:
        settings = search_settings(cfg)
        prompts = prompt_set_from_config(dataset_config(cfg), cfg.model.cache_dir)
        lm = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=cfg.model.cache_dir)
        logger = _logger(cfg)
        report = search(lm, prompts, settings, on_trial=_on_trial(logger),
                        extra_provenance={"config": plain(cfg)})
        if report is None:  # another worker of the study writes the draft
            logger.finish()
            return
        print(format_report(report))
        logger.summary({k: v for k, v in report.to_dict().items() if k not in ("draft", "candidates", "ablation")})
        logger.artifact(report.plan_path, f"draft-{Path(report.plan_path).stem}", "draft")
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
