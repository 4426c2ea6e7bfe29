"""The layout's promises: the library never imports hydra/omegaconf/wandb, every default is
written once (YAML and dataclasses agree), one default model everywhere, configs ship in the wheel."""

import ast
import dataclasses
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from selfspec.cli.config import conf_dir, default_model
from selfspec.draft.path import DraftOptions
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.sampling import SamplingParams
from selfspec.eval.methods import OPTIONS
from selfspec.eval.runner import EvalSettings
from selfspec.search.settings import SearchSettings
from selfspec.typed import defaults, typed
from tests.helpers import ROOT

PACKAGE = ROOT / "selfspec"
ENTRY_ONLY = ("hydra", "omegaconf", "wandb")
SHIMS = {"__main__.py", "generate.py", "tables.py"}  # `python -m selfspec.<x>` hand over to selfspec.cli


def _library_modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py")
            if "cli" not in p.relative_to(PACKAGE).parts
            and not (p.name in SHIMS and (p.parent == PACKAGE or p.name == "__main__.py"))]


def test_library_source_never_imports_entry_point_packages():
    offenders = []
    for path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ENTRY_ONLY or name.startswith("selfspec.cli"):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


@pytest.mark.cli
def test_importing_the_whole_library_loads_no_entry_point_package():
    mods = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in _library_modules()]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + f"bad = [m for m in sys.modules if m.split('.')[0] in {ENTRY_ONLY!r} or m.startswith('selfspec.cli')]\n"
            + "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]


def _yaml(rel: str) -> dict:
    return yaml.safe_load((conf_dir() / rel).read_text())


def test_search_defaults_are_written_once():
    conf = _yaml("search/default.yaml")
    code = defaults(SearchSettings)
    derived = {"storage", "study_name"}  # interpolations of the study name in the YAML
    for key, value in conf.items():
        if key in derived:
            continue
        if isinstance(value, dict):
            assert value == code[key], key
        else:
            assert value == code[key], f"search.{key}: YAML {value!r}, SearchSettings {code[key]!r}"
    assert set(conf) | {"seed", "plans_dir"} == set(code)  # every setting has its YAML line
    top = _yaml("search.yaml")
    assert (top["seed"], top["plans_dir"]) == (code["seed"], code["plans_dir"])


def test_decoding_defaults_are_written_once():
    conf = _yaml("decoding/default.yaml")
    code = {**defaults(DecodeConfig), **defaults(SamplingParams)}
    code.pop("sampling")
    # the dataset's, the draft file's, the CPU's
    null_means_elsewhere = {"max_new_tokens", "k", "adaptive", "threshold", "k_max", "threshold_step", "rows"}
    assert set(conf) == set(code)
    for key, value in conf.items():
        if key in null_means_elsewhere:
            assert value is None
        else:
            assert value == code[key], f"decoding.{key}: YAML {value!r}, code {code[key]!r}"


def test_method_options_and_runner_defaults_are_written_once():
    conf = _yaml("evaluate.yaml")
    for method, cls in OPTIONS.items():
        code = defaults(cls)
        assert conf["method_options"][method] == {k: v for k, v in code.items() if k in conf["method_options"][method]}
        assert set(conf["method_options"][method]) <= set(code)
    assert set(conf["method_options"]) == set(OPTIONS)
    runner = defaults(EvalSettings)
    for key in ("baseline", "n_samples", "warmup_tokens"):
        assert conf[key] == runner[key], key


def test_typed_settings_refuse_unknown_keys():
    from selfspec import SelfSpecError

    with pytest.raises(SelfSpecError, match="unknown key ngrams in method_options.self_speculative"):
        typed(DraftOptions, {"ngrams": 3}, "method_options.self_speculative")
    s = typed(SearchSettings, {"warm_start": ["a.json"], "retime": {"top_n": 2}}, "search")
    assert s.warm_start == ("a.json",) and s.retime.top_n == 2 and dataclasses.is_dataclass(s.retime)


def test_one_default_model_everywhere():
    model = default_model()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for entry in ("search", "evaluate"):
            assert compose(config_name=entry).model.name == model
    from selfspec.cli.generate import build_parser

    assert build_parser().parse_args([]).model == model
    assert f"`{model}` (default)" in (ROOT / "README.md").read_text()


@pytest.mark.cli
def test_wheel_ships_the_configs(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                        "-w", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = tmp_path.glob("selfspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert {f"selfspec/conf/{n}" for n in shipped} <= names
    # an installed copy finds them there (no conf/ beside the package)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = "from selfspec.cli.config import conf_dir; print(conf_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == target / "selfspec" / "conf"


def _literal_defaults() -> dict[str, list[tuple[str, object]]]:
    """Every literal default in the library: dataclass fields and keyword defaults of functions, by name."""
    found: dict[str, list[tuple[str, object]]] = {}
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            pairs = []
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                pairs = [(s.target.id, s.value) for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None]
                owner = node.name
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = [(arg.arg, d) for arg, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)]
                pairs += [(arg.arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                owner = f"{node.name}()"
            for name, value in pairs:
                if isinstance(value, ast.Constant):
                    found.setdefault(name, []).append((f"{where}:{owner}", value.value))
    return found


# settings of another meaning that share a name and a default with one of ours
OWN_MEANING = {"seed": "a tiny model's weights and the bootstrap's resampling have seeds of their own"}


def test_no_default_of_the_options_or_settings_is_written_twice_in_the_library():
    """A default of DraftOptions, DecodeConfig or SearchSettings is one literal: any other dataclass field or
    keyword default of the same name and value reads it from its owner instead of repeating it."""
    found = _literal_defaults()
    repeated = []
    for cls in (DraftOptions, DecodeConfig, SearchSettings):
        for name, value in defaults(cls).items():
            if name in OWN_MEANING or isinstance(value, (dict, list)):
                continue
            copies = [where for where, v in found.get(name, []) if v == value and type(v) is type(value)]
            if len(copies) > 1:
                repeated.append(f"{name}={value!r}: {', '.join(copies)}")
    assert not repeated, repeated


def test_the_draft_length_policy_has_one_default():
    """k, the adaptive exit and its threshold: the draft file's defaults are the decoding loop's."""
    from selfspec.draft.spec import LENGTH, DraftSpec
    from selfspec.model.plan import SkipPlan

    assert DraftSpec(SkipPlan(2)).length == {name: getattr(DecodeConfig(), name) for name in LENGTH}
