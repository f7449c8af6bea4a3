"""``pilot-online setup``: patch a PILOT checkout (``pilot/patching.py``) and say what it holds."""

from __future__ import annotations

import argparse
import os
import sys

from ..pilot.patching import (
    PILOT_EXPS,
    PINNED_COMMIT,
    CheckoutState,
    PatchError,
    apply,
    inspect,
    revert,
    some_names,
)


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pilot-online setup``."""
    parser.add_argument(
        "pilot_root",
        metavar="PILOT_ROOT",
        nargs="?",
        default=None,
        help=f"LAMDA-PILOT checkout (commit {PINNED_COMMIT}) to patch (default: $PILOT_ROOT)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="only report; exit 1 when the checkout is not fully patched",
    )
    mode.add_argument(
        "--revert",
        action="store_true",
        help="restore PILOT's upstream files and remove our config links",
    )


def _print_report(state: CheckoutState) -> None:
    print(f"PILOT_ROOT {state.root} (pinned commit {PINNED_COMMIT})")
    for f in state.files:
        print(f"  {f.path:<28} {f.state}")
    # Configs by state, counted (one line per config was hundreds of lines); conflicts by name.
    link_groups = (
        ("linked", state.linked_configs),
        ("not linked", state.missing_links),
        ("stale links (setup replaces them)", state.stale_links),
    )
    for label, names in link_groups:
        if names:
            print(f"  {PILOT_EXPS + '/*.json':<28} {len(names)} {label} ({some_names(names)})")
    for name in state.foreign_links:
        print(f"  {PILOT_EXPS + '/' + name:<28} CONFLICT: not ours")
    print("status: " + ("patched" if state.patched else "not patched"))


def run_setup(args: argparse.Namespace) -> int:
    """Body of ``pilot-online setup``: 0 on success, 1 for ``--check`` when not patched, 2 on
    refusal."""
    root = args.pilot_root or os.environ.get("PILOT_ROOT")
    if not root:
        print(
            "pilot-online setup: no PILOT checkout given: pass PILOT_ROOT as an argument or set "
            f"the PILOT_ROOT environment variable (a LAMDA-PILOT checkout at {PINNED_COMMIT})",
            file=sys.stderr,
        )
        return 2
    try:
        if args.check:
            state = inspect(root)
        elif args.revert:
            state = revert(root)
        else:
            state = apply(root)
    except PatchError as error:
        print(f"pilot-online setup: {error}", file=sys.stderr)
        return 2
    _print_report(state)
    if args.check and not state.patched:
        print(f"run `pilot-online setup {state.root}` to patch it", file=sys.stderr)
        return 1
    return 0
