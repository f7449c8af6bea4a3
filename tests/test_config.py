"""Config validation and the method registry (no PILOT needed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import raw_smoke_config

from pilot_online.core.checks import integer
from pilot_online.engine.adapter import ConfigKey, MethodAdapter
from pilot_online.engine.card import MethodCard
from pilot_online.engine.config import (
    VARIANTS,
    ConfigError,
    key_reference,
    load_json,
    resolve_config,
)
from pilot_online.engine.registry import get_method, list_methods, method_card, register_method
from pilot_online.harness.protocol import HP_GRID

ROOT = Path(__file__).resolve().parent.parent
EXPS = sorted((ROOT / "exps").rglob("*.json"))  # the scale model's under exps/scale/


def smoke(**changes):
    config = load_json(ROOT / "exps" / "smoke_coda_online.json")
    config.update(changes)
    return config


def test_every_method_file_is_imported_and_registered():
    """The registry is the one list of methods: every ``pilot_online/methods/*.py`` is found and
    imported by the registry and registers at least one ``*_online`` name; the paper's rows (the
    hp_grid table) are among them."""
    import pilot_online.methods as methods

    files = {p.stem for p in Path(methods.__file__).parent.glob("*.py") if p.stem != "__init__"}
    owners = {get_method(name).__module__.rsplit(".", 1)[-1] for name in list_methods()}
    assert files <= owners, f"method files that register nothing: {sorted(files - owners)}"
    assert list_methods() == sorted(list_methods())
    assert all(name.endswith("_online") for name in list_methods()), list_methods()
    assert {f"{short}_online" for short in HP_GRID} <= set(list_methods())
    assert get_method("CODA_ONLINE").base_model_name == "coda_prompt"


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match=", ".join(list_methods())):
        get_method("coda")


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_method("coda_online")(type("Again", (MethodAdapter,), {}))


def test_a_name_with_capitals_is_refused_at_registration():
    """PILOT lower-cases model_name, and the lookup does too: "Capital_online" could be
    registered yet never found by a config. It is refused where it is written, with the name to
    use. (A name no package registers: an installed outside method must not change the test.)"""
    with pytest.raises(ValueError, match="register 'unregistered_capital_online'"):
        register_method("Unregistered_Capital_online")(type("Capital", (MethodAdapter,), {}))
    names = list_methods()
    assert "Unregistered_Capital_online" not in names
    assert "unregistered_capital_online" not in names


@pytest.mark.parametrize("path", EXPS, ids=[str(p.relative_to(ROOT / "exps")) for p in EXPS])
def test_every_shipped_config_is_valid(path):
    config = resolve_config(load_json(path))
    assert config["batch_size"] == 100
    assert config["memory_size"] == 0


def test_exps_match_their_generator():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_exps.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


def test_defaults_are_filled_in():
    raw = smoke()
    del raw["logit_mask"]
    assert resolve_config(raw)["logit_mask"] == "batch"


def test_unknown_key_suggests_the_right_spelling():
    with pytest.raises(ConfigError, match="did you mean 'online_prototypes'"):
        resolve_config(smoke(online_prototype=True))


def test_offline_key_says_what_to_do():
    with pytest.raises(ConfigError, match="one pass"):
        resolve_config(smoke(tuned_epoch=5))


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("epochs", "one pass: remove it"),
        ("init_epoch", "one pass: remove it"),
        ("lrate", "set that, and remove lrate"),
        ("milestones", "constant learning rate"),
        ("lrate_decay", "constant learning rate"),
        ("init_weight_decay", "weight_decay: set that, and remove init_weight_decay"),
    ],
)
def test_every_schedule_key_of_pilots_classic_configs_is_answered_alike(key, fix):
    """exps/icarl.json's schedule keys (upstream PILOT): each is an offline-only key with what to
    do instead, none an "unknown config key" (the trial port of iCaRL met both answers)."""
    with pytest.raises(ConfigError, match=f"{key!r} is an offline-only key: .*{fix}"):
        resolve_config(smoke(**{key: 1}))


def test_forced_task_aware_option_is_refused():
    config = load_json(ROOT / "exps" / "smoke_l2p_online.json")
    config["use_prompt_mask"] = True
    with pytest.raises(ConfigError, match="use_prompt_mask"):
        resolve_config(config)


def test_wrong_backbone_for_the_method():
    with pytest.raises(ConfigError, match="_coda_prompt"):
        resolve_config(smoke(backbone_type="vit_base_patch16_224_l2p"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": "blurry"}, "clear, si_blurry"),
        ({"logit_mask": "task"}, "batch, seen, none"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"si_blurry_n": 150}, r"si_blurry_n must be an integer in \[0, 100\], got 150"),
        ({"fgh": {"gama": 1}}, "did you mean 'gamma'"),
        ({"fgh": {"granularity": "row"}}, "granularity"),
        ({"fgh": 1}, "null or an object"),
        ({"seed": "1993"}, "seed must be a list of distinct non-negative integers"),
        ({"pretrained_path": "/no/such/weights.npz"}, "is not a file"),
        ({"optimizer": "rmsprop"}, "adam, adamw, sgd"),
    ],
)
def test_bad_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(smoke(**change))


def test_a_method_key_with_choices_is_checked_like_the_online_ones(monkeypatch):
    """One code path for every key with choices, method keys included: other values are refused
    with the list and the closest spelling; a listed value passes and reaches the config."""
    from pilot_online.engine import registry

    class Choosy(get_method("coda_online")):
        config_keys: ClassVar[dict[str, ConfigKey]] = {
            **get_method("coda_online").config_keys,
            "pool_kind": ConfigKey("shared", "prompt pool kind", choices=("shared", "private")),
        }

    monkeypatch.setitem(registry._METHODS, "choosy_online", Choosy)
    monkeypatch.setitem(registry._CARDS, "choosy_online", MethodCard())
    with pytest.raises(
        ConfigError, match=r"'privat' \(did you mean 'private'\?\).*shared, private"
    ):
        resolve_config(smoke(model_name="choosy_online", pool_kind="privat"))
    assert resolve_config(smoke(model_name="choosy_online", pool_kind="private"))["pool_kind"] == (
        "private"
    )
    with pytest.raises(ConfigError, match=r"did you mean 'si_blurry'"):
        resolve_config(smoke(stream="si_blury"))


def test_a_rule_that_reads_other_keys_sits_on_its_key_and_runs_after_every_own_check(
    monkeypatch,
):
    """A key's ``cross_check`` sees the resolved config (defaults filled in, the trigger's
    default set) only once every value passed its own check, and its error names the method."""
    from pilot_online.engine import registry

    seen: list[dict] = []

    def rule(cfg):
        seen.append(dict(cfg))
        if cfg["pool_size"] > cfg["batch_size"]:
            raise ValueError("pool_size must not exceed batch_size: set pool_size <= batch_size")

    class Ruled(get_method("coda_online")):
        config_keys: ClassVar[dict[str, ConfigKey]] = {
            **get_method("coda_online").config_keys,
            "pool_size": ConfigKey(2, "a pool", check=integer(1), cross_check=rule),
        }

    monkeypatch.setitem(registry._METHODS, "ruled_online", Ruled)
    monkeypatch.setitem(registry._CARDS, "ruled_online", MethodCard())
    with pytest.raises(ConfigError, match=r"^ruled_online: pool_size must not exceed batch_size"):
        resolve_config(smoke(model_name="ruled_online", pool_size=10**6))
    assert seen[-1]["consolidation"] == "never"  # resolved: the method's default trigger is in
    seen.clear()
    with pytest.raises(ConfigError, match="pool_size must be a positive integer"):
        resolve_config(smoke(model_name="ruled_online", pool_size="ten"))  # no rule ran
    assert seen == []
    assert resolve_config(smoke(model_name="ruled_online"))["pool_size"] == 2


def test_check_config_is_retired_with_the_fix():
    with pytest.raises(TypeError, match=r"check_config.*cross_check"):

        class Old(MethodAdapter):
            @classmethod
            def check_config(cls, cfg):
                pass


@pytest.mark.parametrize("variant", [VARIANTS["p"], VARIANTS["fgh_only"]], ids=["p", "fgh"])
def test_a_method_that_takes_no_gradient_step_refuses_p_and_fgh(variant, monkeypatch):
    """The engine refuses P and FGH for every ``trains = False`` method (SimpleCIL, an outside
    one alike): they act on gradients, so they would run to no effect."""
    from pilot_online.engine import registry

    raw = {**raw_smoke_config("simplecil_online"), **variant}
    with pytest.raises(ConfigError, match=r"^simplecil_online trains no parameter.*\"fgh\": null"):
        resolve_config(raw)

    class Frozen(get_method("coda_online")):
        trains: ClassVar[bool] = False

    monkeypatch.setitem(registry._METHODS, "frozen_online", Frozen)
    monkeypatch.setitem(registry._CARDS, "frozen_online", MethodCard())
    with pytest.raises(ConfigError, match="frozen_online trains no parameter"):
        resolve_config(smoke(model_name="frozen_online", **variant))
    assert resolve_config(smoke(model_name="frozen_online", **VARIANTS["base"]))["fgh"] is None


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "model_name": "coda_online",\n  "seed": [1,]\n}')
    with pytest.raises(ConfigError, match="line 3"):
        load_json(path)


def test_missing_model_name():
    with pytest.raises(ConfigError, match="model_name"):
        resolve_config({"dataset": "synthetic"})


def test_key_reference_lists_every_method_key():
    reference = key_reference()
    for key in ("online_prototypes", "fgh", "prompt_param", "g_prompt_length", "pull_constraint"):
        assert key in reference


def test_check_config_cli(tmp_path, capsys):
    from pilot_online.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(smoke(fhg=None)))
    assert main(["check-config", str(ROOT / "exps" / "coda_online_fgh.json"), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ok      " in out and "unknown config key 'fhg'" in out


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test " in readme.split("## The first two commands")[1].split("##")[0]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


# -- check-config catches what a run would reject: one case per class of bad input -------------
def smoke_of(method: str) -> dict:
    """The method's smoke config from the generator, so that a method from another package,
    which has no file in this repository's exps/, gets one too."""
    return raw_smoke_config(method)


BAD_INPUTS = {
    "unknown key": (
        "coda_online",
        {"online_prototype": True},
        "unknown config key 'online_prototype' (did you mean 'online_prototypes'?)",
    ),
    "string for a boolean": (
        "coda_online",
        {"online_prototypes": "false"},
        "online_prototypes must be true or false, got 'false' (str)",
    ),
    "negative worker count": (
        "coda_online",
        {"num_workers": -2},
        "num_workers must be null or a non-negative integer, got -2",
    ),
    "float seed": (
        "coda_online",
        {"seed": [1993.0]},
        "seed[0] must be a non-negative integer, got 1993.0 (float)",
    ),
    "repeated seed": (
        "coda_online",
        {"seed": [1993, 1994, 1993]},
        "seed lists a seed twice (1993): [1993, 1994, 1993]; list each once",
    ),
    "bool seed": ("coda_online", {"seed": True}, "seed must be a list of distinct"),
    "infinite learning rate": (
        "coda_online",
        {"init_lr": float("inf")},
        "init_lr must be a number > 0, got inf: write a finite number",
    ),
    "NaN weight decay": (
        "coda_online",
        {"weight_decay": float("nan")},
        "weight_decay must be a number >= 0, got nan: write a finite number",
    ),
    "NaN FGH gamma": ("coda_online", {"fgh": {"gamma": float("nan")}}, "fgh: gamma must be"),
    "infinite FGH eps": ("coda_online", {"fgh": {"eps": float("-inf")}}, "fgh: eps must be"),
    "string learning rate": (
        "l2p_online",
        {"init_lr": "5e-3"},
        "init_lr must be a number > 0, got '5e-3' (str)",
    ),
    "lora_rank 0": (
        "olora_online",
        {"lora_rank": 0},
        "olora_online: lora_rank must be a positive integer, got 0",
    ),
    "prompt layer past the last block": (
        "convprompt_online",
        {"prompt_layers": [0, 5, 12]},
        "convprompt_online: prompt_layers=[0, 5, 12] names block 12, past the last block of the "
        "12-block ViT: use indices in [0, 11]",
    ),
    "prompt layer past the last block of a vit_depth ViT": (  # the scale model's 5 blocks
        "convprompt_online",
        {"vit_depth": 5},
        "convprompt_online: prompt_layers=[0, 1, 2, 3, 4, 5, 6] names block 5, past the last "
        "block of the 5-block ViT: use indices in [0, 4]",
    ),
    "e-prompt past the last block of a vit_depth ViT": (
        "dualprompt_online",
        {"vit_depth": 3},
        "dualprompt_online: e_prompt_layer_idx=[2, 3, 4] names block 3, past the last block of "
        "the 3-block ViT",
    ),
    "prompt layer listed twice": (
        "dualprompt_online",
        {"e_prompt_layer_idx": [2, 2]},
        "dualprompt_online: e_prompt_layer_idx lists a block twice (2)",
    ),
    "top_k beyond the pool": (
        "l2p_online",
        {"top_k": 11},
        "l2p_online: top_k=11 prompts cannot be selected from a pool of size=10",
    ),
    "malformed prompt_param": (
        "coda_online",
        {"prompt_param": [100, 8]},
        "coda_online: prompt_param must be [components, prompt length, orthogonality weight]",
    ),
    "backbone PILOT cannot build": (
        "aper_ssf_online",
        {"backbone_type": "vit_base_patch16_224_ssf"},
        "backbone_type 'vit_base_patch16_224_ssf' is not a backbone PILOT builds for "
        "aper_ssf_online (upstream model 'aper_ssf') (did you mean "
        "'pretrained_vit_b16_224_ssf'?): choose one of pretrained_vit_b16_224_ssf, "
        "pretrained_vit_b16_224_in21k_ssf",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_check_config_rejects_each_class_of_bad_input(case, tmp_path, capsys):
    """``pilot-online check-config`` names the key, what it must be and what it got, exits 1,
    and prints no traceback."""
    from pilot_online.cli.main import main

    method, change, message = BAD_INPUTS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**smoke_of(method), **change}))
    assert main(["check-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == f"invalid {path}: {captured.out.split(': ', 1)[1]}"
    assert message in captured.out, captured.out
    assert "Traceback" not in captured.out + captured.err


def test_check_config_rejects_malformed_json(tmp_path, capsys):
    from pilot_online.cli.main import main

    path = tmp_path / "broken.json"
    path.write_text('{"model_name": "coda_online",\n "seed": [1993,]\n}')
    assert main(["check-config", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.strip() == f"invalid {path}: not valid JSON at line 2, column 16: Expecting value"


@pytest.mark.parametrize("name", list_methods())
def test_backbone_suggestions_are_names_the_method_accepts(name):
    """A refused ``backbone_type`` is answered only with names the method's table holds (which
    tests/test_contract.py checks against PILOT's get_backbone); never with a guess."""
    backbones = method_card(name).backbone_types
    assert backbones, f"{name}'s card declares no backbone_types"
    with pytest.raises(ConfigError) as refused:
        resolve_config({**smoke_of(name), "backbone_type": "vit_base_patch16_224_nope"})
    named = set(re.findall(r"'?([a-z0-9_]+_224[a-z0-9_]*)'?", str(refused.value)))
    assert named - {"vit_base_patch16_224_nope"} <= set(backbones)
    for accepted in backbones:
        resolve_config({**smoke_of(name), "backbone_type": accepted})
