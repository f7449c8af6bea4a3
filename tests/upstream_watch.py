"""Upstream execution: a tests/test_upstream_<stem>.py module must run the PILOT code it claims.

``<stem>`` is a file of pilot_online/methods/ whose ports' cards name a PILOT model
(``upstream_file``, ``models/<name>.py``). During the setup and the call of each of the module's
tests a profile function records which functions of ``models/<name>.py`` in a PILOT tree (the
copy ``pilot_on_path`` puts on sys.path) run. To keep its cost small it is set only once
``models.<name>`` has been imported (a meta path hook notices the import) and removes itself once
every claimed file has run: a module pays for it from its import of upstream to its first call
into it. Module and class bodies do not count: importing upstream compares nothing.

When the module's last selected test is torn down the module is judged, and a claimed file that
never ran is an error in that teardown. It is judged only when the verdict can be trusted: every
test function the module defines was selected (running one test by node id, ``-k``, ``-m`` or
``--deselect`` skips the check), at least one test's call ran (not skipped: without PILOT there is
nothing to judge), no test of the module failed (its failure is the news) and no other profile
function (cProfile and the like) held ``sys.setprofile``. Coverage's ``sys.settrace`` is left
alone. tests/test_upstream_contract.py holds the rest of the contract (the file, its import of
upstream, an asserting ``test_difference_<key>`` per declared difference).
"""

from __future__ import annotations

import importlib.abc
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

PILOT_ROOT = os.path.abspath(os.environ["PILOT_ROOT"]) if os.environ.get("PILOT_ROOT") else None

UPSTREAM_TEST_PREFIX = "test_upstream_"
Profile = Callable[[FrameType, str, Any], None]


def upstream_files_by_stem() -> dict[str, dict[str, list[str]]]:
    """``{methods-file stem: {models/<name>.py: [names of the ports claiming it]}}`` from the
    registry: every port whose card names a PILOT model, under the stem of its adapter's module
    (``tests/test_upstream_<stem>.py`` is its equivalence file)."""
    from pilot_online.engine.registry import get_method, list_methods, method_card

    claimed: dict[str, dict[str, list[str]]] = {}
    for name in list_methods():
        upstream = method_card(name).upstream_file
        if upstream:
            stem = get_method(name).__module__.rsplit(".", 1)[1]
            claimed.setdefault(stem, {}).setdefault(upstream, []).append(name)
    return claimed


def native_tail(path: str) -> str:
    """``/models/<name>.py`` with this system's separators: how a file name ends in it."""
    return os.sep + path.replace("/", os.sep)


def is_pilot_tree_file(filename: str) -> bool:
    """Whether ``filename`` (``<root>/models/<name>.py``) lies in a PILOT tree, with ``main.py`` and
    ``trainer.py`` at ``<root>``: upstream's file, not another of the same name."""
    root = os.path.dirname(os.path.dirname(filename))
    return all(os.path.isfile(os.path.join(root, name)) for name in ("main.py", "trainer.py"))


@dataclass
class UpstreamWatch:
    """What one ``test_upstream_<stem>.py`` module's tests ran of the PILOT files it claims."""

    module: str  # the test file's name
    claimed: dict[str, list[str]]  # models/<name>.py -> the ports claiming it
    items: int  # its selected tests
    whole: bool  # every test function it defines was selected
    finished: int = 0  # its tests torn down so far
    ran: bool = False  # some test's call phase ran (was not skipped)
    failed: bool = False  # some phase of some test failed
    unwatched: str = ""  # why a phase could not be watched ("": every phase was)
    executed: dict[str, set[str]] = field(default_factory=dict)  # claimed file -> functions run
    in_pilot: dict[str, bool] = field(default_factory=dict)  # is_pilot_tree_file, per file name

    def pending(self) -> list[str]:
        """The claimed files (``models/<name>.py``) none of whose functions has run yet."""
        return [path for path in self.claimed if path not in self.executed]

    def imported(self) -> bool:
        """Whether a pending file's module (``models.<name>``) is imported from a PILOT tree."""
        for path in self.pending():
            module = sys.modules.get(path.removesuffix(".py").replace("/", "."))
            filename = getattr(module, "__file__", None) or ""
            if filename.endswith(native_tail(path)) and is_pilot_tree_file(filename):
                return True
        return False

    def profiler(self) -> Profile:
        """A profile function that records the claimed files' functions as they are called and
        removes itself once every claimed file has run."""
        tails = tuple(native_tail(path) for path in self.pending())

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call":
                return
            code = frame.f_code
            filename = code.co_filename
            # Functions only: a module or class body (run at import) has no CO_NEWLOCALS, and a
            # comprehension or lambda runs inside a function that counted already.
            if (
                not filename.endswith(tails)
                or not code.co_flags & inspect.CO_NEWLOCALS
                or code.co_name.startswith("<")
            ):
                return
            if filename not in self.in_pilot:
                self.in_pilot[filename] = is_pilot_tree_file(filename)
            if self.in_pilot[filename]:
                path = next(p for p in self.claimed if filename.endswith(native_tail(p)))
                name = getattr(code, "co_qualname", code.co_name)  # 3.11+: Learner.train
                self.executed.setdefault(path, set()).add(name)
                if not self.pending():
                    sys.setprofile(None)

        return profile

    def verdict(self) -> str:
        """Why the module fails the check; "" when it passes or cannot be judged."""
        if not (self.whole and self.ran) or self.failed or self.unwatched:
            return ""
        missing = self.pending()
        if not missing:
            return ""
        lines = [
            f"{self.module} claims upstream's {path} (the card of "
            f"{', '.join(self.claimed[path])}), but no function of that file ran while its tests "
            f"ran (setup and call; importing it does not count)"
            for path in missing
        ]
        lines += [
            f"(ran: {path}: {', '.join(sorted(names)[:8])})"
            for path, names in self.executed.items()
        ]
        lines.append(
            "Its tests must call upstream's functions: build the same state in upstream's "
            "Learner (`from models.<name> import Learner`, from the copy `pilot_on_path` puts on "
            "sys.path) and run its code on the same batch as ours (docs/porting.md, 'An "
            "upstream-equivalence test')."
        )
        return "\n".join(lines)


