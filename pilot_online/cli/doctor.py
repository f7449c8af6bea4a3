"""``pilot-online doctor [--config C]``: before a real run, whether this machine can run it.

Each check prints one line, ``ok``, ``warn`` or ``FAIL``, and a failing (or warning) one says
its fix. The exit code is 0 when nothing fails (warnings are slow paths, not failures), else 1.

Checks, in order:

- **config**: the config resolves (``pretrained_path`` is checked on its own below);
- **versions**: python, torch (at least the floor setup.py states), timm (PILOT 5240714 needs
  0.6.x), torchvision;
- **cuda** / **bf16**: a CUDA device where the config's ``device`` names one (``-1``: the CPU),
  and bfloat16 support where ``amp: "bf16"``;
- **pilot**: the checkout given by ``--pilot-root`` or ``$PILOT_ROOT`` is patched for
  pilot-online (``pilot/patching.py``);
- **weights**: ``pretrained: false``; or ``pretrained_path`` readable in a form we load; or the
  file timm 0.6 downloads already in its cache (``$TORCH_HOME/hub/checkpoints``); else whether
  the download host answers (offline: the fix says what to fetch where);
- **dataset**: the folders PILOT will read, relative to the working directory, as every run
  reads them (``pilot/data.py`` ``dataset_root``, ``check_dataset_folders``: both folders, every
  class folder); a CIFAR folder that is missing fails when its download host cannot be reached;
- **gpu memory** / **host memory** / **disk**: free against rough needs (below);
- **data path**: the run's training transform timed on a few images (the dataset's own files
  when present, else generated JPEGs), per worker and for the run's workers, against the images
  per second the GPU consumes at the FLOP model's rate (a warning when slower);
- **compute**: the FLOP model's GPU time for the run (``harness/estimate.py``): the ideal floor and
  the figure calibrated to the paper's time table, each with what it assumes; unknown without a
  CUDA device.

Needs are rough and stated as such: GPU memory is the paper's measured footprint of the method on
CUB at batch 100 (its time table; fp32 on a Quadro RTX 8000), scaled by the batch size, or 20 GB
for a method it lacks; host memory is 4 GB for the process plus the test-pixel cache (3 x 224 x
224 bytes a test image); disk is the weights download (350 MB, if not cached) plus, with
``checkpoint_every``, one checkpoint of at most 5 floats per ViT-B parameter (1.7 GB).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.progress import plural

OK, WARN, FAIL = "ok", "warn", "FAIL"
#: The torch release setup.py requires (``torch>=2.1``).
TORCH_FLOOR = (2, 1)
#: A ViT-B/16's parameters, for the checkpoint-size bound.
VIT_B_PARAMETERS = 86_600_000
GIB = 1024**3
#: Rough needs (see the module docstring).
PROCESS_HOST_BYTES = 4 * GIB
DEFAULT_GPU_BYTES = 20 * GIB
WEIGHTS_DOWNLOAD_BYTES = 350 * 1024**2
#: PILOT's top-level packages (imported from its checkout to read the run's transforms).
PILOT_PACKAGES = ("utils", "models", "backbone", "trainer", "convs")
#: Names PILOT maps to timm's plain ViT-B (``utils/inc_net.py`` ``get_backbone``).
PILOT_PLAIN_VITS = {
    "pretrained_vit_b16_224": "vit_base_patch16_224",
    "pretrained_vit_b16_224_in21k": "vit_base_patch16_224_in21k",
}


@dataclass
class Check:
    """One line of the report: ``status`` is ok, warn or FAIL; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"[{self.status:^4}] {self.name}: {self.detail}"]
        if self.fix and self.status != OK:
            out.append(f"       fix: {self.fix}")
        return out


# -- the config -------------------------------------------------------------------------------


