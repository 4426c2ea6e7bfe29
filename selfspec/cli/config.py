"""Where the Hydra configs are, and configs turned into the library's typed settings.

``conf/`` is the one source of every config: in a source checkout it is the
repository's ``conf/`` folder; an installed wheel carries the same files as
the package ``selfspec.conf`` (see ``pyproject.toml``). Everything a config
sets reaches the library as a frozen dataclass built by
:func:`selfspec.typed.typed`, which refuses unknown keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from selfspec.assets.data import load_task_set
from selfspec.assets.models import encode_prompt
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.sampling import SamplingParams
from selfspec.errors import SelfSpecError
from selfspec.model.plan import SkipPlan
from selfspec.search.settings import SearchSettings
from selfspec.typed import typed


def short_folder_name(text: str, limit: int = 96) -> str:
    """``text`` as one folder name of at most ``limit`` characters: itself when it fits, else its start and a hash
    of the whole (a run's overrides can be longer than a file system allows; they stay whole in its config record).
    A path separator in it (an override naming a file: ``+method_options.x={draft:results/plans/p.json}``) is
    written ``_``, so that the name stays one folder, not a tree of them."""
    name = text.replace("/", "_").replace("\\", "_")
    if len(name) <= limit:
        return name
    return f"{name[: limit - 13]}-{hashlib.sha1(text.encode('utf-8')).hexdigest()[:12]}"


OmegaConf.register_new_resolver("selfspec.short", short_folder_name, replace=True)  # used by conf/evaluate.yaml


def conf_dir() -> Path:
    """The folder holding ``search.yaml`` and ``evaluate.yaml``: the checkout's ``conf/``, else the packaged copy."""
    package = Path(__file__).resolve().parent.parent
    for cand in (package.parent / "conf", package / "conf"):
        if (cand / "search.yaml").is_file():
            return cand
    raise SelfSpecError(f"cannot find the selfspec configs (looked for conf/ beside {package}); reinstall selfspec")


def group_option(group: str, name: str) -> dict:
    """One option of a config group as a plain dict (``conf/<group>/<name>.yaml``), for scripts without Hydra."""
    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        raise SelfSpecError(f"no {group} config {name!r}; choose from {', '.join(options)}")
    return yaml.safe_load(path.read_text())


def calibration_prompts(tokenizer, datasets: list[str], per_dataset: int) -> list[list[int]]:
    """First turns of each task set's calibration split (never its eval rows), encoded, for measurement scripts."""
    prompts = []
    for name in datasets:
        ts = load_task_set(group_option("dataset", name))
        prompts += [encode_prompt(tokenizer, s.turns[0]) for s in ts.calibration[:per_dataset]]
    return prompts


def default_model() -> str:
    """The packaged model every entry point uses unless told otherwise (``conf/base.yaml``)."""
    for entry in yaml.safe_load((conf_dir() / "base.yaml").read_text())["defaults"]:
        if isinstance(entry, dict) and "model" in entry:
            return entry["model"]
    raise SelfSpecError("conf/base.yaml names no default model")


def check_new_keys(config_name: str, overrides: list[str]) -> None:
    """Refuse a ``+key=value`` override whose first part is no setting of ``conf/<config_name>.yaml``.

    Hydra adds such keys without a word, so ``+decodng.k=2`` would run with the default k.
    A config group (``+experiment=headline``) and a key added under a known setting
    (``+method_options.x.y=1``) are fine.
    """
    import difflib

    known = {"hydra"} | {p.name for p in conf_dir().iterdir() if p.is_dir()}
    for name in (config_name, "base"):
        known |= {k for k in (yaml.safe_load((conf_dir() / f"{name}.yaml").read_text()) or {}) if k != "defaults"}
    for o in overrides:
        if not o.startswith("+") or o.startswith("++"):
            continue
        head = o[1:].split("=", 1)[0].split(".", 1)[0].split("@", 1)[0]
        if head not in known:
            close = difflib.get_close_matches(head, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SelfSpecError(f"unknown setting in {o!r}: {config_name} has no {head!r}{hint}")


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def dataset_config(cfg: DictConfig) -> dict:
    """``cfg.dataset`` as a plain dict, the parts of a ``mix`` named by config name resolved to their configs."""
    d = plain(cfg.dataset)
    if d.get("source") == "mix":
        d["parts"] = [group_option("dataset", p) if isinstance(p, str) else p for p in d.get("parts") or []]
    return d


def search_settings(cfg: DictConfig) -> SearchSettings:
    """``cfg.search`` (plus the top-level ``seed`` and ``plans_dir``) as :class:`SearchSettings`."""
    return typed(SearchSettings, {**plain(cfg.search), "seed": cfg.seed, "plans_dir": cfg.plans_dir}, "search")


def decode_config(cfg: DictConfig, dataset_max_new: int, spec: DraftSpec | None) -> DecodeConfig:
    """``cfg.decoding`` as :class:`DecodeConfig`. ``max_new_tokens: null`` takes the dataset's; the draft-length
    policy's keys (``k``, ``adaptive``, ``threshold``, ``k_max``, ``threshold_step``) null take the draft file's (the
    defaults without one); ``rows: null`` the CPU's."""
    d = plain(cfg.decoding)
    sampling = typed(SamplingParams, {key: d.pop(key) for key in ("temperature", "top_k", "top_p") if key in d},
                     "decoding")
    if d.get("max_new_tokens") is None:
        d["max_new_tokens"] = dataset_max_new
    policy = spec or DraftSpec(SkipPlan(1))
    for key, value in policy.length.items():
        if d.get(key) is None:
            d[key] = value
    if d.get("rows", 0) is None:
        del d["rows"]  # the CPU's (DecodeConfig's default)
    return typed(DecodeConfig, {**d, "sampling": sampling}, "decoding")


def draft_options(spec: DraftSpec, overrides: dict | None, where: str = "method_options.self_speculative") -> DraftOptions:
    """The draft file's options with the keys a config sets (``method_options.self_speculative``) on top."""
    return typed(DraftOptions, {**dataclasses.asdict(spec.options), **(overrides or {})}, where)
