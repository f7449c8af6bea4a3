"""A researcher's second day, the CLI's papercuts (issue 36): every argument of ``check-config``
and ``demo`` says what it is, ``reproduce --dry-run`` writes nothing, counts read as English,
every method has a paper name, a malformed config is one line with its line and column (through
``check-config``, ``run`` and PILOT's patched ``main.py``), and timm's torch.jit FutureWarning is
gone while every other warning stays.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import offline_env, requires_pilot

from pilot_online.cli.main import main
from pilot_online.cli.methods import HEADER
from pilot_online.core.progress import plural
from pilot_online.engine.registry import list_methods, method_card

REPO = Path(__file__).resolve().parent.parent
EXPS = REPO / "exps"

#: A config with a missing comma: line 3, column 5 is where ``json`` stops.
MALFORMED = '{\n    "model_name": "l2p_online"\n    "seed": [1993]\n}\n'
MALFORMED_REASON = "not valid JSON at line 3, column 5: Expecting ',' delimiter"


def arguments_without_help(help_text: str) -> list[str]:
    """The arguments a ``--help`` lists with nothing said about them: an entry (two spaces, then
    the argument) with no text after it on its line and no indented text on the next."""
    lines = help_text.splitlines()
    missing, in_arguments = [], False
    for index, line in enumerate(lines):
        if line and not line.startswith(" "):  # a section title: "options:", "usage: ..."
            in_arguments = line.endswith(":") and not line.startswith("usage:")
            continue
        if not in_arguments or not re.match(r"  \S", line):
            continue
        said_inline = re.search(r"\S {2,}\S", line[2:])
        below = lines[index + 1] if index + 1 < len(lines) else ""
        if not (said_inline or re.match(r" {3,}\S", below)):
            missing.append(line.strip())
    return missing


def help_of(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_help_parser_finds_an_argument_without_help():
    text = "usage: x [-h] [--seed SEED]\n\noptions:\n  -h, --help   show this\n  --seed SEED\n"
    assert arguments_without_help(text) == ["--seed SEED"]


@pytest.mark.parametrize("command", ["check-config", "demo"])
def test_every_argument_of_check_config_and_demo_has_help(command, capsys, monkeypatch):
    text = help_of(command, capsys, monkeypatch)
    assert "options:" in text and arguments_without_help(text) == [], text


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
    }


def test_reproduce_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """Neither the default ``--out`` (``runs/reproduce`` under the working folder) nor a given
    one is created, and the configs it reads are left as they were."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a folder with something in it\n")
    before, exps_before = tree(tmp_path), tree(EXPS)
    argv = ["reproduce", "cub/clear/coda/ours/5e-3", "--exps", str(EXPS), "--dry-run"]
    assert main(argv) == 0
    assert main([*argv, "--out", "elsewhere/out"]) == 0
    assert tree(tmp_path) == before
    assert not (tmp_path / "runs").exists() and not (tmp_path / "elsewhere").exists()
    assert tree(EXPS) == exps_before
    first = capsys.readouterr().out.splitlines()[0]
    out = tmp_path.resolve() / "runs" / "reproduce" / "configs"
    assert first == (
        "reproduce: 1 cell, 10 runs (one per seed); nothing written (a run writes its configs "
        f"to {out})"
    )


def test_counts_read_as_english():
    assert plural(1, "cell") == "1 cell" and plural(2, "cell") == "2 cells"
    assert plural(0, "run") == "0 runs" and plural(1, "batch", "batches") == "1 batch"
    assert plural(3, "batch", "batches") == "3 batches"
    assert plural(1.0, "GPU") == "1 GPU" and plural(0.5, "GPU") == "0.5 GPUs"


def test_the_vs_paper_summary_counts_one_cell_as_one(tmp_path):
    from test_tables import write_run

    from pilot_online.harness import reproduce

    cell = reproduce.parse_cell("cifar224/si_blurry/coda/ours/5e-5")
    write_run(tmp_path / "results", dataset="synthetic_tiny", stream="si_blurry", lr=5e-5,
              row="ours", seed=0, ap=44.0, prefix=f"{cell.name}__seed-0")  # fmt: skip
    assert "Summary (1 cell): " in reproduce.vs_paper_for([cell], tmp_path, {})