def load_config(path: Path | None) -> tuple[dict[str, Any], list[Check]]:
    """The resolved config (``{}`` without one) and the config check; ``pretrained_path`` is
    taken out before resolving, so that a missing weights file is reported by its own check."""
    if path is None:
        return {}, [Check("config", OK, "none given: machine checks only (pass --config C)")]
    from ..engine.config import ConfigError, load_json, resolve_config

    try:
        raw = load_json(path)
    except ConfigError as err:
        return {}, [Check("config", FAIL, str(err), "fix the JSON file")]
    weights = raw.pop("pretrained_path", None)
    if isinstance(weights, str):  # the shipped scale backbone, by its package name
        from ..core.scale_backbone import resolve_weights

        weights = resolve_weights(weights)
    try:
        cfg = resolve_config(raw)
    except ConfigError as err:
        fix = "correct the key the message names (`pilot-online check-config --keys` lists all)"
        return {**raw, "pretrained_path": weights}, [Check("config", FAIL, str(err), fix)]
    cfg["pretrained_path"] = weights
    return cfg, [Check("config", OK, f"{path} resolves ({cfg['model_name']} on {cfg['dataset']})")]


def _gpu_run(cfg: dict[str, Any]) -> bool:
    """Whether the config's ``device`` names a CUDA device (``-1`` is PILOT's CPU)."""
    devices = cfg.get("device", ["0"])
    devices = devices if isinstance(devices, list) else [devices]
    return any(str(d).strip() not in ("-1", "cpu") for d in devices)


# -- versions, CUDA, PILOT ----------------------------------------------------------------------


def check_versions() -> list[Check]:
    import torch

    checks = []
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    floor = ".".join(map(str, TORCH_FLOOR))
    if release >= TORCH_FLOOR:
        checks.append(Check("torch", OK, f"{torch.__version__} (>= {floor})"))
    else:
        checks.append(
            Check("torch", FAIL, f"{torch.__version__} < {floor}", f"pip install 'torch>={floor}'")
        )
    try:
        import timm

        good = timm.__version__.startswith("0.6.")
        checks.append(
            Check(
                "timm",
                OK if good else FAIL,
                f"{timm.__version__}" + ("" if good else " (PILOT 5240714's ViTs need timm 0.6)"),
                "pip install 'timm==0.6.13'",
            )
        )
    except ImportError:
        checks.append(Check("timm", FAIL, "not installed", "pip install 'timm==0.6.13'"))
    try:
        import torchvision

        checks.append(Check("torchvision", OK, torchvision.__version__))
    except ImportError:
        checks.append(
            Check("torchvision", FAIL, "not installed (PILOT's data)", "pip install torchvision")
        )
    checks.append(Check("python", OK, platform.python_version()))
    return checks


def check_cuda(cfg: dict[str, Any]) -> list[Check]:
    import torch

    gpu_run = _gpu_run(cfg) if cfg else True
    if not torch.cuda.is_available():
        detail = f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        if cfg and not gpu_run:
            return [Check("cuda", OK, detail + "; the config runs on the CPU (device -1)")]
        return [
            Check(
                "cuda",
                FAIL,
                detail,
                "run on a machine with an NVIDIA GPU and a CUDA build of torch, or set "
                '"device": [-1] to run on the CPU (slow at 224 px)',
            )
        ]
    name = torch.cuda.get_device_name(0)
    devices = plural(torch.cuda.device_count(), "device")
    checks = [Check("cuda", OK, f"{devices}, cuda:0 is {name}")]
    bf16 = torch.cuda.is_bf16_supported()
    wants = cfg.get("amp") == "bf16"
    checks.append(
        Check(
            "bf16",
            OK if bf16 or not wants else FAIL,
            f"bfloat16 {'supported' if bf16 else 'not supported'} on {name}"
            + ("; the config asks for it (amp: bf16)" if wants else ""),
            'set "amp": null (fp32) on this GPU, or use an Ampere or newer GPU',
        )
    )
    return checks


