"""Fashion-MNIST from its four IDX files: the real images this workplace can have offline.

Debian's ``dataset-fashion-mnist`` package installs the standard gzipped IDX files under
``/usr/share/datasets/fashion-mnist``; the same files are found in a ``data/`` folder (as
Zalando's repository lays them out) or in torchvision's ``FashionMNIST/raw`` layout. The IDX
format (LeCun's MNIST page) is a big-endian header, magic ``0x00000803`` for images (then the
count, rows, columns) or ``0x00000801`` for labels (then the count), followed by unsigned bytes.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

#: The four files, by split and kind (Zalando's names; torchvision's raw folder keeps them).
FILES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
#: The documented sizes (Xiao et al., 2017): 60,000 training and 10,000 test images of 28x28
#: grey pixels, 10 classes of equal size.
COUNTS = {"train": 60_000, "test": 10_000}
IMAGE_SHAPE = (28, 28)
CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
#: The training split's two halves: pretraining may read the first without its labels
#: (``harness/scale/pretrain.py``); the ``fashion_mnist`` benchmark streams the second.
PRETRAIN_HALF = slice(0, 30_000)
STREAM_HALF = slice(30_000, 60_000)
DEBIAN_FOLDER = Path("/usr/share/datasets/fashion-mnist")
#: Folders searched, in order, relative to the run's working directory (PILOT reads ``data/``
#: where it runs), then the Debian package's; ``PILOT_ONLINE_FASHION_MNIST`` comes first.
RELATIVE_FOLDERS = ("data/fashion-mnist", "data/FashionMNIST/raw", "data/fashion_mnist")
INSTALL_FIX = (
    "install Debian's package (apt-get install dataset-fashion-mnist, which puts the four IDX "
    f"files in {DEBIAN_FOLDER}), or put train-images-idx3-ubyte[.gz], "
    "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz] "
    "in ./data/fashion-mnist (or torchvision's ./data/FashionMNIST/raw), or set "
    "PILOT_ONLINE_FASHION_MNIST to their folder"
)

_MAGIC = {"images": 0x00000803, "labels": 0x00000801}


class IdxError(ValueError):
    """A file is not the IDX file it should be."""


def read_idx(path: str | Path, kind: str) -> np.ndarray:
    """The array of one IDX file (gzipped or not): uint8 ``[N, rows, cols]`` images or ``[N]``
    labels; a wrong magic number or a short file is an :class:`IdxError` naming the file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if magic != _MAGIC[kind]:
        found = "no magic number" if magic is None else f"magic number {magic:#010x}"
        raise IdxError(f"{path}: {found}, not {_MAGIC[kind]:#010x} (IDX {kind} of bytes)")
    header = 4 + 4 * (magic & 0xFF)  # the magic's last byte counts the dimensions
    if len(raw) < header:
        raise IdxError(f"{path}: {len(raw)} bytes, shorter than its IDX header")
    shape = np.frombuffer(raw[4:header], dtype=">u4").tolist()
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise IdxError(f"{path}: {len(raw) - header} data bytes, the header promises {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()  # writable


def _file_in(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def candidate_folders(root: str | Path = ".") -> list[Path]:
    """Where the files are looked for, in order (``root``: the run's working directory)."""
    folders = []
    if os.environ.get("PILOT_ONLINE_FASHION_MNIST"):
        folders.append(Path(os.environ["PILOT_ONLINE_FASHION_MNIST"]))
    folders += [Path(root) / rel for rel in RELATIVE_FOLDERS]
    folders.append(DEBIAN_FOLDER)
    return folders


def find_folder(root: str | Path = ".") -> Path:
    """The first folder that holds all four files; else ``FileNotFoundError`` with the fix."""
    searched = candidate_folders(root)
    for folder in searched:
        if all(_file_in(folder, name) for name in FILES.values()):
            return folder
    raise FileNotFoundError(
        "Fashion-MNIST's IDX files are in none of "
        + ", ".join(str(f.resolve()) for f in searched)
        + f". Fix: {INSTALL_FIX}"
    )


def load(root: str | Path = ".") -> dict[str, np.ndarray]:
    """``{"train_x", "train_y", "test_x", "test_y"}``: uint8 images ``[N, 28, 28]`` and int64
    labels, checked against the documented counts."""
    folder = find_folder(root)
    arrays: dict[str, np.ndarray] = {}
    for split, count in COUNTS.items():
        images = read_idx(_file_in(folder, FILES[(split, "images")]), "images")
        labels = read_idx(_file_in(folder, FILES[(split, "labels")]), "labels")
        if images.shape != (count, *IMAGE_SHAPE) or labels.shape != (count,):
            raise IdxError(
                f"{folder}: the {split} split has images {images.shape} and labels "
                f"{labels.shape}; Fashion-MNIST's has {count} images of {IMAGE_SHAPE}"
            )
        arrays[f"{split}_x"] = images
        arrays[f"{split}_y"] = labels.astype(np.int64)
    return arrays


def resize(images: np.ndarray, size: int) -> np.ndarray:
    """Grey ``[N, 28, 28]`` uint8 to RGB ``[N, size, size, 3]`` uint8, bilinear (as PIL's
    ``Resize`` would do image by image, in one vectorised pass through torch)."""
    import torch
    import torch.nn.functional as F

    if images.shape[1:] == (size, size):
        grey = images
    else:
        pixels = torch.from_numpy(np.ascontiguousarray(images)).float().unsqueeze(1)
        out = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
        grey = out.round().clamp(0, 255).to(torch.uint8).squeeze(1).numpy()
    return np.repeat(grey[..., None], 3, axis=-1)
