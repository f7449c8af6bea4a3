"""A run's results file: everything the session's listeners measured, in the results schema
(``core/results.py``), and the gradient trace beside it.

A finished run writes ``<name>.results.json`` and never overwrites one; a failed or stopped run
writes ``<name>.partial.results.json``, which a later attempt replaces.
"""

from __future__ import annotations

import io
import logging
import platform
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..core import metrics
from ..core.files import write_atomic
from ..core.lazy import torch
from ..core.results import build_results, to_jsonable, write_results
from .events import RunListener, peak_memory_bytes

logger = logging.getLogger(__name__)


def run_environment(device: Any) -> dict[str, Any]:
    """What a run's numbers depend on beyond its config and code: the library versions, the
    CPU's intra-op thread count (a reduction's order follows it, so on the CPU another count
    changes the last bits, and FGH can grow them: ``docs/gpu.md``) and the accelerator."""

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.version.__version__,
        "numpy": np.__version__,
        "timm": version("timm"),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


class ResultsFile(RunListener):
    """Builds and writes the results of ``session`` (its loop, stream, evaluations, A_online,
    real-time schedule, clock and counters)."""

    def __init__(self, session: Any, path: Path | None) -> None:
        """``session``: the ``OnlineSession`` whose results these are (not imported: it imports
        this module)."""
        # Weakly: the session holds this object, and a strong reference back would make a cycle
        # that keeps the network alive until the garbage collector runs.
        self._session = weakref.ref(session)
        self.path = path
        #: Where the results went (None before a write, or without a path).
        self.written: Path | None = None

    @property
    def session(self) -> Any:
        return self._session()

    def results(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Everything the run measured, in the results schema (``core/results.py``)."""
        session = self.session
        loop, evaluator, scoring, clock = (
            session.loop,
            session.evaluator,
            session.scoring,
            session.clock,
        )
        history = np.stack(evaluator.class_history) if evaluator.class_history else None
        summary = evaluator.summary(online=scoring.counts())
        gradients = loop.gradient_statistics()
        diagnostics = loop.report()
        task_classes = [s.new_classes for s in session.stream.summary()]
        g, g_n = metrics.task_gradient_norms(gradients["mean"], task_classes)
        imbalance = {
            "class_mean_grad_norm": gradients["mean"],
            "task_grad_norm": g,
            "task_grad_norm_normalized": g_n,
        }
        if "trace" in gradients:  # G^k per step (paper Fig. 2), 4 significant digits: compact
            per_step = metrics.task_gradient_trace(gradients["trace"], task_classes)
            imbalance["task_grad_norm_trace"] = [
                [float(f"{v:.4g}") for v in row] for row in per_step
            ]
        config = {k: (str(v) if k == "device" else v) for k, v in session.config.items()}
        realtime = None
        if scoring.realtime is not None:
            realtime = scoring.report(
                session.batches_trained, session.batches_skipped, len(session.stream_batches)
            )
        results = build_results(
            config=to_jsonable(config),
            stream=session.stream.to_dict(),
            metrics=summary,
            timing={
                "train_seconds": clock.train_seconds,
                "eval_seconds": clock.eval_seconds,
                "online_eval_seconds": clock.online_seconds,
                "samples_per_second": loop.samples_seen / clock.train_seconds
                if clock.train_seconds
                else None,
                "peak_memory_bytes": peak_memory_bytes(loop.device),
            },
            counters={
                "optimizer_steps": loop.optimizer_steps,
                "samples_seen": loop.samples_seen,
                "online_scored_samples": scoring.samples,
                # Stream batches a step trained on, and those that passed scored only
                # (real-time mode; 0 otherwise).
                "batches_trained": session.batches_trained,
                "batches_skipped": session.batches_skipped,
                "stream_length": len(session.stream),
                "tasks_trained": session.tasks_trained,
                "skipped_nonfinite_steps": loop.skipped_nonfinite_steps,
                "trainable_parameters": sum(p.numel() for _, p in loop.named_parameters),
                "parameters": sum(p.numel() for p in loop.network.parameters()),
                "skipped_nonfinite_hypergradients": diagnostics.get("fgh", {}).get(
                    "skipped_nonfinite", 0
                ),
            },
            environment=run_environment(loop.device),
            extra={
                **({"resumed_from": session.resumed_from} if session.resumed_from else {}),
                **({"realtime": realtime} if realtime is not None else {}),
                "periodic_evaluations": evaluator.periodic,
                # PILOT's cnn_accy of each task: what a rerun hands back for a finished seed.
                "task_reports": evaluator.task_reports,
                "per_class_final_accuracy": history[-1] if history is not None else None,
                "gradient_imbalance": imbalance,
                "diagnostics": diagnostics,
            },
        )
        results["status"] = status
        if error:
            results["error"] = error
        return to_jsonable(results)

    def write(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Write the results (and the gradient trace beside them); partial runs go to
        ``*.partial``. Returns the results; :attr:`written` is where they went."""
        results = self.results(status, error)
        if self.path is None:
            return results
        path = self.path
        if status != "complete":
            path = path.with_name(path.name.replace(".results.json", ".partial.results.json"))
        elif path.exists():  # before the trace: a refused write must not replace its sidecar
            raise FileExistsError(
                f"results file {path} already exists; refusing to overwrite a finished run's "
                "results and gradient trace. Use another prefix/log_dir or delete the file."
            )
        trace = self.session.loop.gradient_statistics().get("trace")
        if trace is not None:
            trace_path = path.with_name(path.name.replace(".json", ".gradtrace.npy"))
            buffer = io.BytesIO()
            np.save(buffer, trace.astype(np.float32))
            write_atomic(trace_path, buffer.getvalue())
            results["extra"]["gradient_imbalance"]["trace_file"] = trace_path.name
        write_results(path, results, overwrite=status != "complete")
        self.written = path
        logger.info("results written to %s", path)
        return results
