"""Every config composes: each experiment, each option of each group in both entry points, the tasks mix."""

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf

from tests.helpers import CONF


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    assert cfg.name == experiment
    assert cfg.hydra.mode == RunMode.MULTIRUN  # every experiment file is a sweep
    assert cfg.hydra.sweeper.params


@pytest.mark.parametrize("group", ["model", "dataset", "decoding", "logger"])
def test_every_group_option_composes_in_both_entry_points(group):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for option in _options(group):
            for entry in ("evaluate", "search"):
                if entry == "search" and group == "decoding":
                    continue
                cfg = compose(config_name=entry, overrides=[f"{group}={option}"])
                # the file it names, under what the entry point's own config sets in the group (evaluate: logger.dir)
                own = yaml.safe_load((CONF / f"{entry}.yaml").read_text()).get(group) or {}
                want = {**yaml.safe_load((CONF / group / f"{option}.yaml").read_text()), **own}
                assert OmegaConf.to_container(cfg[group]) == want, f"{entry}: {group}={option}"


def test_the_tasks_mix_composes_from_the_four_sets():
    from selfspec.cli.config import dataset_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search", overrides=["dataset=tasks"])
    d = dataset_config(cfg)
    assert [p["name"] for p in d["parts"]] == ["humaneval", "gsm8k", "mtbench", "summarization"]


def test_the_search_re_times_and_checks_held_out_on_prompts_of_every_kind():
    from selfspec.cli.config import dataset_config
    from selfspec.search.variants import spread

    assert spread(12, 4) == [0, 3, 6, 9] and spread(8, 2) == [0, 4] and spread(3, 5) == [0, 1, 2]
    assert spread(5, 0) == []
    # the tasks mix lists each set's rows in a block: 3 calibration and 2 held-out rows per set
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search", overrides=["dataset=tasks"])
    per_cal, per_held, parts = cfg.dataset.calibration_per_part, cfg.dataset.heldout_per_part, len(cfg.dataset.parts)
    assert [i // per_cal for i in spread(per_cal * parts, cfg.search.retime.prompts)] == list(range(parts))
    assert [i // per_held for i in spread(per_held * parts, cfg.search.heldout.prompts)] == list(range(parts))
    # the default set: its re-timed and held-out prompts are one code, one math, one chat, one summarization prompt
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search")
    d = dataset_config(cfg)
    kinds = {"code": ("Python",), "math": ("step by step", "Show your work"), "summarization": ("Summarize",)}

    def kind(text: str) -> str:
        return next((k for k, words in kinds.items() if any(w in text for w in words)), "chat")

    for texts, n in ((d["calibration"], cfg.search.retime.prompts), (d["heldout"], cfg.search.heldout.prompts)):
        picked = [kind(texts[i]) for i in spread(len(texts), n)]
        assert sorted(picked) == ["chat", "code", "math", "summarization"], picked


def test_the_decoding_defaults_need_no_rows_and_are_row_invariant():
    """rows null takes the CPU's; the forwards are row-invariant unless a run says otherwise."""
    from selfspec.cli.config import conf_dir, decode_config
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.engine.decoding import DecodeConfig
    from selfspec.model.plan import SkipPlan

    base = yaml.safe_load((conf_dir() / "decoding" / "default.yaml").read_text())
    spec = DraftSpec(SkipPlan(4), DraftOptions(ngram=3, copy_tokens=10, copy_candidates=3), k=5)
    cfg = decode_config(OmegaConf.create({"decoding": base}), 8, spec)
    assert cfg.rows == DecodeConfig().rows and cfg.row_invariant and cfg.k == 5
    off = decode_config(OmegaConf.create({"decoding": {**base, "row_invariant": False, "rows": 16}}), 8, spec)
    assert off.rows == 16 and not off.row_invariant
