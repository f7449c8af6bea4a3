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

from ..core.checks import (
    boolean,
    check_choice,
    closest,
    described,
    description_of,
    integer,
    json_object,
    list_of,
    optional,
    real,
    spec_of,
    string,
    text,
)
from ..core.datasets import dataset_names
from ..core.fgh_options import OPTION_KEYS as FGH_KEYS
from ..core.fgh_options import validate_options as validate_fgh_options
from ..core.realtime import check_realtime_config
from ..core.scale_backbone import resolve_weights
from ..core.streams import BLURRED_SELECTIONS, STREAMS
from ..core.triggers import TRIGGERS
from .backbone_names import VIT_B16_BLOCKS
from .checkpointer import CheckpointOptions
from .console import ConsoleOptions
from .eval_cache import QueryCacheOptions
from .evaluation import EvaluationOptions
from .flops import check_flop_counts
from .live_log import LiveLogOptions
from .loop import OPTIMIZERS, LoopOptions
from .options import ConfigKey
from .pixel_cache import PixelCacheOptions
from .replay import ReplayOptions
from .scoring import RealtimeOptions, timing_config

#: Suffixes ``pretrained_path`` accepts: the timm 0.6 npz, a torch state dict, a safetensors file.
NPZ_SUFFIXES = (".npz",)
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
SAFETENSORS_SUFFIXES = (".safetensors",)
WEIGHT_SUFFIXES = NPZ_SUFFIXES + TORCH_SUFFIXES + SAFETENSORS_SUFFIXES


def check_weights_suffix(path: str | Path) -> str:
    """The suffix of a ``pretrained_path`` (lower case) if it is a form we read; else a
    ValueError listing the forms."""
    suffix = Path(path).suffix.lower()
    if suffix not in WEIGHT_SUFFIXES:
        raise ValueError(
            f"pretrained_path {str(path)!r} has the suffix {suffix or '(none)'!r}, which is no "
            f"weights form pilot-online reads: use {', '.join(WEIGHT_SUFFIXES)} (timm 0.6's npz, "
            "a torch.save'd timm ViT state dict, or the Hugging Face cache's model.safetensors)"
        )
    return suffix


def check_weights_file(name: str, value: Any) -> str:
    """A ``pretrained_path``: an existing file in a form the backbones read (by its suffix)."""
    if not isinstance(value, str) or not Path(value).is_file():
        raise ValueError(
            f"{name} {value!r} is not a file: point it at the ViT weights, or set it to null "
            "to download them"
        )
    check_weights_suffix(value)
    return value


def _dataset(name: str, value: Any) -> str:
    """PILOT looks names up case-insensitively; an unknown one would fail only after setup."""
    owners = dataset_names()
    valid = [n for names in owners.values() for n in names]
    if not isinstance(value, str) or value.lower() not in valid:
        listing = "; ".join(
            f"{owner} datasets: {', '.join(names)}" for owner, names in owners.items()
        )
        hint = closest(str(value).lower(), valid)
        raise ValueError(f"unknown {name} {value!r}{hint}. {listing}")
    return value


def _devices(name: str, value: Any) -> list:
    """PILOT's ``device`` list: ``-1`` (the CPU) or CUDA indices. PILOT's trainer replaces them
    by ``torch.device`` objects before the learner resolves its args again: those pass too."""
    entries = value if isinstance(value, (list, tuple)) else None
    ok = bool(entries) and all(
        (isinstance(d, int) and not isinstance(d, bool) and d >= -1)
        or (isinstance(d, str) and d.isdigit())
        or type(d).__name__ == "device"
        for d in entries
    )
    if not ok:
        raise ValueError(
            f"{name} must be a list of devices, [-1] for the CPU or CUDA indices such as "
            f'["0"], got {value!r}'
        )
    return list(entries)


_SEED = integer(0)
_SEED_LIST = list_of(
    _SEED,
    "a list of distinct non-negative integers, e.g. [1993, 1994]",
    min_length=1,
    distinct=True,
    entry="a seed",
)


def _seeds(name: str, value: Any) -> list:
    """A list of distinct seeds: PILOT's trainer runs each (a repeat would run fewer seeds than
    the config lists) and hands the learner one, an integer, which resolves again."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [_SEED(name, value)]
    return _SEED_LIST(name, value)


def _fgh(name: str, value: Any) -> Any:
    """``null``, or FGH's options with known names and valid values (``core.fgh``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f'"{name}" must be null or an object such as {{"gamma": 1}}')
    unknown = sorted(set(value) - set(FGH_KEYS))
    if unknown:
        raise ValueError(
            f"unknown {name} key(s) {unknown}{closest(unknown[0], FGH_KEYS)}; "
            f"valid: {', '.join(FGH_KEYS)}"
        )
    try:
        validate_fgh_options(**value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err}") from None
    return value


