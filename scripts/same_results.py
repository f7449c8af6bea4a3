"""Whether two runs gave the same results, bit for bit: the check a refactoring commit passes.

    python scripts/same_results.py OLD NEW      # two results files, or two folders of them

Compares every field of the results files (the accuracy matrix, the metrics, the counters, the
FGH and prototype diagnostics, the stream) and the gradient-trace arrays beside them, except
what differs between two runs of the same code on the same machine: when and how fast it ran
(``created_utc``, ``timing``), where its files lie (the config's path, ``results_dir``, an
absolute ``pretrained_path``) and the library versions beside it (``environment``). Floats
compare exactly. Prints each difference; exits 1 on any.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pilot_online.core.results import find_results, load_results

#: Fields that vary between identical runs: the clock, the paths and the libraries of the machine
#: (a run on another torch or thread count that gives the same numbers is the same run).
VOLATILE = {
    ("created_utc",),
    ("timing",),
    ("environment",),
    ("config", "config"),
    ("config", "results_dir"),
    ("config", "pretrained_path"),
}


def differences(old: Any, new: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Every place where ``old`` and ``new`` differ, as ``a.b.[3]: old != new`` lines."""
    where = ".".join(path)
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new), key=str):
            if (*path, str(key)) in VOLATILE:  # skipped even where one side lacks it
                continue
            if key not in old or key not in new:
                side = "new" if key in new else "old"
                lines.append(f"{where}.{key}: only in {side}")
            else:
                lines += differences(old[key], new[key], (*path, str(key)))
        return lines
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        lines = []
        for i, (a, b) in enumerate(zip(old, new)):
            lines += differences(a, b, (*path, f"[{i}]"))
        return lines
    if old != new and not (old != old and new != new):  # NaN equals NaN here
        return [f"{where}: {old!r} != {new!r}"]
    return []


def compare_files(old: Path, new: Path) -> list[str]:
    lines = differences(load_results(old), load_results(new))
    for side in sorted(old.parent.glob(f"{old.name.removesuffix('.json')}.*.npy")):
        twin = new.parent / side.name
        if not twin.is_file():
            lines.append(f"{side.name}: missing beside {new}")
        elif not np.array_equal(np.load(side), np.load(twin), equal_nan=True):
            lines.append(f"{side.name}: arrays differ")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.old.is_dir():
        # By the path under each folder: methods' runs share file names (a matrix's folders).
        olds = {str(p.relative_to(args.old)): p for p in find_results([args.old])}
        news = {str(p.relative_to(args.new)): p for p in find_results([args.new])}
        pairs = [(olds[n], news[n]) for n in sorted(olds) if n in news]
        missing = sorted(set(olds) ^ set(news))
    else:
        pairs, missing = [(args.old, args.new)], []
    failed = bool(missing)
    for name in missing:
        print(f"{name}: in one folder only")
    for old, new in pairs:
        lines = compare_files(old, new)
        failed |= bool(lines)
        where = new.relative_to(args.new) if args.new.is_dir() else new.name
        print(f"{where}: {'identical' if not lines else f'{len(lines)} differences'}")
        for line in lines[:20]:
            print(f"  {line}")
    print(f"{len(pairs)} pairs compared, {'some differ' if failed else 'all identical'}")
    return 1 if failed or not pairs else 0


if __name__ == "__main__":
    sys.exit(main())
