"""``pilot-online configs`` and ``pilot-online flops``: what a method registered from outside the
package (an entry point, ``engine/registry.py``) needs from the tooling, which a built-in method
gets from ``scripts/make_exps.py`` and ``benchmarks/flops.py`` in this repository's checkout.

- ``configs NAME --out DIR``: its smoke config, ablation configs and learning-rate search, from
  the same generator as ``exps/`` (``harness/configs.py``), each validated before any is written.
- ``flops NAME --pilot-root PILOT``: its FLOP counts per image at 224 px
  (``harness/flop_count.py``), printed as the ``flops=`` of its ``MethodCard``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_configs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a registered method (pilot-online methods lists them)")
    parser.add_argument("--out", type=Path, default=Path("exps"), help="folder (default: exps)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs; write none")


def run_configs(args: argparse.Namespace) -> int:
    from ..engine.config import ConfigError, resolve_config
    from ..harness.configs import method_configs

    try:
        configs = method_configs(args.name)
        for name, config in configs.items():
            try:
                resolve_config(config)
            except ConfigError as err:
                raise ValueError(f"the generated {name} is invalid: {err}") from None
    except ValueError as err:
        print(f"pilot-online configs: {err}", file=sys.stderr)
        return 2
    stale = []
    for name, config in configs.items():
        path = args.out / name
        text = json.dumps(config, indent=4) + "\n"
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    verb = "differ" if args.check else "written"
    print(f"{len(configs)} configs of {args.name} in {args.out}: {len(stale)} {verb}")
    for path in stale:
        print(f"  {path}")
    return 1 if args.check and stale else 0


def add_flops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a registered method")
    parser.add_argument(
        "--pilot-root", help="a PILOT checkout to import (default: $PILOT_ROOT, then .)"
    )
    parser.add_argument("--classes", type=int, default=200, help="head size (CUB: 200)")
    parser.add_argument("--batch", type=int, default=1, help="images per counted pass")


def run_flops(args: argparse.Namespace) -> int:
    root = Path(args.pilot_root or os.environ.get("PILOT_ROOT") or ".").resolve()
    if not (root / "utils" / "inc_net.py").is_file():
        print(
            f"pilot-online flops: {root} is no PILOT checkout: pass --pilot-root or set "
            "PILOT_ROOT (the method's network is PILOT's)",
            file=sys.stderr,
        )
        return 2
    if args.batch < 1 or args.classes < 2:
        print("pilot-online flops: --batch must be >= 1 and --classes >= 2", file=sys.stderr)
        return 2
    sys.dont_write_bytecode = True  # PILOT's tree stays untouched
    sys.path.insert(0, str(root))
    from ..harness.flop_count import card_literal, count_method

    try:
        counts = count_method(args.name, args.classes, args.batch)
    except ValueError as err:
        print(f"pilot-online flops: {err}", file=sys.stderr)
        return 2
    print(card_literal(args.name, counts))
    return 0
