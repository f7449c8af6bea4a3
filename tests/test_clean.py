"""``pilot-online clean``: lists the checkpoints interrupted runs left, deletes only them, and
``--dry-run`` deletes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pilot_online.cli.main import main


def a_run_folder(root: Path) -> dict[str, Path]:
    """Two interrupted runs' checkpoints (one deep), a killed writer's temporary, and what
    clean must never touch: results, logs, a file that only looks like a checkpoint."""
    deep = root / "logs" / "coda" / "fashion_mnist"
    deep.mkdir(parents=True)
    files = {
        "ckpt": root / "a.ckpt.pt",
        "deep_ckpt": deep / "b.ckpt.pt",
        "tmp": deep / ".b.ckpt.pt.k3j2.tmp",
        "results": deep / "b.results.json",
        "log": deep / "b.log",
        "impostor": root / "notes.ckpt.pt",
        "model": root / "model.pt",
    }
    torch.save({"state": torch.zeros(1000)}, files["ckpt"])
    torch.save({"state": torch.zeros(10)}, files["deep_ckpt"])
    torch.save({"model": torch.zeros(10)}, files["model"])
    files["tmp"].write_bytes(b"half a checkpoint")
    files["results"].write_text("{}")
    files["log"].write_text("log")
    files["impostor"].write_text("not a torch archive")
    return files


def test_dry_run_lists_the_checkpoints_and_deletes_nothing(tmp_path, capsys):
    files = a_run_folder(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["clean", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = sorted(line.rsplit("  ", 1)[1] for line in out[:-1])
    assert listed == sorted(str(files[k].resolve()) for k in ("ckpt", "deep_ckpt", "tmp"))
    size = files["ckpt"].stat().st_size + files["deep_ckpt"].stat().st_size + 17
    assert out[-1].startswith("would delete 3 checkpoints (")
    assert out[-1].endswith("); nothing deleted (--dry-run)")
    assert size > 4000  # the 1000 floats: the total is in kB
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_clean_deletes_only_checkpoints(tmp_path, capsys):
    files = a_run_folder(tmp_path)
    assert main(["clean", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("deleted 3 checkpoints (")
    gone = {"ckpt", "deep_ckpt", "tmp"}
    for key, path in files.items():
        assert path.exists() == (key not in gone), key


def test_clean_one_file_and_refuse_what_is_not_a_checkpoint(tmp_path, capsys):
    files = a_run_folder(tmp_path)
    assert main(["clean", str(files["deep_ckpt"])]) == 0
    assert "deleted 1 checkpoint (" in capsys.readouterr().out
    assert not files["deep_ckpt"].exists() and files["ckpt"].exists()
    assert main(["clean", str(files["results"])]) == 2
    err = capsys.readouterr().err
    assert "is not a pilot-online checkpoint (*.ckpt.pt): clean deletes checkpoints only" in err
    assert files["results"].exists()


def test_clean_with_nothing_to_delete_says_so(tmp_path, capsys):
    assert main(["clean", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"no checkpoints found under {tmp_path}"


@pytest.mark.parametrize("missing", ["nowhere"])
def test_clean_of_a_missing_path_names_it(tmp_path, capsys, missing):
    assert main(["clean", str(tmp_path / missing)]) == 2
    assert f"{tmp_path / missing} does not exist" in capsys.readouterr().err
