"""``pilot-online doctor``: each failing item with its fix, exit code 1; items that hold pass.

Without PILOT: a CUB config whose dataset folder and ``pretrained_path`` are missing prints both
failures with their fixes and exits 1; a CUB config with complete class folders and a readable
weights file passes the config, weights, dataset and data-path items (the data path timed on its
own files). With PILOT (a patched copy): a synthetic CPU config passes every item, exit code 0.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from conftest import requires_pilot

from pilot_online.cli.doctor import FAIL, OK, run_checks
from pilot_online.cli.main import main

REPO = Path(__file__).resolve().parent.parent


def write_config(folder: Path, **overrides) -> Path:
    raw = json.loads((REPO / "exps" / "smoke_coda_online.json").read_text())
    raw.update(overrides)
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return path


def by_name(checks) -> dict[str, list]:
    out: dict[str, list] = {}
    for check in checks:
        out.setdefault(check.name, []).append(check)
    return out


def test_missing_dataset_and_weights_fail_with_their_fixes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # PILOT reads data/cub/... from the working directory
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    weights = tmp_path / "nowhere" / "vit.pth"
    config = write_config(
        tmp_path, dataset="cub", pretrained=True, pretrained_path=str(weights), device=[-1]
    )
    code = main(["doctor", "--config", str(config), "--no-data-path"])
    out = capsys.readouterr().out
    assert code == 1
    lines = out.splitlines()
    weights_line = next(i for i, line in enumerate(lines) if line.startswith("[FAIL] weights"))
    assert f"pretrained_path {weights} is not a file" in lines[weights_line]
    assert lines[weights_line + 1].startswith("       fix: point pretrained_path at")
    train = tmp_path / "data" / "cub" / "train"
    dataset_line = next(i for i, line in enumerate(lines) if line.startswith("[FAIL] dataset"))
    assert f"the training folder {train} does not exist" in lines[dataset_line]
    assert lines[dataset_line + 1].startswith("       fix: run from the folder that holds data/")
    assert "[ ok ] config:" in out  # the missing weights file is the weights item's, not config's
    assert out.splitlines()[-1].startswith("doctor: ") and "weights" in out.splitlines()[-1]


def test_a_class_folder_short_is_named_with_the_counts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    for split in ("train", "test"):
        for c in range(199 if split == "train" else 200):
            (tmp_path / "data" / "cub" / split / f"{c:03d}.bird").mkdir(parents=True)
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    checks = by_name(run_checks(config, None, data_path=False))
    details = " ".join(c.detail for c in checks["dataset"] if c.status == FAIL)
    assert "holds 199 class folders" in details and "names 200" in details


def jpeg_bytes(rng: np.random.Generator) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_a_machine_with_the_files_passes_those_items(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    rng = np.random.default_rng(0)
    image = jpeg_bytes(rng)
    for split in ("train", "test"):
        for c in range(200):
            folder = tmp_path / "data" / "cub" / split / f"{c:03d}.bird"
            folder.mkdir(parents=True)
            (folder / "0.jpg").write_bytes(image)
    weights = tmp_path / "vit.pth"
    names = ("patch_embed.proj.weight", "cls_token", "blocks.11.mlp.fc2.weight")
    torch.save({name: torch.zeros(2) for name in names}, weights)
    config = write_config(
        tmp_path, dataset="cub", pretrained=True, pretrained_path=str(weights), device=[-1]
    )
    checks = by_name(run_checks(config, None, data_path=True))
    for name in ("config", "weights", "dataset", "data path", "disk", "cuda", "compute"):
        assert [c.status for c in checks[name]] == [OK], (name, checks[name])
    assert "data/cub/train" in checks["dataset"][0].detail
    data_path = checks["data path"][0].detail
    assert (
        "img/s per worker" in data_path and f"files of {tmp_path / 'data/cub/train'}" in data_path
    )


def test_weights_without_vit_keys_fail_naming_them(tmp_path):
    """A safetensors file is judged by its header alone: here one of Hugging Face transformers'
    ViT (other names) instead of timm's."""
    header = {"vit.embeddings.cls_token": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    encoded = json.dumps(header).encode()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"\0" * 4)
    config = write_config(tmp_path, pretrained=True, device=[-1])
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "pretrained_path": str(weights)}))
    (check,) = by_name(run_checks(config, None, data_path=False))["weights"]
    assert check.status == FAIL
    assert "lacks patch_embed.proj.weight, cls_token, blocks.11.mlp.fc2.weight" in check.detail


def test_suffixes_the_weights_loader_cannot_read_fail(tmp_path):
    weights = tmp_path / "vit.ckpt"
    weights.write_bytes(b"\0" * 16)
    config = write_config(tmp_path, pretrained=True, device=[-1])
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "pretrained_path": str(weights)}))
    (weights_check,) = by_name(run_checks(config, None, data_path=False))["weights"]
    assert weights_check.status == FAIL and "'.ckpt'" in weights_check.detail