#: ``hp_column`` values: a run fills its init_lr's column, or the "Best HP" column (the
#: protocol, ``harness/protocol.py``, reads them from here, where the key is checked).
HP_COLUMNS: tuple[str, ...] = ("lr", "best")


described(description_of(_SEED_LIST), _seeds, spec_of(_SEED_LIST))
described("a list of -1 (the CPU) or CUDA indices", _devices)
described("null or an object of FGH options", _fgh)


#: Keys PILOT's ``main.py``/``trainer.py``/``BaseLearner`` read, with the online defaults.
PILOT_KEYS: dict[str, ConfigKey] = {
    "prefix": ConfigKey("", "log-file prefix (PILOT)", check=text),
    "dataset": ConfigKey(
        None, "PILOT dataset name, or a plugin one such as 'synthetic'", check=_dataset
    ),
    "memory_size": ConfigKey(
        0,
        "PILOT's rehearsal memory, built at task ends: always 0 online; the online memory is "
        "er_memory_size",
        forced=True,
    ),
    "memory_per_class": ConfigKey(
        0,
        "PILOT's per-class quota: always 0 online; the online one is er_memory_per_class",
        forced=True,
    ),
    "fixed_memory": ConfigKey(
        False,
        "PILOT's fixed quota switch: unused online; set er_memory_per_class for a fixed quota",
        forced=True,
    ),
    "shuffle": ConfigKey(
        True, "shuffle the class order with the seed (PILOT DataManager)", check=boolean
    ),
    "init_cls": ConfigKey(
        10, "classes in the first task (clear stream; PILOT split)", check=integer(1)
    ),
    "increment": ConfigKey(
        10, "classes per later task (clear stream; PILOT split)", check=integer(1)
    ),
    "model_name": ConfigKey(None, "a pilot-online method, e.g. coda_online"),
    "backbone_type": ConfigKey(
        None,
        "PILOT backbone name, one the method's base model builds (check-config lists them)",
        check=optional(text),
    ),
    "device": ConfigKey(["0"], "PILOT devices: -1 for CPU, else a CUDA index", check=_devices),
    "seed": ConfigKey(
        [1993], "list of seeds; each seed runs and writes its own results file", check=_seeds
    ),
    "batch_size": ConfigKey(100, "stream batch size (the paper uses 100)", check=integer(1)),
    "init_lr": ConfigKey(
        5e-3, "constant learning rate (no scheduler online)", check=real(positive=True)
    ),
    "optimizer": ConfigKey(
        "adam", "optimizer, at a constant learning rate", choices=tuple(OPTIMIZERS)
    ),
    "weight_decay": ConfigKey(0.0, "optimizer weight decay", check=real(0)),
    "pretrained": ConfigKey(
        True, "load pretrained ViT weights (offline: false, or pretrained_path)", check=boolean
    ),
    "drop": ConfigKey(0.0, "ViT dropout", check=real(0, 1)),
    "drop_path": ConfigKey(0.0, "ViT stochastic depth", check=real(0, 1)),
}

