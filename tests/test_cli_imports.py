"""The commands that only read configs answer without importing torch (issue 35: "a CLI that
answers at once"): ``--help``, ``--version``, ``methods`` and ``check-config``. Each runs in a
fresh interpreter whose import of torch fails, so any path that reaches torch fails the test.

Also: ``core/lazy.py``'s stand-ins become torch itself at first use, in every module that bound
them, so the training code runs on the real modules (and monkeypatching torch reaches it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Run ``pilot-online ARGS`` in a new interpreter that refuses to import torch.
TORCH_REFUSED = textwrap.dedent("""
    import importlib.abc, sys

    class RefuseTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "torch":
                raise ImportError("torch refused in this test: " + name)
            return None

    sys.meta_path.insert(0, RefuseTorch())
    from pilot_online.engine import registry
    from pilot_online.cli.main import main

    # The plugin's own code is held to it; a method from another package may import torch
    # (docs/porting.md), so installed entry points are not loaded here.
    registry._entry_points_loaded = True
    try:
        code = main(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code
    assert "torch" not in sys.modules, "torch was imported"
    sys.exit(code)
""")


def without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TORCH_REFUSED, *args], cwd=ROOT, capture_output=True, text=True
    )


def method_configs() -> list[str]:
    """One config per method (its smoke config), the mission config and a scale-model one."""
    smoke = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "exps").glob("smoke_*.json"))
    return [
        *smoke,
        "exps/coda_online_fgh.json",
        "exps/scale/fashion_mnist_blurry_coda_fgh_lr0.005.json",
    ]


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"], ["methods"], ["methods", "--keys"], ["methods", "coda"]],
    ids=" ".join,
)
def test_the_light_commands_import_no_torch(args):
    result = without_torch(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_check_config_imports_no_torch_for_any_method():
    configs = method_configs()
    assert len(configs) > 25  # every method's smoke config
    result = without_torch("check-config", *configs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok") >= len(configs)


def test_check_config_refuses_a_bad_config_without_torch(tmp_path):
    """A method's own check (L2P: top_k <= size) runs, and reports, with torch refused."""
    config = json.loads((ROOT / "exps" / "smoke_l2p_online.json").read_text())
    config.update(top_k=7, size=3)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    result = without_torch("check-config", str(bad))
    said = result.stdout + result.stderr
    assert result.returncode != 0
    assert "top_k=7 prompts cannot be selected from a pool of size=3" in said
    assert "torch refused" not in said


def test_the_refusal_catches_a_command_that_imports_torch():
    """The check above can fail: a command that builds a network must import torch."""
    script = TORCH_REFUSED.replace(
        "from pilot_online.cli.main import main",
        "import pilot_online.core.prototypes\nfrom pilot_online.cli.main import main",
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "--version"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0 and "torch refused in this test: torch" in result.stderr


def test_a_stand_in_becomes_torch_in_every_module_that_bound_it():
    script = textwrap.dedent("""
        import sys
        import pilot_online.core.masks as masks, pilot_online.engine.loop as loop
        from pilot_online.core import lazy
        assert "torch" not in sys.modules and isinstance(masks.torch, lazy.LazyModule)
        assert masks.torch.zeros(2).tolist() == [0.0, 0.0]   # first use: torch is imported
        import torch
        assert masks.torch is torch and loop.torch is torch and lazy.torch is torch
        assert isinstance(loop.nn, lazy.LazyModule)           # nn waits for its own first use
        loop.nn.Linear
        assert loop.nn is torch.nn and lazy.nn is torch.nn
        from pilot_online.core.lazy import torch as later     # a module imported afterwards
        assert later is torch
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_no_grad_runs_without_gradients_and_keeps_the_function_s_name():
    import torch

    from pilot_online.core.lazy import no_grad

    @no_grad
    def doubled(x: torch.Tensor) -> torch.Tensor:
        """Twice x."""
        return 2 * x

    x = torch.ones(3, requires_grad=True)
    assert not doubled(x).requires_grad and (2 * x).requires_grad
    assert doubled.__name__ == "doubled" and doubled.__doc__ == "Twice x."