def test_every_registered_method_has_a_paper_name(capsys):
    """From the methods' own cards (no table in the CLI), APER and SimpleCIL included;
    oLoRA shows the name its paper and the README give it too."""
    assert main(["methods"]) == 0
    header, rule, *rows = capsys.readouterr().out.splitlines()
    (name_start, name_end), (start, end) = [m.span() for m in re.finditer(r"-+", rule)][:2]
    assert header[start:end].strip() == HEADER[1] == "paper name"
    names = {row[name_start:name_end].strip(): row[start:end].strip() for row in rows}
    for name in list_methods():
        assert names.get(name, "-") not in ("", "-"), name
        assert method_card(name).paper_name in names[name], name
    assert names["olora_online"] == "oLoRA (Online-LoRA)"
    assert names["simplecil_online"] == "SimpleCIL"
    assert names["aper_adapter_online"] == "APER w/ Adapter"


def test_check_config_gives_the_line_and_column_of_malformed_json(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(MALFORMED)
    assert main(["check-config", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == f"invalid {bad}: {MALFORMED_REASON}\n"
    assert "Traceback" not in captured.err


@requires_pilot
def test_run_gives_the_line_and_column_of_malformed_json(pilot, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PILOT_ONLINE_TRACEBACK", raising=False)
    bad = tmp_path / "x.json"
    bad.write_text(MALFORMED)
    assert main(["run", "--config", str(bad), "--pilot-root", str(pilot)]) == 2
    assert capsys.readouterr().err == f"pilot-online run: {bad}: {MALFORMED_REASON}\n"


@requires_pilot
def test_pilot_main_py_gives_the_line_and_column_of_malformed_json(pilot, tmp_path):
    """PILOT's own ``main.py``, patched, as a user runs it: one line, exit 1, no traceback."""
    (tmp_path / "x.json").write_text(MALFORMED)
    env = {
        key: value
        for key, value in offline_env(tmp_path).items()
        if key != "PILOT_ONLINE_TRACEBACK"
    }
    done = subprocess.run(
        [sys.executable, str(pilot / "main.py"), "--config", "x.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == f"pilot-online: x.json: {MALFORMED_REASON}\n"


def stderr_of(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


#: After the imports under test: timm, then a FutureWarning of someone else's, which must show.
TIMM_THEN_ANOTHER_WARNING = """
import timm
import warnings
warnings.warn("another FutureWarning", FutureWarning)
"""


def test_importing_the_plugin_silences_timms_torch_jit_warning_and_no_other():
    """The entry point's import filters exactly that warning, before anything imports timm."""
    code = (
        "import sys\nimport pilot_online.cli.main\n"
        "assert 'timm' not in sys.modules, 'the plugin imported timm before its filter'\n"
        + TIMM_THEN_ANOTHER_WARNING
    )
    said = stderr_of(code)
    assert "torch.jit.script" not in said
    assert "FutureWarning: another FutureWarning" in said


@requires_pilot
def test_pilot_main_py_imports_silence_timms_torch_jit_warning(pilot, tmp_path):
    """The patched ``main.py``'s own imports (everything above ``def main``) come first."""
    imports = (pilot / "main.py").read_text().split("def main")[0]
    code = f"import sys\nsys.path.insert(0, {str(pilot)!r})\n{imports}{TIMM_THEN_ANOTHER_WARNING}"
    said = stderr_of(code, env=offline_env(tmp_path), cwd=tmp_path)
    assert "torch.jit.script" not in said
    assert "FutureWarning: another FutureWarning" in said


@pytest.mark.parametrize("command", ["report", "tables", "figures", "best"])
def test_a_results_path_that_names_nothing_ends_in_one_line(command, tmp_path, capsys):
    """A mistyped results folder is a user error: its line alone and exit status 2, before any
    table or figure is made (it was a traceback)."""
    missing = tmp_path / "runs" / "smoke_matrx"
    extra = {"tables": ["--out", str(tmp_path / "t")], "figures": ["--out", str(tmp_path / "f")]}
    assert main([command, str(missing), *extra.get(command, [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pilot-online {command}: {missing} does not exist: give results files")
    assert err.count("\n") == 1