#: Keys this plugin adds.
ONLINE_KEYS: dict[str, ConfigKey] = {
    "stream": ConfigKey(STREAMS[0], "training stream kind", choices=STREAMS),
    "si_blurry_n": ConfigKey(
        50, "Si-Blurry N: percent of classes that are disjoint", check=integer(0, 100)
    ),
    "si_blurry_m": ConfigKey(
        10, "Si-Blurry M: percent of blurry-class samples blurred", check=integer(0, 100)
    ),
    "si_blurry_selection": ConfigKey(
        BLURRED_SELECTIONS[0],
        "which blurry samples move: the first in dataset order (upstream), or random ones",
        choices=BLURRED_SELECTIONS,
    ),
    "online_prototypes": ConfigKey(
        False, "add the prototype loss L_P (paper Eq. 1-2)", check=boolean
    ),
    "fgh": ConfigKey(
        None,
        "null, or {gamma, granularity, direction, apply, clamp}: Fine-Grained Hypergradients",
        check=_fgh,
    ),
    **LoopOptions.keys(),
    "online_accuracy": ConfigKey(
        None,
        "score each stream batch before training on it (A_online, docs/protocol.md): an extra "
        "eval-mode pass per batch, under the evaluation view; null: on in real-time mode (its "
        "metric), else off for its cost",
        check=optional(boolean),
    ),
    "consolidation": ConfigKey(
        None,
        "when a method's task-boundary step runs, from the stream alone (core/triggers.py); "
        "null: the method's default (its Consolidation's trigger)",
        choices=(None, *TRIGGERS),
    ),
    "consolidation_every_n_samples": ConfigKey(
        1000, "every_n_samples trigger: stream samples between firings", check=integer(1)
    ),
    "consolidation_new_classes": ConfigKey(
        10, "new_classes trigger: classes first seen since the last firing", check=integer(1)
    ),
    "consolidation_plateau_window": ConfigKey(
        5, "plateau trigger: steps in the loss window (oLoRA's detector)", check=integer(1)
    ),
    "consolidation_plateau_mean": ConfigKey(
        6.0, "plateau trigger: fires when the window's mean loss is below this", check=real()
    ),
    "consolidation_plateau_variance": ConfigKey(
        0.1, "plateau trigger: ... and the window's loss variance below this", check=real(0)
    ),
    "batchwise_prompt_eval": ConfigKey(
        False,
        "batch majority-vote prompt selection at test time (leaks task identity)",
        check=boolean,
    ),
    "backbone_kwargs": ConfigKey(
        {}, "extra kwargs for timm.create_model, e.g. {img_size: 32}", check=json_object
    ),
    "vit_depth": ConfigKey(
        None,
        "ViT blocks every network of the run is built with (null: its factory's, 12 for "
        "ViT-B); a pretrained file of more blocks lends its first ones. The scale model: 5",
        check=optional(integer(1, VIT_B16_BLOCKS)),
    ),
    "pretrained_path": ConfigKey(
        None,
        "local ViT weights instead of a download: timm 0.6's npz, or a timm state dict "
        "(.pth/.pt/.bin, or the Hugging Face cache's .safetensors); loaded strictly",
        check=lambda name, value: None if value is None else check_weights_file(name, value),
    ),
    "num_workers": ConfigKey(
        None,
        "DataLoader workers per loader (stream, replay, evaluation; persistent for the run); "
        "null = one per CPU this process may use, less one, at most 16",
        check=optional(integer(minimum=0)),
    ),
    "eval_batch_size": ConfigKey(256, "batch size for evaluation", check=integer(1)),
    **QueryCacheOptions.keys(),
    **PixelCacheOptions.keys(),
    "sdpa": ConfigKey(
        False, "ViT attention through torch's scaled_dot_product_attention", check=boolean
    ),
    "pin_memory": ConfigKey(
        None,
        "DataLoader pinned memory (faster host-to-device copies); null = on when the device is "
        "a GPU",
        check=optional(boolean),
    ),
    "results_dir": ConfigKey(
        None,
        "where results JSON goes (default: PILOT's log directory)",
        check=optional(string("a folder path")),
    ),
    "hp_column": ConfigKey(
        HP_COLUMNS[0],
        "main tables' column the run fills: lr (its init_lr) or best (Best HP, sweep --hp-from)",
        choices=HP_COLUMNS,
    ),
    # Components declare their own keys, each beside the code that reads it: replay's, and
    # the run's listeners'.
    **ReplayOptions.keys(),
    **RealtimeOptions.keys(),
    **EvaluationOptions.keys(),
    **ConsoleOptions.keys(),
    **LiveLogOptions.keys(),
    **CheckpointOptions.keys(),
}

