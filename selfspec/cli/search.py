"""``python -m selfspec.search``: find the skip plan with Optuna (Hydra entry point).

Composes ``conf/search.yaml``, turns it into typed settings, loads the model
and prompts, runs :func:`selfspec.search.pipeline.search`, logs trials and the report
to W&B when ``logger=wandb`` (offline by default), prints the report.
Interrupt it at any time: rerunning the same command resumes the study.
Start it several times on one study (``search.storage``: SQLite, a journal file
or a database URL) to run the trials on several workers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from selfspec.assets.data import prompt_set_from_config
from selfspec.assets.models import load_model
from selfspec.cli import take_interrupts
from selfspec.cli.config import check_new_keys, conf_dir, dataset_config, plain, search_settings
from selfspec.cli.jobs import job_failed, ran_in_child, save_config, set_threads
from selfspec.cli.wandb_logger import WandbLogger
from selfspec.errors import SelfSpecError
from selfspec.kernels import amx, fp16, vnni
from selfspec.kernels.packed import pack_format
from selfspec.search.pipeline import search
from selfspec.search.report import format_report


def _logger(cfg: DictConfig) -> WandbLogger:
    return WandbLogger(plain(cfg.logger), "search", plain(cfg), name=f"search-{cfg.search.study_name}").start()


def _on_trial(logger: WandbLogger):
    def log(study, trial) -> None:
        logger.log({"trial": trial.number, "objective": trial.value, "state": trial.state.name,
                    "n_skipped": trial.user_attrs.get("n_skipped"), "k": trial.user_attrs.get("k"),
                    "predicted_acceptance": trial.user_attrs.get("predicted_acceptance")})
    return log


@hydra.main(config_path=str(conf_dir()), config_name="search", version_base="1.3")
def main(cfg: DictConfig) -> None:
    take_interrupts()
    started = time.perf_counter()  # the report counts the model's fetch and load too
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    logger = None
    try:
        if ran_in_child(cfg, "selfspec.search"):
            return
        check_new_keys("search", list(HydraConfig.get().overrides.task))
        set_threads(cfg)
        settings = search_settings(cfg)
        # int4 drafts need the int4 kernel, compiled on a machine's first run (~45 s on a 2-core Zen 3): the
        # compiler runs while the prompts and the model are fetched and loaded (docs/log.md)
        int4 = "int4" in settings.space.weights + settings.space.head_weights and cfg.model.device == "cpu"
        build = vnni.build_in_background() if int4 else None
        # likewise the full model's kernel: our bf16 panels on a CPU with AMX or AVX-512 BF16, else our fp16 kernel
        # where the packed forwards run on fp16 copies (an AVX2 CPU; ~20 s on a Zen 3)
        cpu = cfg.model.device == "cpu"
        build16 = (amx.build_in_background() if cpu and amx.cpu_can_build() else
                   fp16.build_in_background() if cpu and pack_format() == "fp16" else None)
        prompts = prompt_set_from_config(dataset_config(cfg), cfg.model.cache_dir)
        lm = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=cfg.model.cache_dir)
        save_config(cfg, out_dir)
        logger = _logger(cfg)
        for thread in (build, build16):
            if thread is not None:
                thread.join()  # the cost model times the kernel: no compile may run beside it
        setup = time.perf_counter() - started
        report = search(lm, prompts, settings, on_trial=_on_trial(logger),
                        extra_provenance={"config": plain(cfg)}, setup_seconds=setup)
        if report is None:  # another worker of the study writes the draft
            logger.finish()
            return
        print(format_report(report))
        if report.unsaved:
            print(json.dumps(report.draft.to_dict(), indent=2))
            raise SelfSpecError(f"{report.unsaved}. The draft is printed above (save it as a .json file to use it); "
                                "the study keeps every trial: rerun the same command once the folder can be written")
        logger.summary({k: v for k, v in report.to_dict().items() if k not in ("draft", "candidates", "ablation")})
        logger.artifact(report.plan_path, f"draft-{Path(report.plan_path).stem}", "draft")
        logger.finish()
    except KeyboardInterrupt:
        if logger:
            logger.finish(failed=True)
        print("\ninterrupted: finished trials are saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # one line for a user error; a sweep goes on with its next job and exits 1 at the end
        if logger:
            logger.finish(failed=True)
        job_failed(e, out_dir, "Every trial finished before it is kept in the study (search.storage): make room (or "
                               "make the folder writable) and rerun the same command to resume")


if __name__ == "__main__":
    main()
