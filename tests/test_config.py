"""Config validation and the method registry (no PILOT needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from pilot_online.engine.adapter import ConfigKey, MethodAdapter
from pilot_online.engine.config import ConfigError, key_reference, load_json, resolve_config
from pilot_online.engine.registry import get_method, list_methods, register_method

ROOT = Path(__file__).resolve().parent.parent
EXPS = sorted((ROOT / "exps").glob("*.json"))


def smoke(**changes):
    config = load_json(ROOT / "exps" / "smoke_coda_online.json")
    config.update(changes)
    return config


def test_builtin_methods_are_registered():
    assert list_methods() == [
        "coda_online",
        "convprompt_online",
        "dualprompt_online",
        "er_linear_probe_online",
        "er_online",
        "finetune_online",
        "l2p_online",
        "linear_probe_online",
        "mvp_online",
        "olora_online",
    ]
    assert get_method("CODA_ONLINE").base_model_name == "coda_prompt"


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="coda_online, convprompt_online, dualprompt_online"):
        get_method("coda")


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_method("coda_online")(type("Again", (MethodAdapter,), {}))


@pytest.mark.parametrize("path", EXPS, ids=[p.name for p in EXPS])
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
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"si_blurry_n": 150}, "percentage"),
        ({"fgh": {"gama": 1}}, "did you mean 'gamma'"),
        ({"fgh": {"granularity": "row"}}, "granularity"),
        ({"fgh": 1}, "null or an object"),
        ({"seed": "1993"}, "list of integers"),
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
    with pytest.raises(
        ConfigError, match=r"'privat' \(did you mean 'private'\?\).*shared, private"
    ):
        resolve_config(smoke(model_name="choosy_online", pool_kind="privat"))
    assert resolve_config(smoke(model_name="choosy_online", pool_kind="private"))["pool_kind"] == (
        "private"
    )
    with pytest.raises(ConfigError, match=r"did you mean 'si_blurry'"):
        resolve_config(smoke(stream="si_blury"))


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


def test_readme_documents_every_online_key():
    from pilot_online.engine.config import ONLINE_KEYS

    readme = (ROOT / "README.md").read_text()
    missing = [key for key in ONLINE_KEYS if f"`{key}`" not in readme]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test " in readme.split("## The first two commands")[1].split("##")[0]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")