#: The forms of FGH the paper states (docs/fgh.md; ``benchmarks/fgh_proxy.py`` measures them).
#: ``appendix``: the appendix algorithm, "the algorithm that we used for our experiments": one
#: coefficient per classifier row (weight row and bias together), paired Adam-normalised
#: directions, at the paper's gamma 1 ("we set gamma=1 for all experiments by default") and only
#: the bound the paper states, alpha >= 0 (upper bound ``null``: none). ``appendix_clamp10``: the
#: same algorithm at its listing's gamma 1e-3 with an upper bound of 10 (our former choice; the
#: bound removes most of the paper's "+ ours" gain, docs/fgh.md). ``eq8``: the main text's Eq. 8
#: and Algorithm 1, one coefficient per trainable scalar on raw gradients, gamma 1.
FGH_FORMS: dict[str, dict[str, Any]] = {
    "appendix": {
        "gamma": 1.0,
        "granularity": "class",
        "direction": "adam",
        "apply": "grad",
        "clamp": [0.0, None],
    },
    "appendix_clamp10": {
        "gamma": 0.001,
        "granularity": "class",
        "direction": "adam",
        "apply": "grad",
        "clamp": [0.0, 10.0],
    },
    "eq8": {
        "gamma": 1,
        "granularity": "element",
        "direction": "grad",
        "apply": "grad",
        "clamp": [0.0, 10.0],
    },
}
#: The FGH the paper's "+ ours" rows ran (the appendix algorithm), and its four ablation rows:
#: base, + P, + FGH and + P + FGH ("ours"). exps/, ``pilot-online sweep --grid variant=...`` and
#: the demo use these; the other form is ``FGH_FORMS["eq8"]``, pasted as a config's ``"fgh"``.
PAPER_FGH = FGH_FORMS["appendix"]
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
    # The schedule keys of PILOT's classic configs (icarl.json, der.json, ...): one pass at one
    # learning rate, so each is answered the same way, with what replaces it.
    "init_epoch": "online training makes one pass: remove it",
    "init_epochs": "online training makes one pass: remove it",
    "later_epochs": "online training makes one pass: remove it",
    "lrate": "online training has one learning rate, init_lr: set that, and remove lrate",
    "later_lr": "online training has one learning rate, init_lr: set that, and remove later_lr",
    "milestones": "online training uses a constant learning rate: remove it",
    "lrate_decay": "online training uses a constant learning rate: remove it",
    "init_weight_decay": (
        "online training has one weight decay, weight_decay: set that, and remove init_weight_decay"
    ),
}


