"""W&B logging for the entry points (search, evaluation); the library never imports wandb."""

from __future__ import annotations

import os
from pathlib import Path

from selfspec.locks import check_writable


class WandbLogger:
    """W&B logging for the entry points (search, evaluation).

    Offline by default: runs are written under the configured folder and can be
    uploaded later with ``wandb sync``. ``logger=none`` (or ``mode: disabled``)
    makes every call a no-op. ``finish(failed=True)`` closes a run with a
    non-zero exit code, so a failed job in a sweep leaves a closed run behind.
    Nothing is written before :meth:`start` (an evaluation starts its run once
    its run folder has accepted it; calls before that are dropped).
    """

    def __init__(self, logger_cfg: dict, job: str, config: dict, name: str | None = None,
                 dir: str | Path | None = None) -> None:
        self.run = None
        self._init = None
        if logger_cfg.get("name") != "wandb" or logger_cfg.get("mode") == "disabled":
            return
        root = Path(dir or logger_cfg["dir"])
        check_writable(root, "the W&B folder (logger.dir)")  # (creates it)
        self._init = dict(project=logger_cfg["project"], entity=logger_cfg.get("entity"), mode=logger_cfg["mode"],
                          dir=str(root), job_type=job, name=name, tags=list(logger_cfg.get("tags") or ()),
                          config=config)

    def start(self) -> WandbLogger:
        if self._init is None or self.run is not None:
            return self
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.wandb = wandb
        self.run = wandb.init(**self._init, reinit="finish_previous")
        return self

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