def check_pilot(pilot_root: str | None) -> list[Check]:
    from ..pilot import patching

    root = pilot_root or os.environ.get("PILOT_ROOT")
    if not root:
        return [
            Check(
                "pilot",
                FAIL,
                "no PILOT checkout given",
                f"pass --pilot-root or set PILOT_ROOT to a LAMDA-PILOT checkout at "
                f"{patching.PINNED_COMMIT}, then `pilot-online setup <it>`",
            )
        ]
    try:
        state = patching.inspect(root)
    except (patching.PatchError, OSError) as err:
        return [Check("pilot", FAIL, str(err), f"point it at a LAMDA-PILOT checkout ({root})")]
    if state.patched:
        return [Check("pilot", OK, f"{state.root} is patched for pilot-online")]
    unpatched = [f.path for f in state.files if f.state != "patched"]
    return [
        Check(
            "pilot",
            FAIL,
            f"{state.root} is not set up for pilot-online (files not patched: "
            f"{', '.join(unpatched) or 'none'}; configs not linked: {len(state.missing_links)})",
            f"pilot-online setup {state.root}",
        )
    ]


# -- weights, dataset -------------------------------------------------------------------------


def _download_url(backbone_type: str) -> str:
    from ..pilot.backbones import _pretrained_cfg_for

    name = PILOT_PLAIN_VITS.get(backbone_type, backbone_type)
    return str(_pretrained_cfg_for(name).get("url") or "")


def _host_answers(url: str, timeout: float = 5.0) -> bool:
    try:
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except Exception:
        return False