class ConfigError(ValueError):
    """A config that would run the wrong experiment; the message says what to change."""


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON config. The one loader of every entry point (``check-config``, ``run``,
    ``sweep``, PILOT's patched ``main.py``), so that a broken file is one ConfigError line that
    names the file, the line and the column, never a traceback."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}: not valid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
        ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object of keys")
    return data


def _check_backbone(cfg: dict[str, Any], upstream: str, accepted: tuple[str, ...]) -> None:
    """``backbone_type`` must be a name PILOT's ``get_backbone`` builds for the method's upstream
    model (its card's ``backbone_types``, from ``engine/backbone_names.py``): PILOT itself fails
    only after setup, or with an ``UnboundLocalError`` for a name that matches a branch's
    substring but none of its exact names. Only names in the table are ever suggested."""
    name, model = cfg["backbone_type"], cfg["model_name"]
    if accepted and name not in accepted:
        raise ConfigError(
            f"backbone_type {name!r} is not a backbone PILOT builds for {model} (upstream "
            f"model {upstream!r}){closest(name, accepted)}: choose one of {', '.join(accepted)}"
        )


#: PILOT 5240714's own model names (``utils/factory.py``): its offline learners.
PILOT_MODEL_NAMES = (
    "simplecil", "aper_finetune", "aper_ssf", "aper_vpt", "aper_adapter", "l2p", "dualprompt",
    "coda_prompt", "finetune", "icarl", "der", "coil", "foster", "memo", "ranpac", "ease",
    "slca", "lae", "fecam", "dgr", "mos", "cofima", "duct",
)  # fmt: skip


def unknown_method(name: str) -> str:
    """Why ``model_name`` names no pilot-online method, in one line with the name to use: for
    one of PILOT's own (offline) learners, its online port; else the closest registered name."""
    from .registry import get_method, list_methods

    methods, lower = list_methods(), name.lower()
    if lower in PILOT_MODEL_NAMES:
        ports = [m for m in methods if get_method(m).base_model_name == lower]
        ports = [m for m in ports if m == f"{lower}_online"] or ports
        use = " or ".join(repr(m) for m in ports) or "one of " + ", ".join(methods)
        return (
            f"model_name {name!r} is PILOT's own offline learner (it needs PILOT's epoch and "
            f"scheduler keys, and trains task by task): for online training set model_name to "
            f"{use}"
        )
    return (
        f"unknown model_name {name!r}{closest(lower, methods)}; pilot-online methods: "
        f"{', '.join(methods)}"
    )


def resolve_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The effective config: defaults filled in, every key known, every value checked.

    Needs no PILOT: ``pilot-online check-config`` and the tests call it directly.
    """
    from .registry import get_method, method_card

    if not raw.get("model_name"):
        raise ConfigError('the config needs "model_name" (e.g. "coda_online")')
    try:
        adapter = get_method(str(raw["model_name"]))
    except ValueError:
        raise ConfigError(unknown_method(str(raw["model_name"]))) from None
    schema: dict[str, ConfigKey] = {**PILOT_KEYS, **ONLINE_KEYS, **adapter.config_keys}
    card = method_card(str(raw["model_name"]))
    removed = card.removed_keys

    for key in raw:
        if key in OFFLINE_KEYS:
            raise ConfigError(f"{key!r} is an offline-only key: {OFFLINE_KEYS[key]}")
        if key in removed:
            raise ConfigError(
                f"{key!r} was removed from {raw['model_name']}: {removed[key]}; "
                "delete the key from the config"
            )
        if key not in schema and key not in INJECTED_KEYS:
            raise ConfigError(
                f"unknown config key {key!r}{closest(key, sorted(schema))}. "
                "Run `pilot-online check-config --keys` for the reference."
            )
    cfg = {key: spec.default for key, spec in schema.items()}
    cfg.update(raw)
    if isinstance(cfg["pretrained_path"], str):  # the shipped scale backbone, by its package name
        cfg["pretrained_path"] = resolve_weights(cfg["pretrained_path"])
    for key in ("dataset", "backbone_type"):
        if not cfg[key]:
            raise ConfigError(f"the config needs {key!r}")
    method_keys = set(adapter.config_keys)
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
            owner = f"{cfg['model_name']}: " if key in method_keys else ""
            raise ConfigError(f"{owner}{err}") from None
    _check_backbone(cfg, adapter.base_model_name, card.backbone_types)
    _check_consolidation(cfg, adapter)
    _check_fgh_bound(cfg)
    _check_gradient_free(cfg, adapter)
    for spec in adapter.config_keys.values():  # the method's rules that read other keys
        if spec.cross_check is not None:
            try:
                spec.cross_check(cfg)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{cfg['model_name']}: {err}") from None
    _check_replay(cfg, raw, adapter)
    try:  # online_iter / realtime / online_accuracy together (core/realtime.py, engine/flops.py)
        check_realtime_config(cfg, adapter)
        check_flop_counts(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


#: Optimizers that divide each parameter's step by its gradient's running scale (m / sqrt(v)):
#: under them an FGH coefficient without an upper bound reweights classes but cannot multiply the
#: step size itself (docs/fgh.md, "Without an upper bound").
SCALE_FREE_OPTIMIZERS = ("adam", "adamw")


def _check_fgh_bound(cfg: dict[str, Any]) -> None:
    """FGH without an upper bound only where the optimizer normalises the gradient's scale: under
    SGD a growing coefficient multiplies the step itself."""
    if cfg.get("fgh") is None or validate_fgh_options(**cfg["fgh"])["clamp"][1] is not None:
        return
    fix = (
        'give the coefficient an upper bound, e.g. "clamp": [0.0, 10.0] (the '
        'FGH_FORMS["appendix_clamp10"] form)'
    )
    if cfg["optimizer"] not in SCALE_FREE_OPTIMIZERS:
        raise ConfigError(
            f"fgh.clamp has no upper bound ([lo, null]) and optimizer={cfg['optimizer']!r}: SGD "
            "does not normalise a growing coefficient, so the step grows with it without limit. "
            f"Use optimizer {' or '.join(SCALE_FREE_OPTIMIZERS)}, or {fix}"
        )


def _check_gradient_free(cfg: dict[str, Any], adapter: Any) -> None:
    """P's loss and FGH act on gradients: a method that takes no gradient step (``trains =
    False``: SimpleCIL's class means) refuses both, rather than run them to no effect."""
    if adapter.trains or not (cfg["online_prototypes"] or cfg["fgh"] is not None):
        return
    raise ConfigError(
        f"{cfg['model_name']} trains no parameter (it learns without gradients), so P's loss and "
        'FGH, which act on gradients, have nothing to act on: set "online_prototypes": false and '
        '"fgh": null'
    )


def _check_consolidation(cfg: dict[str, Any], adapter: Any) -> None:
    """Fill in the method's default trigger, and refuse a trigger the method would ignore."""
    from .adapter import MethodAdapter

    if cfg["consolidation"] is None:
        cfg["consolidation"] = adapter.consolidation.trigger
    if cfg["consolidation"] == "never" and adapter.consolidation.required:
        raise ConfigError(
            f'consolidation "never" {adapter.consolidation.required}: use a trigger (its default '
            f"{adapter.consolidation.trigger}), or er_online for replay alone"
        )
    if cfg["consolidation"] != "never" and adapter.consolidate is MethodAdapter.consolidate:
        raise ConfigError(
            f"consolidation={cfg['consolidation']!r}, but {cfg['model_name']} does nothing at a "
            'consolidation (it has no task-boundary step): remove the key or set it to "never"'
        )


def _check_replay(cfg: dict[str, Any], raw: Mapping[str, Any], adapter: Any) -> None:
    """Experience replay is on iff ``er_memory_size > 0``; only memory-based rows keep samples."""
    replay = cfg["er_memory_size"] > 0
    name = cfg["model_name"]
    if adapter.replay is not None and not replay:
        size = adapter.replay.memory_size
        raise ConfigError(
            f"{name} keeps a replay memory (replay = Replay()): er_memory_size must be > 0 (its "
            f"default is {size}); remove the key to use the default"
        )
    if replay and adapter.replay is None and not cfg["allow_memory"]:
        raise ConfigError(
            f"er_memory_size={cfg['er_memory_size']} turns on experience replay, but {name} is "
            "memory-free: it may not keep training samples. Use a memory-based row "
            '(er_online, er_linear_probe_online), set "er_memory_size": 0, or set '
            '"allow_memory": true to add replay deliberately'
        )
    # A resolved config (every key written out, as `pilot-online run` and sweep pass it on) holds
    # the defaults: only a changed value asks for replay that is off.
    schema = {**ONLINE_KEYS, **adapter.config_keys}
    for key in ("er_batch_size", "er_memory", "er_memory_per_class"):
        if not replay and raw.get(key, schema[key].default) != schema[key].default:
            raise ConfigError(
                f"{key} is set but experience replay is off (er_memory_size is 0): remove it, "
                "or set er_memory_size"
            )
    if cfg["er_memory"] == "reservoir" and cfg["er_memory_per_class"] is not None:
        raise ConfigError(
            "er_memory_per_class is a quota of the class-balanced memories, and er_memory is "
            '"reservoir": set er_memory to "class_balanced" or "herding", or remove it'
        )


def key_reference() -> str:
    """A plain-text table of every online and PILOT key (``pilot-online check-config --keys``)."""
    from .registry import get_method, list_methods, method_card

    lines = []
    sections = [("PILOT run keys", PILOT_KEYS, ()), ("online keys", ONLINE_KEYS, ())]
    sections += [
        (f"{m} keys", get_method(m).config_keys, method_card(m).backbone_types)
        for m in list_methods()
    ]
    for title, keys, backbones in sections:
        lines.append(f"# {title}")
        if backbones:
            lines.append(f"  {'backbone_type':<24} one of {', '.join(backbones)}")
        for key, spec in keys.items():
            forced = " (fixed online)" if spec.forced else ""
            choices = f": {' | '.join(map(str, spec.choices))}" if spec.choices else ""
            described = spec.check is not None and hasattr(spec.check, "description")
            valid = f" [{description_of(spec.check)}]" if described else ""
            lines.append(
                f"  {key:<24} default {json.dumps(spec.default):<18} "
                f"{spec.doc}{choices}{valid}{forced}"
            )
    return "\n".join(lines)


def reference_run_config(config: Mapping[str, Any], reference: str) -> dict[str, Any]:
    """The reference's run beside ``config``: the same PILOT and online keys (data, batch size,
    device, image size, optimiser, LR) with ``model_name`` the reference, its base variant, one
    step per batch, its own defaults for everything else (replay, trigger, backbone: the one of
    its backbones the run's backbone name starts with, else its first)."""
    from .registry import method_card

    accepted = method_card(reference).backbone_types
    own = ("er_memory_size", "er_batch_size", "er_memory", "er_memory_per_class", "consolidation")
    raw = {
        k: v
        for k, v in config.items()
        if (k in PILOT_KEYS or k in ONLINE_KEYS) and k not in own and k != "backbone_type"
    }
    backbone = str(config.get("backbone_type") or "")
    names = sorted(accepted, key=len, reverse=True)
    raw["backbone_type"] = next((n for n in names if backbone.startswith(n)), None) or (
        accepted[0] if accepted else backbone
    )
    raw.update(model_name=reference, online_prototypes=False, fgh=None, online_iter=1)
    resolved = resolve_config(timing_config(raw))
    resolved.update({k: config[k] for k in ("nb_classes", "nb_tasks") if k in config})
    return resolved
