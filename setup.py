"""Packaging for pilot-online: online, task-free training for LAMDA-PILOT's prompt learners."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = {}
exec((HERE / "pilot_online" / "version.py").read_text(), VERSION)

setup(
    name="pilot-online",
    version=VERSION["__version__"],
    description=(
        "Online, task-free training for LAMDA-PILOT's L2P, DualPrompt, CODA-Prompt and the "
        "other rows of the paper's tables, with online prototypes and Fine-Grained Hypergradients."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.9",
    packages=find_packages(include=["pilot_online", "pilot_online.*"]),
    # The paper's numbers (harness/paper.py reads them): tables, hp_grid, time_consumption; and
    # the FLOP model's counts per method (data/flops.json, engine/flops.py; written by
    # benchmarks/flops.py).
    # data/backbones: the scale model's shipped ViT (fp16 safetensors) and its record.
    package_data={
        "pilot_online": [
            "data/*.json",
            "data/backbones/*.json",
            "data/backbones/*.safetensors",
        ]
    },
    install_requires=[
        # 2.1: scaled_dot_product_attention's scale= (sdpa: true) and the foreach kernels of
        # FGH (core/fgh.py falls back to per-tensor copies where _foreach_copy_/_clone are
        # missing); checkpoints store no unsigned tensors, which torch < 2.3 lacks.
        "torch>=2.1",
        # PILOT breaks on timm >= 0.9, and timm 0.6.12 does not import on Python 3.11.
        "timm>=0.6.13,<0.9",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # Imported by PILOT, never by pilot_online: models/base.py (scipy, at import, so every
        # PILOT run needs it) and utils/inc_net.py (easydict). Install with PILOT: ".[pilot]".
        "pilot": ["scipy", "easydict", "torchvision"],
        "plots": ["matplotlib"],
        "tensorboard": ["tensorboard"],  # "logger": "tensorboard" (live logging)
        # `pilot-online sweep --engine ray`: on the machine that starts the sweep and every node.
        "ray": ["ray"],
        # "pretrained_path": a .safetensors file (pilot/backbones.py imports it only then).
        "safetensors": ["safetensors"],
        # matplotlib: tests/test_report_demo.py and test_figures.py render the figures.
        # pot: upstream's models/coil.py imports it, and tests/test_transport.py checks
        # core/transport.py's Sinkhorn against its ot.sinkhorn (the runtime never imports it).
        "test": ["pytest", "ruff", "safetensors", "matplotlib", "pot"],
    },
    entry_points={
        "console_scripts": ["pilot-online=pilot_online.cli:main"],
        # Methods from other packages register here, e.g. in theirs:
        # "pilot_online.methods": ["my_method_online = my_package.adapter:MyAdapter"]
        # (engine/registry.py loads the group; the built-in methods register on import).
        "pilot_online.methods": [],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