def check_weights(cfg: dict[str, Any]) -> list[Check]:
    if not cfg:
        return []
    if not cfg.get("pretrained", True):
        return [Check("weights", OK, "pretrained: false (random weights, nothing to load)")]
    path = cfg.get("pretrained_path")
    if path:
        from ..pilot.backbones import check_weights_suffix, missing_vit_keys

        fix = (
            "point pretrained_path at the ViT weights: timm 0.6's npz, a torch.save'd timm "
            "state dict (.pth/.pt/.bin) or the Hugging Face cache's model.safetensors"
        )
        if not Path(path).is_file():
            return [Check("weights", FAIL, f"pretrained_path {path} is not a file", fix)]
        try:
            check_weights_suffix(path)
            missing = missing_vit_keys(path, cfg.get("vit_depth"))
        except (ValueError, OSError, RuntimeError, KeyError) as err:
            return [Check("weights", FAIL, f"pretrained_path {path}: {err}", fix)]
        if missing:
            return [
                Check(
                    "weights",
                    FAIL,
                    f"pretrained_path {path} holds no timm ViT-B/16 weights (of the config's "
                    f"vit_depth, if set): it lacks "
                    f"{', '.join(missing)} (a Hugging Face transformers checkpoint names its "
                    "tensors otherwise)",
                    fix,
                )
            ]
        size = Path(path).stat().st_size / 1024**2
        return [Check("weights", OK, f"pretrained_path {path} holds ViT weights ({size:.0f} MiB)")]
    import torch

    try:
        url = _download_url(str(cfg.get("backbone_type")))
    except Exception as err:
        return [Check("weights", FAIL, str(err), "check backbone_type")]
    cached = Path(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    if cached.is_file():
        return [Check("weights", OK, f"in timm's cache: {cached}")]
    if _host_answers(url):
        return [Check("weights", OK, f"not cached; timm will download {url}")]
    return [
        Check(
            "weights",
            FAIL,
            f"not in timm's cache ({cached}) and {url} cannot be reached from here",
            f"on a machine with network, download {url} to {cached} (or set TORCH_HOME), or "
            'set "pretrained_path" to a local copy of the weights',
        )
    ]


#: Where torchvision downloads CIFAR from (``torchvision.datasets.CIFAR10.url``'s host).
CIFAR_HOST = "https://www.cs.toronto.edu/~kriz/"


def run_folder(pilot_root: str | None) -> tuple[Path, str]:
    """The folder the run will start in, whose ``data/`` it reads (``pilot/data.py``
    ``dataset_root``), and why: ``--pilot-root`` when given (``python main.py`` runs in the PILOT
    checkout), else the folder doctor runs in."""
    if pilot_root:
        return Path(pilot_root).resolve(), (
            "--pilot-root, where python main.py runs; pilot-online run reads data/ in the "
            "folder it starts in"
        )
    return Path.cwd(), "the current folder; give --pilot-root to check the PILOT checkout's"


def check_dataset(cfg: dict[str, Any], pilot_root: str | None = None) -> list[Check]:
    """The dataset's folders where the run will read them, by the one rule for every entry point
    (``pilot/data.py`` ``dataset_root``: ``data/`` in the folder the run starts in): under
    ``--pilot-root`` when given, else here; the line says which folder was checked. A dataset
    that is neither in place nor downloadable from here fails: the run could not get it."""
    if not cfg:
        return []
    from ..core.datasets import DATASETS, PILOT_DATASETS
    from ..pilot.data import ARRAY_DATASETS, check_dataset_folders

    name = str(cfg.get("dataset") or "").lower()
    if name in DATASETS or name == "fractal":
        return [Check("dataset", OK, f"{name} is generated in memory (no files)")]
    root, why = run_folder(pilot_root)
    checked = f" (checked {root / 'data'}: {why})"
    if name.startswith("fashion_mnist"):
        from ..core import fashion_mnist

        try:
            folder = fashion_mnist.find_folder(root)
        except FileNotFoundError as err:
            message, fix = str(err).split(" Fix: ", 1)
            return [Check("dataset", FAIL, message + checked, fix)]
        return [Check("dataset", OK, f"Fashion-MNIST's IDX files in {folder}{checked}")]
    note = (
        f" (checked {root}: {why}; PILOT reads data/ relative to the folder python main.py or "
        "pilot-online run starts in)"
    )
    where = PILOT_DATASETS.get(name)
    if name in ARRAY_DATASETS and where is not None:
        folder = root / where.folders[0]
        if folder.is_dir():
            return [Check("dataset", OK, f"{folder} in place{note}")]
        download, offline = where.source.split("; offline, ", 1)
        fix = f"offline, {offline.replace('./data', str(folder.parent))}"
        if _host_answers(CIFAR_HOST):
            return [
                Check("dataset", WARN, f"{folder} does not exist: {download}, when the run starts")
            ]
        return [
            Check(
                "dataset",
                FAIL,
                f"{folder} does not exist and {CIFAR_HOST} cannot be reached from here, so "
                f"the run cannot download it{note}",
                fix,
            )
        ]
    problems = check_dataset_folders(cfg, root)
    if problems:
        fixes = [p.split("Fix: ", 1)[1] if "Fix: " in p else "" for p in problems]
        details = [p.split(" Fix: ", 1)[0] + note for p in problems]
        return [Check("dataset", FAIL, d, f) for d, f in zip(details, fixes)]
    folders = ", ".join(str(root / f) for f in where.folders) if where else name
    return [Check("dataset", OK, f"{folders} in place{note}")]


# -- resources --------------------------------------------------------------------------------


def _paper_memory_mb(cfg: dict[str, Any]) -> float | None:
    """The paper's GPU footprint (MB) of the config's method and row, CUB, batch 100."""
    from ..engine.registry import method_card
    from ..harness.paper import time_consumption
    from ..harness.tables import row_kind

    try:
        card = method_card(str(cfg["model_name"]))
    except ValueError:  # not a registered method: no paper row
        return None
    paper, row, rows = card.paper_name or "", row_kind(cfg), time_consumption()["rows"]
    matches = [r["memory_mb"] for r in rows if r["method"] == paper and r["row"] in (row, "base")]
    return float(max(matches)) if matches else None


def _method_state_bytes(cfg: dict[str, Any]) -> int:
    """What the method keeps beside its parameters (its card's ``state_bytes``: RanPAC's Gram
    matrix, FeCAM's covariances; the engine teacher's snapshot), for the config's dataset's class
    count."""
    from ..engine.registry import get_method, method_card
    from ..engine.teacher import teacher_bytes
    from ..harness.estimate import dataset_size

    try:
        adapter, card = get_method(str(cfg["model_name"])), method_card(str(cfg["model_name"]))
        classes = dataset_size(cfg).classes
    except (KeyError, ValueError):  # no registered method, or a dataset of unknown size
        return 0
    teacher = teacher_bytes(classes) if adapter.consolidation.teacher else 0
    return card.memory_bytes({**cfg, "nb_classes": classes}) + teacher


def _test_images(cfg: dict[str, Any]) -> int:
    from ..harness.estimate import dataset_size

    try:
        return dataset_size(cfg).test
    except ValueError:
        return 0


def check_memory(cfg: dict[str, Any]) -> list[Check]:
    import torch

    checks = []
    batch = int(cfg.get("batch_size", 100)) if cfg else 100
    state = _method_state_bytes(cfg) if cfg else 0
    state_note = f" + {state / GIB:.2f} GiB of the method's own state" if state else ""
    gpu = torch.cuda.is_available() and (not cfg or _gpu_run(cfg))
    if gpu:
        free, total = torch.cuda.mem_get_info(0)
        paper = _paper_memory_mb(cfg) if cfg else None
        need = paper * 1e6 * batch / 100 if paper else DEFAULT_GPU_BYTES * batch / 100
        need += state
        basis = (
            f"the paper's {paper:,.0f} MB on CUB at batch 100, scaled to batch {batch}"
            if paper
            else f"rough: {DEFAULT_GPU_BYTES / GIB:.0f} GiB at batch 100"
        ) + state_note
        checks.append(
            Check(
                "gpu memory",
                OK if free >= need else FAIL,
                f"{free / GIB:.1f} of {total / GIB:.1f} GiB free; the run needs about "
                f"{need / GIB:.1f} GiB ({basis})",
                'free the GPU, or lower "batch_size", or set "amp": "bf16"',
            )
        )
    available = _host_available()
    pixels = _test_images(cfg) * 3 * 224 * 224 if cfg else 0
    need = PROCESS_HOST_BYTES + pixels + (0 if gpu else state)
    if available is None:
        checks.append(Check("host memory", WARN, "could not read /proc/meminfo", ""))
    else:
        checks.append(
            Check(
                "host memory",
                OK if available >= need else FAIL,
                f"{available / GIB:.1f} GiB available; the run needs about {need / GIB:.1f} GiB "
                f"(rough: 4 GiB for the process + {pixels / GIB:.2f} GiB of test pixels"
                f"{'' if gpu else state_note})",
                "close other processes, or run on a machine with more memory",
            )
        )
    return checks


def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_disk(cfg: dict[str, Any]) -> list[Check]:
    folder = Path(cfg.get("results_dir") or ".") if cfg else Path(".")
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    need, parts = 64 * 1024**2, ["64 MiB of logs and results"]
    if cfg and cfg.get("pretrained", True) and not cfg.get("pretrained_path"):
        need += WEIGHTS_DOWNLOAD_BYTES
        parts.append("350 MiB of weights if not cached")
    if cfg and cfg.get("checkpoint_every"):
        need += 5 * 4 * VIT_B_PARAMETERS
        parts.append("a checkpoint of at most 1.7 GB")
    return [
        Check(
            "disk",
            OK if free >= need else FAIL,
            f"{free / GIB:.1f} GiB free at {folder.resolve()}; the run needs about "
            f"{need / GIB:.2f} GiB (rough: {' + '.join(parts)})",
            'free disk space there, or set "results_dir" to a disk with room',
        )
    ]


# -- data path --------------------------------------------------------------------------------


def _training_transform(cfg: dict[str, Any], pilot_root: str | None):
    """The run's training transform (PILOT's, when its checkout is importable) and where it
    came from; else a ViT-B/16 training transform (random-resized crop to 224, flip)."""
    from torchvision import transforms

    root = pilot_root or os.environ.get("PILOT_ROOT")
    name = str(cfg.get("dataset") or "")
    if root and name and Path(root, "utils", "data_manager.py").is_file():
        sys.path.insert(0, str(Path(root).resolve()))
        dont_write, before = sys.dont_write_bytecode, set(sys.modules)
        sys.dont_write_bytecode = True
        try:
            from utils.data_manager import _get_idata  # PILOT

            from ..pilot.data import _base_model_name

            base = _base_model_name(cfg) or cfg.get("model_name")
            idata = _get_idata(name, {**cfg, "model_name": base})
            steps = [*idata.train_trsf, *idata.common_trsf]
            return transforms.Compose(steps), f"PILOT's {name} training transform"
        except Exception:
            pass
        finally:
            sys.dont_write_bytecode = dont_write
            sys.path.remove(str(Path(root).resolve()))
            for module in set(sys.modules) - before:  # PILOT's packages: not for later imports
                if module.split(".")[0] in PILOT_PACKAGES:
                    del sys.modules[module]
    steps = [
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
    ]
    return transforms.Compose(steps), "a ViT training transform (PILOT not importable)"


def _sample_images(
    cfg: dict[str, Any], count: int, root: Path | None = None
) -> tuple[list[Any], str]:
    """``count`` image sources: CIFAR-sized arrays for CIFAR (PILOT holds them in memory); the
    dataset's own files when present (where the run reads them: ``dataset_root``); else
    generated JPEGs (500 x 375, CUB's typical size), as
    encoded bytes so that timing includes the decode."""
    import numpy as np
    from PIL import Image

    from ..core.datasets import PILOT_DATASETS
    from ..pilot.data import dataset_root

    name = str(cfg.get("dataset") or "").lower()
    where = PILOT_DATASETS.get(name)
    rng = np.random.default_rng(0)
    if name.startswith("cifar"):  # arrays in memory: 32 x 32 images, no decode
        arrays = rng.integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8)
        return [Image.fromarray(a) for a in arrays], f"{count} CIFAR-sized 32x32 arrays"
    top = (root or dataset_root()) / where.folders[0] if where is not None else None
    if top is not None and top.is_dir():
        files = []
        for folder, _, names in os.walk(top):
            files += [
                os.path.join(folder, n) for n in names if n.lower().endswith((".jpg", ".png"))
            ]
            if len(files) >= count:
                break
        if files:
            return files[:count], f"{len(files[:count])} files of {top}"
    encoded = []
    for _ in range(count):
        pixels = rng.integers(0, 256, size=(375, 500, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        encoded.append(buffer.getvalue())
    return encoded, f"{count} generated 500x375 JPEGs"


def measure_transform_rate(transform, sources: list[Any], seconds: float = 2.0) -> float:
    """Images per second one process decodes and transforms (at least one pass over
    ``sources``, up to ``seconds``)."""
    from PIL import Image

    def load(source):
        if isinstance(source, Image.Image):
            return source
        handle = io.BytesIO(source) if isinstance(source, bytes) else source
        with Image.open(handle) as image:
            return image.convert("RGB")

    transform(load(sources[0]))  # warm-up
    done, begin = 0, time.perf_counter()
    while True:
        for source in sources:
            transform(load(source))
            done += 1
        elapsed = time.perf_counter() - begin
        if elapsed >= seconds:
            return done / elapsed


def check_data_path(cfg: dict[str, Any], pilot_root: str | None, images: int = 16) -> list[Check]:
    if not cfg or str(cfg.get("dataset") or "").lower() in _synthetic_names():
        return [Check("data path", OK, "data held in memory (or no config): not timed")]
    try:
        transform, what = _training_transform(cfg, pilot_root)
    except ImportError as err:
        return [Check("data path", WARN, f"cannot time it: {err}", "pip install torchvision")]
    sources, of = _sample_images(cfg, images, run_folder(pilot_root)[0])
    per_worker = measure_transform_rate(transform, sources)
    workers = cfg.get("num_workers")
    if workers is None:
        from ..pilot.data import auto_workers

        workers = auto_workers()
    rate = per_worker * max(1, int(workers))
    detail = (
        f"{per_worker:.0f} img/s per worker ({what}, decode included, {of}) x "
        f"{plural(max(1, int(workers)), 'worker')} = {rate:.0f} img/s"
    )
    if not _gpu_run(cfg):
        return [
            Check(
                "data path",
                OK,
                f"{detail}; the config trains on the CPU, whose compute, "
                "not the data, sets the pace",
            )
        ]
    need = run_data_rate(cfg)
    if need is None:
        return [Check("data path", OK, f"{detail}; no FLOP counts for this method to judge by")]
    ratio = rate / need
    status = OK if ratio >= 1.0 else WARN if ratio >= DATA_RATE_FAIL else FAIL
    return [
        Check(
            "data path",
            status,
            f"{detail}: {ratio:.2g}x the {need:.0f} img/s the run trains on at the calibrated "
            "estimate's pace",
            'the GPU will wait on data: raise "num_workers" (null: one per CPU), run on a '
            "machine with more CPU cores, or store the images at the size the model reads",
        )
    ]


#: The data rate, as a share of what the run trains on, below which doctor fails (below 1 it
#: warns): at half, the GPU idles half the run.
DATA_RATE_FAIL = 0.5


def run_data_rate(cfg: dict[str, Any]) -> float | None:
    """Stream images per second the run trains on at the calibrated estimate's pace
    (``harness/estimate.py``: the paper's measured throughput), or None without FLOP counts."""
    from ..engine.flops import dataset_size, run_flops
    from ..harness.estimate import calibration

    try:
        train_flops = run_flops(cfg)["train"]
    except (ValueError, KeyError):
        return None
    seconds = train_flops / (calibration().tflops * 1e12)
    return dataset_size(cfg).train / seconds


def _synthetic_names() -> set[str]:
    """Datasets held in memory (generated, or read whole from IDX files): no path to time."""
    from ..core.datasets import plugin_datasets

    return plugin_datasets()


def check_compute(cfg: dict[str, Any]) -> list[Check]:
    """The FLOP model's two figures for the run (``harness/estimate.py``), each with what it
    assumes; "unknown" on a machine without a CUDA device, where no GPU time can be had."""
    if not cfg:
        return []
    import torch

    from ..harness.estimate import estimate_config

    try:
        estimate = estimate_config(cfg)
    except (ValueError, KeyError, OSError) as err:
        return [Check("compute", OK, f"no FLOP estimate: {err}")]
    lines = estimate.describe()
    if not torch.cuda.is_available():
        why = "the config runs on the CPU" if not _gpu_run(cfg) else "see cuda above"
        head = f"unknown on this machine: no CUDA device ({why}); on a GPU, " + lines[0]
    else:
        head = f"{lines[0]}; this machine's GPU is {torch.cuda.get_device_name(0)}"
    return [Check("compute", OK, "\n       ".join([head, *(line.strip() for line in lines[1:])]))]


# -- the command ------------------------------------------------------------------------------


def run_checks(config: Path | None, pilot_root: str | None, data_path: bool = True) -> list[Check]:
    """Every check, in report order."""
    cfg, checks = load_config(config)
    checks += check_versions()
    checks += check_cuda(cfg)
    checks += check_pilot(pilot_root)
    checks += check_weights(cfg)
    checks += check_dataset(cfg, pilot_root)
    checks += check_memory(cfg)
    checks += check_disk(cfg)
    if data_path:
        checks += check_data_path(cfg, pilot_root)
    checks += check_compute(cfg)
    return checks


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="the run's JSON config (else machine only)")
    parser.add_argument("--pilot-root", help="PILOT checkout (default: $PILOT_ROOT)")
    parser.add_argument(
        "--no-data-path", action="store_true", help="skip timing the training transform"
    )


def run_doctor(args: argparse.Namespace) -> int:
    """Body of ``pilot-online doctor``: 0 when no check fails, else 1."""
    checks = run_checks(args.config, args.pilot_root, data_path=not args.no_data_path)
    for check in checks:
        for line in check.lines():
            print(line)
    failed = [c.name for c in checks if c.status == FAIL]
    print(
        f"doctor: {plural(len(failed), 'check')} failed ({', '.join(failed)})"
        if failed
        else "doctor: this machine can run it"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pilot-online doctor", description=__doc__)
    add_doctor_arguments(parser)
    return run_doctor(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