class ArmAfterImport(importlib.abc.MetaPathFinder):
    """A meta path hook that finds nothing itself: when one of ``modules`` is imported it asks the
    finders after it, and calls ``arm`` once the module has been executed."""

    def __init__(self, modules: set[str], arm: Callable[[], None]) -> None:
        self.modules, self.arm = modules, arm

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            execute, arm = loader.exec_module, self.arm

            def exec_module(module: Any) -> None:
                execute(module)
                arm()

            loader.exec_module = exec_module  # this module's own loader instance
        return spec


_watches_key = pytest.StashKey[dict[str, UpstreamWatch]]()
_deselected_key = pytest.StashKey[set[str]]()


def upstream_watch(item: pytest.Item) -> UpstreamWatch | None:
    """The watch of ``item``'s module, if it is a watched ``test_upstream_<stem>.py``."""
    return item.config.stash.get(_watches_key, {}).get(str(item.path))


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Note the modules that ``-k``, ``-m`` or ``--deselect`` cut: they are not judged whole."""
    for item in items:
        item.config.stash.setdefault(_deselected_key, set()).add(str(item.path))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A watch per selected ``test_upstream_<stem>.py`` module whose ``<stem>`` has ports of
    PILOT models (none without PILOT: those tests skip)."""
    if not PILOT_ROOT:
        return
    claimed = upstream_files_by_stem()
    modules: dict[str, list[pytest.Item]] = {}
    for item in session.items:
        name = item.path.name
        stem = name.removeprefix(UPSTREAM_TEST_PREFIX).removesuffix(".py")
        if name.startswith(UPSTREAM_TEST_PREFIX) and stem in claimed:
            modules.setdefault(str(item.path), []).append(item)
    cut = session.config.stash.get(_deselected_key, set())
    watches = {}
    for path, items in modules.items():
        module = getattr(items[0], "module", None)
        defined = {
            name
            for name, value in (vars(module) if module is not None else {}).items()
            if name.startswith("test") and inspect.isfunction(value)
        }
        selected = {getattr(item, "originalname", item.name) for item in items}
        stem = Path(path).name.removeprefix(UPSTREAM_TEST_PREFIX).removesuffix(".py")
        watches[path] = UpstreamWatch(
            module=Path(path).name,
            claimed=claimed[stem],
            items=len(items),
            whole=path not in cut and module is not None and defined <= selected,
        )
    session.config.stash[_watches_key] = watches


@contextmanager
def watching(item: pytest.Item) -> Iterator[None]:
    """One phase of ``item`` watched: the profile function set now if a pending claimed module
    is imported, else as soon as its import finishes."""
    watch = upstream_watch(item)
    if watch is None or watch.unwatched or not watch.pending():
        yield
        return
    profile = watch.profiler()

    def arm() -> None:
        if sys.getprofile() is None:
            sys.setprofile(profile)
        elif sys.getprofile() is not profile:
            watch.unwatched = f"another profile function was set: {sys.getprofile()!r}"

    hook = None
    if watch.imported():
        arm()
    else:
        modules = {path.removesuffix(".py").replace("/", ".") for path in watch.pending()}
        hook = ArmAfterImport(modules, arm)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        if sys.getprofile() is profile:
            sys.setprofile(None)
        elif watch.imported() and not watch.unwatched:
            # Upstream is there, unseen, and our profile function is gone: replaced or removed
            # by someone else, or never set (imported some other way than through the hook).
            profile_set = "replaced" if sys.getprofile() is not None else "not set or removed"
            watch.unwatched = f"{item.nodeid}: the profile function was {profile_set}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After a watched module's last test: fail if a PILOT file its ports claim never ran."""
    result = yield
    watch = upstream_watch(item)
    if watch is not None:
        watch.finished += 1
        if watch.finished == watch.items and watch.verdict():
            pytest.fail(watch.verdict(), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Note, per watched module, whether a test's call ran and whether any phase failed."""
    report = yield
    watch = upstream_watch(item)
    if watch is not None:
        watch.failed |= report.failed
        watch.ran |= report.when == "call" and not report.skipped
    return report
