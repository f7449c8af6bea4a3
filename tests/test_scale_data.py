"""The scale model's data: Fashion-MNIST's IDX reader and the formula-driven classes.

The IDX reader is checked against bytes written here by hand and against Fashion-MNIST's
documented counts (Xiao et al., 2017: 60,000 training and 10,000 test images of 28x28, 6,000 and
1,000 per class), read from Debian's ``dataset-fashion-mnist`` package that ``.ci/run`` installs.
"""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from pilot_online.core import fashion_mnist, fractals
from pilot_online.core.datasets import (
    SCALE_DATASETS,
    dataset_names,
    fashion_mnist_benchmark,
    load_scale_dataset,
)


def write_idx(path, magic: int, array: np.ndarray, compress: bool = True) -> None:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(path, "wb") as handle:
            handle.write(raw)
    else:
        path.write_bytes(raw)


def test_idx_reader_against_hand_written_bytes(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a-idx3-ubyte.gz", 0x803, images)
    write_idx(tmp_path / "b-idx1-ubyte", 0x801, np.array([7, 9]), compress=False)
    assert np.array_equal(fashion_mnist.read_idx(tmp_path / "a-idx3-ubyte.gz", "images"), images)
    assert fashion_mnist.read_idx(tmp_path / "b-idx1-ubyte", "labels").tolist() == [7, 9]
    with pytest.raises(fashion_mnist.IdxError, match="magic number 0x00000801"):
        fashion_mnist.read_idx(tmp_path / "b-idx1-ubyte", "images")
    (tmp_path / "short").write_bytes((tmp_path / "b-idx1-ubyte").read_bytes()[:-1])
    with pytest.raises(fashion_mnist.IdxError, match="1 data bytes, the header promises 2"):
        fashion_mnist.read_idx(tmp_path / "short", "labels")


def test_a_missing_dataset_names_the_folders_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "DEBIAN_FOLDER", tmp_path / "nowhere")
    monkeypatch.delenv("PILOT_ONLINE_FASHION_MNIST", raising=False)
    with pytest.raises(FileNotFoundError) as caught:
        fashion_mnist.find_folder(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "data" / "fashion-mnist") in message
    assert "apt-get install dataset-fashion-mnist" in message


def test_the_data_folder_and_torchvision_layout_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "DEBIAN_FOLDER", tmp_path / "nowhere")
    monkeypatch.delenv("PILOT_ONLINE_FASHION_MNIST", raising=False)
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for (_, kind), name in fashion_mnist.FILES.items():
        array = np.zeros((1, 28, 28)) if kind == "images" else np.zeros(1)
        write_idx(raw / name, 0x803 if kind == "images" else 0x801, array, compress=False)
    assert fashion_mnist.find_folder(tmp_path) == raw


def test_fashion_mnist_has_its_documented_counts():
    data = fashion_mnist.load()
    assert data["train_x"].shape == (60_000, 28, 28) and data["train_x"].dtype == np.uint8
    assert data["test_x"].shape == (10_000, 28, 28)
    assert np.bincount(data["train_y"]).tolist() == [6_000] * 10
    assert np.bincount(data["test_y"]).tolist() == [1_000] * 10
    # The benchmark streams the second half only, which pretraining never reads.
    bench = fashion_mnist_benchmark(3, 2, 32)
    assert bench["train_x"].shape == (30, 32, 32, 3) and bench["test_x"].shape == (20, 32, 32, 3)
    half = data["train_y"][fashion_mnist.STREAM_HALF]
    first = np.flatnonzero(half == 0)[0]
    resized = fashion_mnist.resize(data["train_x"][30_000 + first][None], 32)
    assert np.array_equal(bench["train_x"][0], resized[0])


def test_resize_is_bilinear_and_grey():
    ramp = np.tile(np.arange(28, dtype=np.uint8) * 9, (28, 1))[None]
    out = fashion_mnist.resize(ramp, 56)
    assert out.shape == (1, 56, 56, 3)
    assert np.array_equal(out[..., 0], out[..., 1]) and np.array_equal(out[..., 0], out[..., 2])
    # Half-pixel centres (align_corners=False): output j reads input (j + 0.5) / 2 - 0.5,
    # clamped at the edges: 0, 0.25 * 9, 0.75 * 9, ... rounded; the last reads 27 * 9.
    assert out[0, 0, :4, 0].tolist() == [0, 2, 7, 11] and out[0, 0, -1, 0] == 243


def test_fractal_classes_are_fixed_by_their_index_and_differ():
    a, b = fractals.system(3), fractals.system(3, seed=0)
    assert np.array_equal(a.matrices, b.matrices)
    assert not np.array_equal(fractals.system(4).offsets[:1], a.offsets[:1])
    for s in (a, fractals.system(4)):
        assert np.linalg.svd(s.matrices, compute_uv=False).max() <= fractals.MAX_CONTRACTION
        assert s.probabilities.sum() == pytest.approx(1.0)
    first = fractals.render(np.array([3, 3]), (9,))
    assert np.array_equal(first, fractals.render(np.array([3, 3]), (9,)))
    assert not np.array_equal(first[0], first[1])  # two samples of one class differ


def test_the_benchmark_classes_are_never_pretraining_classes():
    from pilot_online.harness.scale.pretrain import Recipe

    assert Recipe().pretrain_classes <= fractals.VALIDATION_FIRST_CLASS
    assert fractals.VALIDATION_FIRST_CLASS + 1000 <= fractals.BENCHMARK_FIRST_CLASS


def test_the_scale_datasets_are_listed_and_have_200_steps():
    names = dataset_names()["pilot-online"]
    assert {"fashion_mnist", "fractal"} <= set(names)
    for name, spec in SCALE_DATASETS.items():
        if name != "fashion_mnist_quick":  # the grid's: 200 steps at batch 100
            assert spec.num_classes * spec.train_per_class >= 200 * 100
    small = load_scale_dataset("fractal", 16)
    assert small["train_x"].shape == (50 * 400, 16, 16, 3)
    assert np.bincount(small["test_y"]).tolist() == [60] * 50
