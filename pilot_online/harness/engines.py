"""Where a sweep's runs execute: a local pool (the default) or an existing Ray cluster.

A sweep hands an engine one :class:`Job` per grid point (the same ``python -m pilot_online.cli
run --config X`` command a user would type) and gets back their exit codes. We do not schedule:
the local engine is a thread pool with one slot per GPU, and the Ray engine submits each run as a
Ray task that needs a GPU, so Ray's scheduler places it, and Ray resubmits it when its node dies.

A failed run is run again (up to ``--retries`` times) with the same command, which resumes from
the run's checkpoint where it has one. Exit status 2 is a usage error (a bad config, an unpatched
PILOT) that would fail the same way again, so it is not retried.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _datetime
import os
import queue
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.progress import plural, progress_line

ENGINES = ("local", "ray")
USAGE_ERROR = 2  # argparse / `pilot-online run` refusals: deterministic, never retried
LOST = -1  # the engine lost the run (a Ray task that died on every try): no exit status
RAY_MISSING = (
    '--engine ray needs Ray: pip install -e ".[ray]" (or pip install ray), '
    "on this machine and on every node of the cluster"
)


class EngineUnavailable(RuntimeError):
    """The engine cannot start (its package is missing, its cluster has no room for a run)."""


@dataclass(frozen=True)
class Job:
    """One run: ``python *args`` in ``cwd``, its output appended to ``log``. Paths must be
    absolute and, for a cluster, on a filesystem every node mounts at the same place."""

    name: str
    args: tuple[str, ...]
    cwd: Path
    log: Path


@dataclass(frozen=True)
class Attempt:
    """What one attempt of a job did, measured where it ran."""

    exit_code: int
    seconds: float
    host: str


def execute(job: Job, attempt: int, env: dict[str, str] | None = None) -> Attempt:
    """Run one attempt of ``job`` with this machine's Python (on a Ray node: the node's)."""
    start = time.monotonic()
    host = socket.gethostname()
    stamp = _datetime.datetime.now(_datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    with open(job.log, "a") as handle:
        handle.write(f"=== pilot-online sweep: {job.name}, try {attempt}, {host}, {stamp} ===\n")
        handle.flush()
        code = subprocess.call(
            [sys.executable, *job.args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=job.cwd,
            env=env,
        )
    return Attempt(code, time.monotonic() - start, host)


@dataclass
class EngineOptions:
    engine: str = "local"
    retries: int = 2
    jobs: int | None = None  # local: parallel runs (default: one per GPU, else 1)
    address: str | None = None  # ray: the cluster (None: RAY_ADDRESS, a running one, else local)
    gpus_per_run: float | None = None  # ray: None = 1 if the cluster has GPUs, else 0
    cpus_per_run: float = 1  # ray


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("where runs execute")
    group.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="local: a pool on this machine, one run per visible GPU (one at a time on a CPU); "
        'ray: each run a Ray task on a running cluster (pip install -e ".[ray]")',
    )
    group.add_argument(
        "--retries",
        type=int,
        default=2,
        metavar="N",
        help="run a failed run again up to N times; it resumes from its checkpoint (default 2)",
    )
    group.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="local: runs at a time (default: one per visible GPU, else 1)",
    )
    group.add_argument(
        "--address",
        help="ray: the cluster, e.g. auto or HEAD_IP:6379 (default: $RAY_ADDRESS, the cluster "
        "running on this machine, else a new local Ray instance)",
    )
    group.add_argument(
        "--gpus-per-run",
        type=float,
        metavar="G",
        help="ray: GPUs each run reserves (default: 1, or 0 on a cluster without GPUs)",
    )
    group.add_argument(
        "--cpus-per-run",
        type=float,
        default=1,
        metavar="C",
        help="ray: CPUs each run reserves (default 1)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    options = EngineOptions(
        engine=getattr(args, "engine", "local"),
        retries=getattr(args, "retries", 2),
        jobs=getattr(args, "jobs", None),
        address=getattr(args, "address", None),
        gpus_per_run=getattr(args, "gpus_per_run", None),
        cpus_per_run=getattr(args, "cpus_per_run", 1),
    )
    if options.retries < 0:
        raise EngineUnavailable(f"--retries {options.retries}: give 0 or more")
    if options.jobs is not None and options.jobs < 1:
        raise EngineUnavailable(f"--jobs {options.jobs}: give 1 or more")
    if options.engine != "ray" and (options.address or options.gpus_per_run is not None):
        raise EngineUnavailable("--address and --gpus-per-run are Ray options: add --engine ray")
    if options.engine != "local" and options.jobs is not None:
        raise EngineUnavailable("--jobs is a local-engine option: Ray fills the cluster itself")
    return options


# Starting one attempt gives a future of its Attempt; an engine is a context manager around that.
Start = Callable[[Job, int], "concurrent.futures.Future[Attempt]"]


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` entries (that variable wins when set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        return [] if ids[:1] == ["-1"] else ids
    import torch  # counts devices through NVML without creating a CUDA context

    return [str(i) for i in range(torch.cuda.device_count())]


class LocalEngine:
    """A pool of ``jobs`` runs at a time; with GPUs each run sees one (``CUDA_VISIBLE_DEVICES``),
    slots taking the GPUs in turn, so ``--jobs`` above the GPU count shares GPUs; without, the
    runs share the cores (``OMP_NUM_THREADS``)."""

    def __init__(self, options: EngineOptions, say: Callable[[str], None] = print) -> None:
        gpus = visible_gpus()
        slots = options.jobs or max(1, len(gpus))
        self._devices: queue.Queue[str | None] = queue.Queue()
        for slot in range(slots):
            self._devices.put(gpus[slot % len(gpus)] if gpus else None)
        # Parallel CPU runs split the cores (as Ray does), unless the user set the thread count.
        self._threads = None
        if not gpus and slots > 1 and "OMP_NUM_THREADS" not in os.environ:
            self._threads = str(max(1, (os.cpu_count() or 1) // slots))
        self._pool = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="sweep-run")
        where = f"GPUs {','.join(gpus)}" if gpus else "CPU"
        say(f"engine local: {plural(slots, 'run')} at a time on {where}")

    def _attempt(self, job: Job, attempt: int) -> Attempt:
        device = self._devices.get()
        try:
            env = dict(os.environ)
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            if self._threads:
                env["OMP_NUM_THREADS"] = self._threads
            return execute(job, attempt, env)
        finally:
            self._devices.put(device)

    def start(self, job: Job, attempt: int) -> concurrent.futures.Future[Attempt]:
        return self._pool.submit(self._attempt, job, attempt)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayEngine:
    """Each attempt is a Ray task reserving ``gpus_per_run`` GPUs, which runs the command as a
    subprocess on its node (Ray sets that node's ``CUDA_VISIBLE_DEVICES``). ``max_retries``
    makes Ray resubmit a task whose worker or node died."""

    def __init__(self, options: EngineOptions, say: Callable[[str], None] = print) -> None:
        try:
            import ray
        except ImportError:
            raise EngineUnavailable(RAY_MISSING) from None
        self._ray = ray
        self._owns_connection = not ray.is_initialized()  # a caller's (a test's) Ray stays up
        if self._owns_connection:
            try:
                ray.init(address=options.address)
            except ConnectionError as err:
                raise EngineUnavailable(
                    f"no Ray cluster at --address {options.address or '(default)'}: {err} "
                    "(start one with `ray start --head`, or check the address)"
                ) from None
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        gpus = options.gpus_per_run
        if gpus is None:
            gpus = 1 if cluster_gpus else 0
            if not cluster_gpus:
                say("engine ray: the cluster has no GPU, so each run takes CPUs only")
        elif gpus > cluster_gpus:
            self.close()
            raise EngineUnavailable(
                f"--gpus-per-run {gpus:g}: the Ray cluster has {plural(cluster_gpus, 'GPU')}; "
                "start workers with GPUs or pass --gpus-per-run 0"
            )
        cpus = options.cpus_per_run
        self._task = ray.remote(execute).options(
            num_gpus=gpus, num_cpus=cpus, max_retries=options.retries
        )
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        say(
            f"engine ray: {plural(nodes, 'node')}, {plural(cluster_gpus, 'GPU')}; each run takes "
            f"{plural(gpus, 'GPU')} and {plural(cpus, 'CPU')}"
        )

    def start(self, job: Job, attempt: int) -> concurrent.futures.Future[Attempt]:
        return self._task.remote(job, attempt).future()

    def close(self) -> None:
        if self._owns_connection:
            self._ray.shutdown()


def create_engine(options: EngineOptions, say: Callable[[str], None] = print):
    if options.engine == "ray":
        return RayEngine(options, say)
    if options.engine == "local":
        return LocalEngine(options, say)
    raise EngineUnavailable(f"--engine {options.engine!r}: choose one of {', '.join(ENGINES)}")


def run_jobs(
    jobs: Sequence[Job], engine: Any, retries: int, say: Callable[[str], None] = print
) -> list[int]:
    """Every job through ``engine`` (all submitted at once; the engine bounds concurrency), each
    failure run again up to ``retries`` times; returns the last exit code of each job."""
    codes: dict[int, int] = {}
    started = time.monotonic()
    pending: dict[concurrent.futures.Future[Attempt], tuple[int, int]] = {}
    for index, job in enumerate(jobs):
        pending[engine.start(job, 1)] = (index, 1)
    while pending:
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            index, attempt = pending.pop(future)
            job = jobs[index]
            try:
                result = future.result()
                code, where = result.exit_code, f"{result.seconds:.0f} s on {result.host}"
            except Exception as err:  # the engine lost the task (Ray: died on every try)
                code, where = LOST, f"{type(err).__name__}: {err}"
            if code != 0 and code != USAGE_ERROR and attempt <= retries:
                say(f"    {job.name}: failed (exit {code}, {where}); retry {attempt}/{retries}")
                pending[engine.start(job, attempt + 1)] = (index, attempt + 1)
                continue
            codes[index] = code
            outcome = "done" if code == 0 else f"failed (exit {code}); log: {job.log}"
            # The whole sweep's progress, with an ETA at the pace so far.
            sweep = progress_line(
                "sweep", len(codes), len(jobs), time.monotonic() - started, "runs"
            )
            say(f"    {job.name}: {outcome} ({where}) [{sweep}]")
    return [codes[index] for index in range(len(jobs))]
