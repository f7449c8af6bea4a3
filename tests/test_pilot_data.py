"""Every PILOT dataset builds for the online methods, through PILOT's real loading code.

The tests write tiny datasets (3 classes, 8x8 JPEGs or 32x32 CIFAR pickles) in the layouts PILOT
5240714's ``utils/data.py`` reads, then build each one with PILOT's own ``DataManager`` (which
calls the patched ``_setup_data`` -> our ``prepare`` -> PILOT's own ``download_data``) in a
subprocess, in a patched copy of PILOT (its ``models``/``utils``/``backbone`` are top-level names).

Expected transforms are written by hand from reading upstream ``utils/data.py``: ``build_transform``
(224 px crops, no normalisation) for L2P/DualPrompt and for every method on the folder datasets;
``build_transform_coda_prompt`` only for ``coda_prompt`` on cifar224 and imagenetr; fixed class
transforms for cifar10, cifar100 and the imagenet variants.

Three things differ from a user's run, all only inside the test's subprocess or copy:

- CIFAR: torchvision checks every CIFAR file against the md5 of the real archive before use, so
  tiny files would be rejected (and a download attempted). The probe replaces the md5 values in
  torchvision's ``CIFAR10``/``CIFAR100`` file lists with the md5 of the tiny files, so the
  integrity check still runs, on the files the test wrote; everything else (``download=True``,
  pickle loading, PILOT's ``download_data``) is the real code.
- imagenet100/imagenet1000: upstream's ``download_data`` starts with ``assert 0, "You should specify
  the folder of your dataset"``; PILOT's README tells users to delete it and set the folder. The
  probe runs in a copy of the patched PILOT with exactly those two lines deleted (checked below),
  reading upstream's placeholder folders ``[DATA-PATH]/train`` and ``[DATA-PATH]/val``.
- The tiny datasets hold 3 classes, so the subprocesses tell ``prepare``'s completeness check
  (``EXPECTED_CLASSES``) to expect 3; the check itself is tested below on full-size class counts.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import PILOT_ROOT, TEST_VIT_DEPTH, offline_env, requires_pilot

from pilot_online.core.datasets import DATASETS, PILOT_DATASETS
from pilot_online.core.results import load_results
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.pilot.data import (
    EXPECTED_CLASSES,
    IncompleteDatasetError,
    check_dataset_folders,
    prepare,
)
from pilot_online.pilot.errors import DatasetUnavailableError

HERE = Path(__file__).resolve().parent
EXPS = HERE.parent / "exps"
CLASSES, TRAIN_PER_CLASS, TEST_PER_CLASS = 3, 2, 1

#: The folders each PILOT 5240714 ImageFolder dataset reads (its ``download_data``), train and test.
IMAGE_FOLDERS = {
    "cub": ("data/cub/train", "data/cub/test"),
    "imagenetr": ("data/imagenet-r/train", "data/imagenet-r/test"),
    "imageneta": ("data/imagenet-a/train", "data/imagenet-a/test"),
    "objectnet": ("data/objectnet/train", "data/objectnet/test"),
    "omnibenchmark": ("data/omnibenchmark/train", "data/omnibenchmark/test"),
    "vtab": ("data/vtab-cil/vtab/train", "data/vtab-cil/vtab/test"),
    "imagenet100": ("[DATA-PATH]/train", "[DATA-PATH]/val"),
    "imagenet1000": ("[DATA-PATH]/train", "[DATA-PATH]/val"),
}
#: The torchvision folder under ./data each CIFAR dataset reads.
CIFAR_FOLDERS = {
    "cifar10": "data/cifar-10-batches-py",
    "cifar100": "data/cifar-100-python",
    "cifar224": "data/cifar-100-python",
}
#: Online method -> the upstream method whose transforms it must get.
BASES = {"l2p_online": "l2p", "dualprompt_online": "dualprompt", "coda_online": "coda_prompt"}
USER_EDIT = '        assert 0, "You should specify the folder of your dataset"\n'

# Transforms as upstream utils/data.py constructs them, in torchvision's stored form
# (crop sizes become (h, w); ColorJitter(brightness=b) stores [1 - b, 1 + b]).
TO_TENSOR = ["ToTensor", {}]
FLIP = ["RandomHorizontalFlip", {"p": 0.5}]
JITTER = ["ColorJitter", {"brightness": [1 - 63 / 255, 1 + 63 / 255]}]
CROP_32 = ["RandomCrop", {"size": [32, 32], "padding": 4}]
CENTER_224 = ["CenterCrop", {"size": [224, 224]}]
ZERO_ONE = ["Normalize", {"mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}]
IMAGENET_NORM = ["Normalize", {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}]


def resized_crop(scale: tuple[float, float]) -> list:
    return [
        "RandomResizedCrop",
        {
            "size": [224, 224],
            "scale": list(scale),
            "ratio": [3 / 4, 4 / 3],
            "interpolation": "bilinear",
        },
    ]


def resize(size: int, interpolation: str = "bilinear") -> list:
    return ["Resize", {"size": size, "interpolation": interpolation}]


# build_transform(is_train, args): scale (0.05, 1); test Resize(256, interpolation=3) (bicubic).
VIT = {
    "train": [resized_crop((0.05, 1.0)), FLIP, TO_TENSOR],
    "test": [resize(256, "bicubic"), CENTER_224, TO_TENSOR],
    "common": [],
}
# build_transform_coda_prompt: default RandomResizedCrop(224); the test side depends on whether
# args["dataset"] starts with "imagenet".
CODA_TRAIN = [resized_crop((0.08, 1.0)), FLIP, TO_TENSOR, ZERO_ONE]
CODA_TEST_IMAGENET = [resize(256), CENTER_224, TO_TENSOR, ZERO_ONE]
CODA_TEST_OTHER = [resize(224), TO_TENSOR, ZERO_ONE]


def expected_transforms(dataset: str, base: str) -> dict[str, list]:
    """Upstream's train/test/common transforms for ``dataset`` under the model name ``base``."""
    if dataset == "cifar10":
        normalize = [
            "Normalize",
            {"mean": [0.4914, 0.4822, 0.4465], "std": [0.2023, 0.1994, 0.2010]},
        ]
        return {"train": [CROP_32, FLIP, JITTER], "test": [], "common": [TO_TENSOR, normalize]}
    if dataset == "cifar100":
        normalize = [
            "Normalize",
            {"mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761]},
        ]
        return {
            "train": [CROP_32, FLIP, JITTER, TO_TENSOR],
            "test": [TO_TENSOR],
            "common": [normalize],
        }
    if dataset in ("imagenet100", "imagenet1000"):
        train = [resized_crop((0.08, 1.0)), FLIP] + ([JITTER] if dataset == "imagenet1000" else [])
        return {
            "train": train,
            "test": [resize(256), CENTER_224],
            "common": [TO_TENSOR, IMAGENET_NORM],
        }
    if base == "coda_prompt" and dataset == "cifar224":
        return {"train": CODA_TRAIN, "test": CODA_TEST_OTHER, "common": []}
    if base == "coda_prompt" and dataset == "imagenetr":
        return {"train": CODA_TRAIN, "test": CODA_TEST_IMAGENET, "common": []}
    return VIT


def upstream_dataset_names() -> set[str]:
    """The names pristine PILOT's ``_get_idata`` handles, read from its source."""
    source = (Path(PILOT_ROOT) / "utils" / "data_manager.py").read_text()
    return set(re.findall(r'name == "(\w+)"', source))


# -- tiny data in PILOT's layouts ------------------------------------------------------------------


def write_image_folders(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for train_dir, test_dir in set(IMAGE_FOLDERS.values()):
        for folder, count in ((train_dir, TRAIN_PER_CLASS), (test_dir, TEST_PER_CLASS)):
            for label in range(CLASSES):
                class_dir = root / folder / f"class_{label}"
                class_dir.mkdir(parents=True, exist_ok=True)
                for i in range(count):
                    pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(class_dir / f"{i}.jpg")


def write_cifar(root: Path) -> None:
    """Pickles in torchvision's extracted-archive layouts: rows of 3072 uint8 values (CHW)."""
    rng = np.random.default_rng(1)

    def batch(per_class: int, label_key: str) -> dict:
        labels = np.repeat(np.arange(CLASSES), per_class).tolist()
        data = rng.integers(0, 256, size=(len(labels), 3 * 32 * 32), dtype=np.uint8)
        return {"data": data, label_key: labels}

    def dump(path: Path, obj: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(obj))

    cifar10 = root / CIFAR_FOLDERS["cifar10"]
    dump(cifar10 / "data_batch_1", batch(TRAIN_PER_CLASS, "labels"))
    for i in range(2, 6):  # torchvision reads five training batches; these are empty
        dump(cifar10 / f"data_batch_{i}", batch(0, "labels"))
    dump(cifar10 / "test_batch", batch(TEST_PER_CLASS, "labels"))
    dump(cifar10 / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    cifar100 = root / CIFAR_FOLDERS["cifar100"]
    dump(cifar100 / "train", batch(TRAIN_PER_CLASS, "fine_labels"))
    dump(cifar100 / "test", batch(TEST_PER_CLASS, "fine_labels"))
    dump(cifar100 / "meta", {"fine_label_names": [f"c{i}" for i in range(100)]})


# Runs in the tiny data's folder: builds every (dataset, model name) through PILOT's DataManager.
PROBE = r"""
import hashlib, json, sys
from pathlib import Path

spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["pilot"])
from torchvision.datasets import cifar

# The md5 of the tiny files replaces that of the real archives (see the module docstring).
for cls, folder in ((cifar.CIFAR10, "cifar-10-batches-py"), (cifar.CIFAR100, "cifar-100-python")):
    def md5(name, folder=folder):
        return hashlib.md5(Path("data", folder, name).read_bytes()).hexdigest()
    cls.train_list = [[name, md5(name)] for name, _ in cls.train_list]
    cls.test_list = [[name, md5(name)] for name, _ in cls.test_list]
    cls.meta = {**cls.meta, "md5": md5(cls.meta["filename"])}

import numpy as np
from pilot_online.pilot import data as online_data
from utils.data_manager import DataManager

online_data.EXPECTED_CLASSES.update(dict.fromkeys(online_data.EXPECTED_CLASSES, 3))  # tiny data

KEYS = ("size", "scale", "ratio", "interpolation", "padding", "p", "brightness", "mean", "std")

def plain(value):
    if hasattr(value, "value"):  # InterpolationMode
        return value.value
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value

def describe(transforms):
    return [[type(t).__name__, {k: plain(getattr(t, k)) for k in KEYS if hasattr(t, k)}]
            for t in transforms]

report = {}
for dataset, model_name in spec["cases"]:
    args = {"dataset": dataset, "model_name": model_name}
    dm = DataManager(dataset, True, 1993, 2, 1, args)
    classes = np.arange(dm.nb_classes)
    train = dm.get_dataset(classes, source="train", mode="train")
    test = dm.get_dataset(classes, source="test", mode="test")
    report[f"{dataset}/{model_name}"] = {
        "nb_classes": dm.nb_classes,
        "train_labels": sorted(np.asarray(dm._train_targets).tolist()),
        "test_labels": sorted(np.asarray(dm._test_targets).tolist()),
        "train_image": list(train[0][1].shape),
        "test_image": list(test[0][1].shape),
        "train": describe(dm._train_trsf),
        "test": describe(dm._test_trsf),
        "common": describe(dm._common_trsf),
    }
print("PROBE" + json.dumps(report))
"""

# Runs PILOT's main.py with probes: counts network builds; optionally shrinks images to 32 px.
DRIVER = r"""
import json, runpy, sys

pilot, config, report_path, shrink = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
sys.path.insert(0, pilot)
from torchvision import transforms
from pilot_online.pilot import data as online_data
from utils import data_manager, factory

online_data.EXPECTED_CLASSES.update(dict.fromkeys(online_data.EXPECTED_CLASSES, 3))  # tiny data

report = {"get_model_calls": 0}
get_model = factory.get_model

def counting_get_model(*args, **kwargs):
    report["get_model_calls"] += 1
    return get_model(*args, **kwargs)

factory.get_model = counting_get_model
if shrink:
    setup = data_manager.DataManager._setup_data

    def setup_then_shrink(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        self._common_trsf = [*self._common_trsf, transforms.Resize((32, 32), antialias=True)]

    data_manager.DataManager._setup_data = setup_then_shrink
sys.argv = ["main.py", "--config", config]
try:
    runpy.run_path(pilot + "/main.py", run_name="__main__")
finally:
    with open(report_path, "w") as handle:
        json.dump(report, handle)
"""


def run_python(
    code: str, argv: list[str], cwd: Path, tmp_path: Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=cwd,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def user_edited_pilot(pilot, tmp_path_factory) -> Path:
    """The patched PILOT copy with the edit PILOT's README asks for: no ``assert 0`` in ImageNet."""
    root = shutil.copytree(pilot, tmp_path_factory.mktemp("edited") / "LAMDA-PILOT")
    data_py = root / "utils" / "data.py"
    lines = data_py.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line != USER_EDIT]
    assert len(lines) - len(kept) == 2  # iImageNet1000 and iImageNet100, nothing else
    data_py.write_text("".join(kept))
    return root


@pytest.fixture(scope="module")
def probe_report(user_edited_pilot, tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("tiny-data")
    write_image_folders(workdir)
    write_cifar(workdir)
    cases = [(d, m) for d in sorted(PILOT_DATASETS) for pair in BASES.items() for m in pair]
    spec = json.dumps({"pilot": str(user_edited_pilot), "cases": cases})
    done = run_python(PROBE, [spec], workdir, workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.split("PROBE", 1)[1])


# -- tests -----------------------------------------------------------------------------------------


@requires_pilot
def test_every_upstream_dataset_is_known_and_covered():
    names = upstream_dataset_names()
    assert len(names) == 11  # PILOT 5240714: cifar10/100/224, imagenet100/1000/r/a, cub, ...
    assert set(PILOT_DATASETS) == names
    assert set(IMAGE_FOLDERS) | set(CIFAR_FOLDERS) == names
    assert not names & set(DATASETS)  # a plugin name never shadows a PILOT one


@requires_pilot
@pytest.mark.parametrize("online", sorted(BASES))
@pytest.mark.parametrize("dataset", sorted(set(IMAGE_FOLDERS) | set(CIFAR_FOLDERS)))
def test_dataset_builds_with_the_base_methods_transforms(probe_report, dataset, online):
    base = BASES[online]
    got, upstream = probe_report[f"{dataset}/{online}"], probe_report[f"{dataset}/{base}"]
    assert got["nb_classes"] == CLASSES
    assert got["train_labels"] == sorted(list(range(CLASSES)) * TRAIN_PER_CLASS)
    assert got["test_labels"] == sorted(list(range(CLASSES)) * TEST_PER_CLASS)
    side = 32 if dataset in ("cifar10", "cifar100") else 224
    assert got["train_image"] == got["test_image"] == [3, side, side]
    expected = expected_transforms(dataset, base)
    for kind in ("train", "test", "common"):
        assert got[kind] == expected[kind], kind
        assert upstream[kind] == expected[kind], f"upstream {base}: {kind}"  # the table is right


@requires_pilot
@pytest.mark.parametrize("dataset", ["cub", "imagenet100"])
def test_missing_data_stops_before_any_network(pilot, tmp_path, dataset):
    config = load_json(EXPS / "smoke_coda_online.json")
    config.update(dataset=dataset, results_dir=str(tmp_path / "results"))
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    report_path = tmp_path / "report.json"
    done = run_python(
        DRIVER, [str(pilot), str(config_path), str(report_path), "0"], tmp_path, tmp_path
    )
    assert done.returncode != 0
    # The message alone (issue 30): no traceback, no chained errors before it.
    assert f"pilot-online: dataset '{dataset}' could not be loaded" in done.stderr
    assert "Traceback" not in done.stderr
    train_dir, test_dir = IMAGE_FOLDERS[dataset]
    assert str(tmp_path / train_dir) in done.stderr and str(tmp_path / test_dir) in done.stderr
    if dataset == "cub":
        assert "README" in done.stderr  # where the data comes from
    else:  # upstream's assert: the user must edit utils/data.py
        assert "You should specify the folder of your dataset" in done.stderr
        assert "iImageNet100.download_data" in done.stderr
    assert json.loads(report_path.read_text())["get_model_calls"] == 0


@requires_pilot
def test_folder_dataset_runs_end_to_end_through_pilot_main(pilot, tmp_path):
    """CUB from image folders through PILOT's main.py with coda_online. The test backbone is built
    at 32 px (random weights), so the 224-px tensors of upstream's transforms are shrunk to 32 px
    after them (the driver appends one Resize); loading, PILOT's transforms and the run are real."""
    write_image_folders(tmp_path)
    config = load_json(EXPS / "smoke_coda_online.json")
    config.update(
        dataset="cub",
        init_cls=2,
        increment=1,
        batch_size=2,
        eval_batch_size=8,
        results_dir=str(tmp_path / "results"),
        online_prototypes=False,
        fgh=None,
        vit_depth=TEST_VIT_DEPTH,
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    report_path = tmp_path / "report.json"
    done = run_python(
        DRIVER, [str(pilot), str(config_path), str(report_path), "1"], tmp_path, tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(report_path.read_text())["get_model_calls"] == 1
    (results_path,) = (tmp_path / "results").glob("*.results.json")
    results = load_results(results_path)
    counters = results["counters"]
    # 3 classes x 2 images, tasks of 2 and 1 classes: 4 + 2 samples in batches of 2.
    assert counters["samples_seen"] == counters["stream_length"] == CLASSES * TRAIN_PER_CLASS
    assert counters["optimizer_steps"] == 3
    matrix = results["metrics"]["accuracy_matrix"]
    assert len(matrix) == 2 and matrix[0][0] is not None and matrix[1][1] is not None


# -- no PILOT needed -------------------------------------------------------------------------------


class MissingFolders:
    """An iData whose folders are missing, as PILOT's ImageFolder-based ones fail."""

    def download_data(self) -> None:
        raise FileNotFoundError("[Errno 2] No such file or directory")


@pytest.mark.parametrize("dataset", sorted(IMAGE_FOLDERS))
def test_missing_folder_message_names_both_absolute_folders(dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetUnavailableError) as raised:
        prepare(MissingFolders(), dataset, {"model_name": "coda_online"})
    for folder in IMAGE_FOLDERS[dataset]:
        assert str(tmp_path / folder) in str(raised.value)
    assert '"dataset": "synthetic"' in str(raised.value)


@pytest.mark.parametrize("dataset", sorted(CIFAR_FOLDERS))
def test_cifar_download_failure_says_where_to_put_the_archive(dataset, tmp_path, monkeypatch):
    class FailedDownload:
        def download_data(self) -> None:
            raise OSError("<urlopen error [Errno 111] Connection refused>")

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetUnavailableError) as raised:
        prepare(FailedDownload(), dataset, {})
    message = str(raised.value)
    assert str(tmp_path / CIFAR_FOLDERS[dataset]) in message
    assert "cs.toronto.edu" in message and "Connection refused" in message


@pytest.mark.parametrize(
    ("dataset", "suggestion"),
    [("cub200", "cub"), ("imagenet-r", "imagenetr"), ("Synthetic_smal", "synthetic_small")],
)
def test_check_config_rejects_unknown_datasets_with_the_valid_names(dataset, suggestion):
    config = {**load_json(EXPS / "smoke_coda_online.json"), "dataset": dataset}
    with pytest.raises(ConfigError) as raised:
        resolve_config(config)
    message = str(raised.value)
    assert f"unknown dataset {dataset!r} (did you mean {suggestion!r}?)" in message
    for name in ("cifar10", "cifar224", "vtab", "imagenet1000", "synthetic", "synthetic_tiny"):
        assert re.search(rf"\b{name}\b", message), name


@pytest.mark.parametrize("dataset", ["cub", "CUB", "imagenetr", "cifar224", "synthetic_tiny"])
def test_check_config_accepts_pilot_and_plugin_datasets(dataset):
    config = {**load_json(EXPS / "smoke_coda_online.json"), "dataset": dataset}
    assert resolve_config(config)["dataset"] == dataset


# -- a dataset folder that lacks classes -------------------------------------------------------
def write_class_folders(root: Path, folder: str, names: list[str]) -> None:
    """One 8x8 JPEG per class folder."""
    from PIL import Image

    for name in names:
        (root / folder / name).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (len(name), 0, 0)).save(root / folder / name / "0.jpg")


class FolderIData:
    """An ImageFolder iData reading CUB's folders, as PILOT's ``CUB.download_data`` does."""

    use_path = True

    def download_data(self) -> None:
        from torchvision.datasets import ImageFolder

        train, test = ImageFolder("./data/cub/train/"), ImageFolder("./data/cub/test/")
        self.train_data = np.array([path for path, _ in train.imgs])
        self.train_targets = np.array([label for _, label in train.imgs])
        self.test_data = np.array([path for path, _ in test.imgs])
        self.test_targets = np.array([label for _, label in test.imgs])


CUB_CLASSES = [f"{i:03d}.bird" for i in range(1, 201)]


def test_a_cub_folder_lacking_classes_is_refused_with_counts_and_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_class_folders(tmp_path, "data/cub/train", CUB_CLASSES[:3])
    write_class_folders(tmp_path, "data/cub/test", CUB_CLASSES[:3])
    with pytest.raises(IncompleteDatasetError) as raised:
        prepare(FolderIData(), "cub", {"model_name": "coda_online"})
    message = str(raised.value)
    assert isinstance(raised.value, DatasetUnavailableError)  # the CLI's data errors catch it
    assert f"{tmp_path / 'data/cub/train'} holds 3, {tmp_path / 'data/cub/test'} holds 3" in message
    assert "names 200" in message and "put all 200 classes in place" in message
    assert "README" in message  # where the data comes from


def test_a_complete_folder_passes_prepare(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(EXPECTED_CLASSES, "cub", 3)
    write_class_folders(tmp_path, "data/cub/train", CUB_CLASSES[:3])
    write_class_folders(tmp_path, "data/cub/test", CUB_CLASSES[:3])
    idata = FolderIData()
    prepare(idata, "cub", {})  # no base method named: PILOT's own transforms stay (no import)
    assert sorted(set(idata.train_targets.tolist())) == [0, 1, 2]
    assert check_dataset_folders({"dataset": "cub"}) == []


def test_check_dataset_folders_names_each_problem_and_its_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, test = tmp_path / "data/cub/train", tmp_path / "data/cub/test"
    problems = check_dataset_folders({"dataset": "cub"})
    assert [str(train) in p and "does not exist" in p and "Fix:" in p for p in problems] == [
        True,
        False,
    ]
    assert str(test) in problems[1] and "does not exist" in problems[1]
    write_class_folders(tmp_path, "data/cub/train", CUB_CLASSES[:150])
    write_class_folders(tmp_path, "data/cub/test", [*CUB_CLASSES[:149], "999.extra"])
    problems = check_dataset_folders({"dataset": "CUB"})
    assert len(problems) == 3, problems
    assert f"the training folder {train} holds 150 class folders" in problems[0]
    assert f"the test folder {test} holds 150 class folders" in problems[1]
    assert "names 200" in problems[0] and "put all 200 class folders there" in problems[0]
    assert "only in training: ['150.bird']" in problems[2]
    assert "only in test: ['999.extra']" in problems[2]
    # Nothing to check: torchvision downloads CIFAR; synthetic data is generated.
    assert check_dataset_folders({"dataset": "cifar224"}) == []
    assert check_dataset_folders({"dataset": "synthetic_tiny"}) == []


@requires_pilot
def test_pilot_data_manager_refuses_a_folder_lacking_classes(pilot_on_path, tmp_path, monkeypatch):
    """Through PILOT's own DataManager (which PILOT's trainer builds before any network)."""
    from utils.data_manager import DataManager

    monkeypatch.chdir(tmp_path)
    write_class_folders(tmp_path, "data/cub/train", CUB_CLASSES[:4])
    write_class_folders(tmp_path, "data/cub/test", CUB_CLASSES[:4])
    with pytest.raises(IncompleteDatasetError, match=r"holds 4 .* names 200"):
        DataManager("cub", True, 1993, 2, 1, {"dataset": "cub", "model_name": "coda_online"})


def test_imagenet_class_counts_are_checked_from_the_loaded_labels(tmp_path, monkeypatch):
    """imagenet100's folders are the user's (set in PILOT's utils/data.py), so only the loaded
    labels are checked; upstream's class_order for it lists 1000, the dataset has 100."""
    monkeypatch.chdir(tmp_path)

    class Loaded:
        use_path = True

        def __init__(self, classes: int) -> None:
            self.classes = classes

        def download_data(self) -> None:
            self.train_data = self.test_data = np.array(["x.jpg"] * self.classes)
            self.train_targets = self.test_targets = np.arange(self.classes)

    prepare(Loaded(100), "imagenet100", {})  # complete: no folder check of [DATA-PATH]
    with pytest.raises(IncompleteDatasetError) as raised:
        prepare(Loaded(99), "imagenet100", {})
    message = str(raised.value)
    assert "the training data holds 99, the test data 99 classes" in message
    assert "names 100" in message and "utils/data.py" in message
    assert check_dataset_folders({"dataset": "imagenet100"}) == []