@requires_pilot
def test_a_synthetic_cpu_run_passes_every_item(pilot, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    config = write_config(tmp_path, results_dir=str(tmp_path / "results"))
    code = main(["doctor", "--config", str(config), "--pilot-root", str(pilot)])
    out = capsys.readouterr().out
    assert "[FAIL]" not in out, out
    for item in ("config", "pilot", "weights", "dataset", "host memory", "disk", "data path"):
        assert f"[ ok ] {item}:" in out, item
    assert code == 0 and out.splitlines()[-1] == "doctor: this machine can run it"


def test_doctor_without_a_config_checks_the_machine(capsys):
    code = main(["doctor", "--no-data-path", "--pilot-root", "/nonexistent/pilot"])
    out = capsys.readouterr().out
    assert "[ ok ] config: none given" in out and "[ ok ] torch:" in out
    assert "[FAIL] pilot:" in out and code == 1


def test_bf16_on_a_cpu_run_is_not_a_cuda_failure(tmp_path):
    config = write_config(tmp_path, amp="bf16", device=[-1])
    checks = by_name(run_checks(config, None, data_path=False))
    assert checks["cuda"][0].status == OK


def class_folders(root: Path, count: int = 200) -> None:
    for split in ("train", "test"):
        for c in range(count):
            (root / "data" / "cub" / split / f"{c:03d}.bird").mkdir(parents=True)


def test_the_folders_are_those_of_the_working_directory_whatever_the_pilot_root(
    tmp_path, monkeypatch
):
    """One rule for every entry point: PILOT reads ./data where the run starts (python main.py
    and pilot-online run alike; --pilot-root only says where PILOT's code is), so doctor checks
    the folders of the directory it runs in, with or without --pilot-root (it used to check the
    checkout's data/, which `pilot-online run --pilot-root` started here never reads)."""
    here, pilot = tmp_path / "plugin", tmp_path / "pilot"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    class_folders(pilot)  # the checkout's data/: not what a run started here reads
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    dataset = by_name(run_checks(config, str(pilot), data_path=False))["dataset"]
    assert [c.status for c in dataset] == [FAIL, FAIL]
    assert f"the training folder {here / 'data/cub/train'} does not exist" in dataset[0].detail
    assert dataset[0].fix.startswith("run from the folder that holds data/")
    class_folders(here)
    monkeypatch.setenv("PILOT_ROOT", str(pilot))
    (ok,) = by_name(run_checks(config, None, data_path=False))["dataset"]
    assert ok.status == OK
    assert ok.detail.startswith(f"{here / 'data/cub/train'}, {here / 'data/cub/test'} in place")


def test_the_run_reads_the_folder_doctor_checks(tmp_path, monkeypatch):
    """prepare (what main.py and pilot-online run reach) names the folder doctor names."""
    from pilot_online.pilot.data import DatasetUnavailableError, prepare

    class MissingFolders:
        def download_data(self) -> None:
            raise FileNotFoundError("no such folder")

    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    (check, _) = by_name(run_checks(config, str(tmp_path / "pilot"), data_path=False))["dataset"]
    folder = str(tmp_path / "data" / "cub" / "train")
    assert folder in check.detail
    try:
        prepare(MissingFolders(), "cub", {})
    except DatasetUnavailableError as err:
        assert folder in str(err)
    else:
        raise AssertionError("prepare accepted a missing dataset")


def test_without_a_pilot_root_the_item_says_where_the_run_must_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    class_folders(tmp_path)
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    (dataset,) = by_name(run_checks(config, None, data_path=False))["dataset"]
    assert dataset.status == OK
    assert f"relative to {tmp_path}, so the run must start from this directory" in dataset.detail


def test_a_missing_cifar_folder_fails_when_it_cannot_be_downloaded(tmp_path, monkeypatch):
    """Offline, a CIFAR folder that is not in place fails (it used to be a warning, and the run
    then failed seconds in); with its host reachable it is a warning (the run downloads it)."""
    from pilot_online.cli import doctor

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    config = write_config(tmp_path, dataset="cifar224", pretrained=False, device=[-1])
    folder = tmp_path / "data" / "cifar-100-python"
    monkeypatch.setattr(doctor, "_host_answers", lambda url, timeout=5.0: False)
    (dataset,) = by_name(run_checks(config, str(tmp_path / "pilot"), data_path=False))["dataset"]
    assert dataset.status == FAIL
    assert dataset.detail.startswith(f"{folder} does not exist and {doctor.CIFAR_HOST} cannot")
    assert dataset.fix == f"offline, extract cifar-100-python.tar.gz into {tmp_path / 'data'}"
    monkeypatch.setattr(doctor, "_host_answers", lambda url, timeout=5.0: True)
    (dataset,) = by_name(run_checks(config, None, data_path=False))["dataset"]
    assert dataset.status == "warn"
    assert dataset.detail == (
        f"{folder} does not exist: torchvision downloads it (download=True) from "
        "https://www.cs.toronto.edu/~kriz/cifar.html, when the run starts"
    )
    folder.mkdir(parents=True)
    (dataset,) = by_name(run_checks(config, None, data_path=False))["dataset"]
    assert dataset.status == OK
