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
import pytest
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


def test_with_a_pilot_root_doctor_checks_its_data_folder_and_says_so(tmp_path, monkeypatch):
    """python main.py reads data/ in the PILOT checkout it runs in: with --pilot-root, doctor
    checks the checkout's data/ (it used to check the current folder's whatever the root), and
    each line names the folder it checked; without it, the current folder's."""
    here, pilot = tmp_path / "plugin", tmp_path / "pilot"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    class_folders(pilot)
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    (ok,) = by_name(run_checks(config, str(pilot), data_path=False))["dataset"]
    assert ok.status == OK
    assert ok.detail.startswith(f"{pilot / 'data/cub/train'}, {pilot / 'data/cub/test'} in place")
    assert f"(checked {pilot}: --pilot-root, where python main.py runs;" in ok.detail
    dataset = by_name(run_checks(config, None, data_path=False))["dataset"]
    assert [c.status for c in dataset] == [FAIL, FAIL]
    assert f"the training folder {here / 'data/cub/train'} does not exist" in dataset[0].detail
    assert f"(checked {here}: the current folder; give --pilot-root" in dataset[0].detail
    assert dataset[0].fix.startswith("run from the folder that holds data/")


def test_the_run_reads_the_folder_doctor_checks(tmp_path, monkeypatch):
    """prepare (what main.py and pilot-online run reach) names the folder doctor names."""
    from pilot_online.pilot.data import prepare
    from pilot_online.pilot.errors import DatasetUnavailableError

    class MissingFolders:
        def download_data(self) -> None:
            raise FileNotFoundError("no such folder")

    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, dataset="cub", pretrained=False, device=[-1])
    (check, _) = by_name(run_checks(config, None, data_path=False))["dataset"]
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
    assert f"(checked {tmp_path}: the current folder; give --pilot-root to check" in dataset.detail


def test_a_missing_cifar_folder_fails_when_it_cannot_be_downloaded(tmp_path, monkeypatch):
    """Offline, a CIFAR folder that is not in place fails (it used to be a warning, and the run
    then failed seconds in); with its host reachable it is a warning (the run downloads it)."""
    from pilot_online.cli import doctor

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    config = write_config(tmp_path, dataset="cifar224", pretrained=False, device=[-1])
    folder = tmp_path / "data" / "cifar-100-python"
    monkeypatch.setattr(doctor, "_host_answers", lambda url, timeout=5.0: False)
    (dataset,) = by_name(run_checks(config, None, data_path=False))["dataset"]
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


def test_the_data_rate_is_judged_against_the_run(tmp_path, monkeypatch):
    """A GPU config's measured data rate against the images/s the run trains on at the
    calibrated estimate's pace: ok at 1x or more, warn below, fail below 0.5x (24 img/s used to
    be [ ok ] whatever the run)."""
    from pilot_online.cli import doctor
    from pilot_online.engine.flops import method_flops
    from pilot_online.harness.estimate import calibration

    monkeypatch.chdir(tmp_path)
    config = write_config(
        tmp_path,
        dataset="cifar224",
        model_name="finetune_online",
        device=["0"],
        num_workers=1,
        backbone_kwargs={},  # 224 px, the FLOP table's size
        online_prototypes=False,
        fgh=None,
    )
    cfg = json.loads(config.read_text())
    # By hand: finetune's FLOPs per stream image are the same at every task (it never grows), so
    # the run trains on calibrated TFLOP/s / (FLOPs per image) images a second.
    need = calibration().tflops * 1e12 / method_flops("finetune_online")["train_flops_per_image"]
    assert doctor.run_data_rate(cfg) == pytest.approx(need, rel=1e-6)
    for rate, status in ((1.2 * need, OK), (0.7 * need, "warn"), (0.3 * need, FAIL)):
        monkeypatch.setattr(doctor, "measure_transform_rate", lambda t, s, r=rate: r)
        (check,) = by_name(run_checks(config, None, data_path=True))["data path"]
        assert check.status == status, (rate / need, check)
        assert f"{rate / need:.2g}x the {need:.0f} img/s the run trains on" in check.detail
        assert check.fix.startswith('the GPU will wait on data: raise "num_workers"')


def test_doctor_leads_with_the_calibrated_estimate(tmp_path):
    """One planning figure first (calibrated), the ideal one after it, as a floor."""
    from pilot_online.cli.doctor import check_compute
    from pilot_online.harness.estimate import estimate_config

    cfg = json.loads(write_config(tmp_path, dataset="cub", device=["0"]).read_text())
    estimate = estimate_config(cfg)
    (check,) = check_compute(cfg)
    first, *rest = check.detail.split("\n")
    assert "ideal" not in first and "calibrated to the paper's measured times" in first
    (floor,) = [line.strip() for line in rest if "ideal" in line]
    assert floor.startswith("floor: ideal ") and "no run is faster" in floor
    assert estimate.calibrated_seconds > 10 * estimate.ideal_seconds
