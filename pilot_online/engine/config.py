"""Config loading and validation.

PILOT merges any JSON key into ``args`` silently, so a typo (``"online_prototype": true``) would run
the wrong experiment without a word. Here every key must be known: PILOT's run keys, the online keys
below, or the method's own keys (``MethodAdapter.config_keys``). Unknown keys raise with the closest
valid spelling; offline-only keys (epochs, schedulers) raise with what to do instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.checks import check_choice, check_int, closest
from ..core.datasets import dataset_names
from ..core.fgh import OPTION_KEYS as FGH_KEYS
from ..core.fgh import validate_options as validate_fgh_options
from ..core.masks import LOGIT_MASKS
from ..core.streams import BLURRED_SELECTIONS, STREAMS
from .adapter import ConfigKey
from .eval_cache import CACHE_MODES
from .live_log import LOGGERS, check_logger_available
from .loop import AMP_MODES, OPTIMIZERS
from .protocol import HP_COLUMNS

#: Keys PILOT's ``main.py``/``trainer.py``/``BaseLearner`` read, with the online defaults.
PILOT_KEYS: dict[str, ConfigKey] = {
    "prefix": ConfigKey("", "log-file prefix (PILOT)"),
    "dataset": ConfigKey(None, "PILOT dataset name, or a plugin one such as 'synthetic'"),
    "memory_size": ConfigKey(
        0, "PILOT's rehearsal memory: always 0 online (replay: er_memory_size)", forced=True
    ),
    "memory_per_class": ConfigKey(0, "rehearsal memory per class: always 0 online", forced=True),
    "fixed_memory": ConfigKey(False, "PILOT memory option: unused online", forced=True),
    "shuffle": ConfigKey(True, "shuffle the class order with the seed (PILOT DataManager)"),
    "init_cls": ConfigKey(10, "classes in the first task (clear stream; PILOT split)"),
    "increment": ConfigKey(10, "classes per later task (clear stream; PILOT split)"),
    "model_name": ConfigKey(None, "a pilot-online method, e.g. coda_online"),
    "backbone_type": ConfigKey(None, "PILOT backbone name, e.g. vit_base_patch16_224_coda_prompt"),
    "device": ConfigKey(["0"], "PILOT devices: -1 for CPU, else a CUDA index"),
    "seed": ConfigKey([1993], "list of seeds; each seed runs and writes its own results file"),
    "batch_size": ConfigKey(100, "stream batch size (the paper uses 100)"),
    "init_lr": ConfigKey(5e-3, "constant learning rate (no scheduler online)"),
    "optimizer": ConfigKey(
        "adam", "optimizer, at a constant learning rate", choices=tuple(OPTIMIZERS)
    ),
    "weight_decay": ConfigKey(0.0, "optimizer weight decay"),
    "pretrained": ConfigKey(
        True, "load pretrained ViT weights (offline: false, or pretrained_path)"
    ),
    "drop": ConfigKey(0.0, "ViT dropout"),
    "drop_path": ConfigKey(0.0, "ViT stochastic depth"),
}

#: Keys this plugin adds.
ONLINE_KEYS: dict[str, ConfigKey] = {
    "stream": ConfigKey(STREAMS[0], "training stream kind", choices=STREAMS),
    "si_blurry_n": ConfigKey(50, "Si-Blurry N: percent of classes that are disjoint"),
    "si_blurry_m": ConfigKey(10, "Si-Blurry M: percent of blurry-class samples blurred"),
    "si_blurry_selection": ConfigKey(
        BLURRED_SELECTIONS[0],
        "which blurry samples move: the first in dataset order (upstream), or random ones",
        choices=BLURRED_SELECTIONS,
    ),
    "online_prototypes": ConfigKey(False, "add the prototype loss L_P (paper Eq. 1-2)"),
    "fgh": ConfigKey(
        None, "null, or {gamma, granularity, direction, apply, clamp}: Fine-Grained Hypergradients"
    ),
    "logit_mask": ConfigKey("batch", "training-loss logit mask", choices=LOGIT_MASKS),
    "eval_period": ConfigKey(None, "also evaluate every N stream samples (A_auc); null = off"),
    "batchwise_prompt_eval": ConfigKey(
        False, "batch majority-vote prompt selection at test time (leaks task identity)"
    ),
    "backbone_kwargs": ConfigKey({}, "extra kwargs for timm.create_model, e.g. {img_size: 32}"),
    "pretrained_path": ConfigKey(
        None, "local ViT weights file (timm 0.6 npz) instead of a download"
    ),
    "num_workers": ConfigKey(2, "DataLoader workers"),
    "eval_batch_size": ConfigKey(256, "batch size for evaluation"),
    "eval_query_cache": ConfigKey(
        "auto",
        "cache the frozen query pass per test image (L2P, DualPrompt, CODA, MVP); bit-identical",
        choices=CACHE_MODES,
    ),
    "amp": ConfigKey(None, 'null (fp32) or "bf16": bfloat16 autocast in training and evaluation'),
    "sdpa": ConfigKey(False, "ViT attention through torch's scaled_dot_product_attention"),
    "pin_memory": ConfigKey(False, "DataLoader pinned memory (CUDA: faster host-to-device copies)"),
    "max_nonfinite_steps": ConfigKey(10, "consecutive non-finite losses tolerated before stopping"),
    "grad_trace": ConfigKey(
        True, "record per-step classifier-row gradient norms (imbalance plots)"
    ),
    "results_dir": ConfigKey(None, "where results JSON goes (default: PILOT's log directory)"),
    "hp_column": ConfigKey(
        HP_COLUMNS[0],
        "main tables' column the run fills: lr (its init_lr) or best (Best HP, sweep --hp-from)",
        choices=HP_COLUMNS,
    ),
    "log_interval": ConfigKey(10, "steps between progress-bar updates (each one syncs the device)"),
    "er_memory_size": ConfigKey(
        0, "experience-replay reservoir size; > 0 turns replay on (memory-based rows only)"
    ),
    "er_batch_size": ConfigKey(100, "memory samples replayed beside each stream batch"),
    "allow_memory": ConfigKey(
        False, "let a memory-free row keep samples (experience replay on with er_memory_size)"
    ),
    "logger": ConfigKey(
        None,
        "live logging: null (off) or tensorboard (scalars every log_interval)",
        choices=LOGGERS,
    ),
    "logger_dir": ConfigKey(None, "TensorBoard folder (default: beside the results file)"),
    "checkpoint_every": ConfigKey(
        None,
        "checkpoint every N stream batches and at each task end, and resume from it; null = off",
    ),
}

#: The paper's FGH setting (Eq. 8, gamma 1) and its four ablation rows: base, + P, + FGH and
#: + P + FGH ("ours"). exps/, ``pilot-online sweep --grid variant=...`` and the demo use these.
PAPER_FGH = {"gamma": 1, "granularity": "element", "direction": "grad", "apply": "grad"}
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {"online_prototypes": False, "fgh": None},
    "p": {"online_prototypes": True, "fgh": None},
    "fgh_only": {"online_prototypes": False, "fgh": PAPER_FGH},
    "fgh": {"online_prototypes": True, "fgh": PAPER_FGH},
}


def variant_of(config: Mapping[str, Any]) -> str:
    """The :data:`VARIANTS` row a config runs (whatever its FGH options): prototypes on or off x
    FGH on or off."""
    on = (bool(config.get("online_prototypes")), config.get("fgh") is not None)
    return next(
        n for n, v in VARIANTS.items() if (v["online_prototypes"], v["fgh"] is not None) == on
    )


#: Keys PILOT's own scripts put into ``args`` (argparse, trainer), never written by users.
INJECTED_KEYS = ("config", "nb_classes", "nb_tasks")

#: Offline-only keys, with what to do instead.
OFFLINE_KEYS = {
    "tuned_epoch": "online training makes one pass: remove it",
    "epochs": "online training makes one pass: remove it",
    "scheduler": "online training uses a constant learning rate: remove it",
    "min_lr": "online training uses a constant learning rate: remove it",
    "init_milestones": "online training uses a constant learning rate: remove it",
    "init_lr_decay": "online training uses a constant learning rate: remove it",
    "reinit_optimizer": "online training never resets the optimizer (no boundaries): remove it",
}


class ConfigError(ValueError):
    """A config that would run the wrong experiment; the message says what to change."""


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON config with errors that name the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: malformed JSON at line {err.lineno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object of keys")
    return data


def _check_dataset(name: Any) -> None:
    """PILOT looks names up case-insensitively; an unknown one would fail only after setup."""
    owners = dataset_names()
    valid = [n for names in owners.values() for n in names]
    if not isinstance(name, str) or name.lower() not in valid:
        listing = "; ".join(
            f"{owner} datasets: {', '.join(names)}" for owner, names in owners.items()
        )
        hint = closest(str(name).lower(), valid)
        raise ConfigError(f"unknown dataset {name!r}{hint}. {listing}")


def _check_fgh(fgh: Any) -> None:
    if fgh is None:
        return
    if not isinstance(fgh, dict):
        raise ConfigError('"fgh" must be null or an object such as {"gamma": 1}')
    unknown = sorted(set(fgh) - set(FGH_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown fgh key(s) {unknown}{closest(unknown[0], FGH_KEYS)}; "
            f"valid: {', '.join(FGH_KEYS)}"
        )
    try:
        validate_fgh_options(**fgh)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fgh: {err}") from None


def resolve_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The effective config: defaults filled in, every key known, every value checked.

    Needs no PILOT: ``pilot-online check-config`` and the tests call it directly.
    """
    from .registry import get_method

    if not raw.get("model_name"):
        raise ConfigError('the config needs "model_name" (e.g. "coda_online")')
    try:
        adapter = get_method(str(raw["model_name"]))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    schema: dict[str, ConfigKey] = {**PILOT_KEYS, **ONLINE_KEYS, **adapter.config_keys}

    for key in raw:
        if key in OFFLINE_KEYS:
            raise ConfigError(f"{key!r} is an offline-only key: {OFFLINE_KEYS[key]}")
        if key not in schema and key not in INJECTED_KEYS:
            raise ConfigError(
                f"unknown config key {key!r}{closest(key, sorted(schema))}. "
                "Run `pilot-online check-config --keys` for the reference."
            )
    cfg = {key: spec.default for key, spec in schema.items()}
    cfg.update(raw)
    for key, spec in schema.items():
        if spec.forced and cfg[key] != spec.default:
            raise ConfigError(
                f"{key}={cfg[key]!r} cannot be used online ({spec.doc}); set it to {spec.default!r}"
            )
        try:
            if spec.choices is not None:
                check_choice(key, cfg[key], spec.choices)
            if spec.check is not None:
                spec.check(key, cfg[key])
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None
    for key in ("dataset", "backbone_type"):
        if not cfg[key]:
            raise ConfigError(f"the config needs {key!r}")

    if adapter.backbone_types and cfg["backbone_type"] not in adapter.backbone_types:
        raise ConfigError(
            f"backbone_type {cfg['backbone_type']!r} is not a backbone {cfg['model_name']} can "
            f"use: choose one of {', '.join(adapter.backbone_types)}"
        )
    if adapter.backbone_marker not in str(cfg["backbone_type"]).lower():
        raise ConfigError(
            f"backbone_type {cfg['backbone_type']!r} is not a {adapter.base_model_name} backbone: "
            f"PILOT needs one containing {adapter.backbone_marker!r}, e.g. "
            f"'vit_base_patch16_224{adapter.backbone_marker}'"
        )
    _check_dataset(cfg["dataset"])
    try:
        for key in ("batch_size", "eval_batch_size", "init_cls", "increment", "log_interval"):
            check_int(key, cfg[key], 1)
        for key in ("si_blurry_n", "si_blurry_m"):
            check_int(f"{key} (a percentage)", cfg[key], 0, 100)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if not isinstance(cfg["init_lr"], (int, float)) or cfg["init_lr"] <= 0:
        raise ConfigError(f"init_lr must be a positive number, got {cfg['init_lr']!r}")
    if cfg["eval_period"] is not None and (
        not isinstance(cfg["eval_period"], int) or cfg["eval_period"] < 1
    ):
        raise ConfigError("eval_period must be null or a positive number of stream samples")
    every = cfg["checkpoint_every"]
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ConfigError(
            f"checkpoint_every must be null (no checkpoints) or a positive number of stream "
            f"batches, got {every!r}"
        )
    seeds = cfg["seed"] if isinstance(cfg["seed"], list) else [cfg["seed"]]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError('"seed" must be a list of integers, e.g. [1993, 1994]')
    if not isinstance(cfg["backbone_kwargs"], dict):
        raise ConfigError('"backbone_kwargs" must be an object, e.g. {"img_size": 32}')
    if cfg["pretrained_path"] is not None and not Path(cfg["pretrained_path"]).is_file():
        raise ConfigError(
            f"pretrained_path {cfg['pretrained_path']!r} is not a file: point it at the ViT "
            "weights (timm 0.6 npz), or set it to null to download them"
        )
    if cfg["amp"] not in AMP_MODES:
        raise ConfigError(f'amp must be null or "bf16", got {cfg["amp"]!r}')
    for key in ("sdpa", "pin_memory"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"{key} must be true or false, got {cfg[key]!r}")
    _check_fgh(cfg["fgh"])
    if cfg["logger_dir"] is not None and not isinstance(cfg["logger_dir"], str):
        raise ConfigError(f"logger_dir must be null or a folder path, got {cfg['logger_dir']!r}")
    try:
        check_logger_available(cfg["logger"])
    except ImportError as err:
        raise ConfigError(str(err)) from None
    try:
        adapter.check_config(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{cfg['model_name']}: {err}") from None
    _check_replay(cfg, raw, adapter)
    return cfg


def _check_replay(cfg: dict[str, Any], raw: Mapping[str, Any], adapter: Any) -> None:
    """Experience replay is on iff ``er_memory_size > 0``; only memory-based rows keep samples."""
    for key in ("er_memory_size", "er_batch_size"):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
    if not isinstance(cfg["allow_memory"], bool):
        raise ConfigError(f"allow_memory must be true or false, got {cfg['allow_memory']!r}")
    replay = cfg["er_memory_size"] > 0
    default_batch = ONLINE_KEYS["er_batch_size"].default
    name = cfg["model_name"]
    if adapter.memory_based and not replay:
        raise ConfigError(
            f"{name} is experience replay: er_memory_size must be > 0 (the paper: 1000); "
            "for the same model without memory use the memory-free row"
        )
    if replay and not adapter.memory_based and not cfg["allow_memory"]:
        raise ConfigError(
            f"er_memory_size={cfg['er_memory_size']} turns on experience replay, but {name} is "
            "memory-free: it may not keep training samples. Use a memory-based row "
            '(er_online, er_linear_probe_online), set "er_memory_size": 0, or set '
            '"allow_memory": true to add replay deliberately'
        )
    if replay and cfg["er_batch_size"] < 1:
        raise ConfigError("er_batch_size must be >= 1 when experience replay is on")
    # A resolved config (every key written out, as `pilot-online run` and sweep pass it on) holds
    # the default: only a changed value asks for replay that is off.
    if not replay and raw.get("er_batch_size", default_batch) != default_batch:
        raise ConfigError(
            "er_batch_size is set but experience replay is off (er_memory_size is 0): remove it, "
            "or set er_memory_size"
        )


def key_reference() -> str:
    """A plain-text table of every online and PILOT key (``pilot-online check-config --keys``)."""
    from .registry import get_method, list_methods

    lines = []
    sections = [("PILOT run keys", PILOT_KEYS), ("online keys", ONLINE_KEYS)]
    sections += [(f"{m} keys", get_method(m).config_keys) for m in list_methods()]
    for title, keys in sections:
        lines.append(f"# {title}")
        for key, spec in keys.items():
            forced = " (fixed online)" if spec.forced else ""
            choices = f": {' | '.join(map(str, spec.choices))}" if spec.choices else ""
            lines.append(
                f"  {key:<24} default {json.dumps(spec.default):<18} {spec.doc}{choices}{forced}"
            )
    return "\n".join(lines)
