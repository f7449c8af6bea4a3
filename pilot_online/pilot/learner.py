"""``OnlineLearner``: PILOT's ``BaseLearner`` with ``incremental_train`` replaced by one pass over a
stream segment. Imported only when PILOT builds a learner (``registry.create_learner``).

PILOT's trainer still calls ``incremental_train``, ``eval_task`` and ``after_task`` once per task:
each call consumes the next segment of a stream built once from the DataManager's raw arrays. The
model never learns where segments end: no prompt masks, no prompt freezing or copying, no
``process_task_count``, no optimizer reset. Segment ends only decide when to evaluate.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from models.base import BaseLearner  # PILOT: this module is imported lazily
from torch import nn

from ..core.metrics import run_summary_line
from ..core.results import results_path
from ..core.streams import build_stream
from ..engine.adapter import MethodAdapter
from ..engine.checkpoint import CompletedRun, checkpoint_path_for, completed_results
from ..engine.checkpointer import RunInterrupted
from ..engine.config import resolve_config
from ..engine.mixins import build_loop
from ..engine.registry import get_method
from ..engine.session import OnlineSession, unique_results_path
from .attention import use_sdpa
from .backbones import run_overrides
from .data import PilotDataSource

logger = logging.getLogger(__name__)
#: The run's closing line (AP, named beside PILOT's other average), on a logger of its own: under
#: PILOT's main.py it reaches PILOT's handlers as every INFO line does; ``pilot-online run``, which
#: logs warnings only, shows this one on stdout (``show_run_summary``), as PILOT prints its line.
summary_logger = logging.getLogger(f"{__name__}.summary")


def show_run_summary() -> None:
    """Send the closing line to stdout when nothing at INFO would show it."""
    if summary_logger.isEnabledFor(logging.INFO) or summary_logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    summary_logger.addHandler(handler)
    summary_logger.setLevel(logging.INFO)
    summary_logger.propagate = False


def pilot_log_dir(args: dict[str, Any]) -> Path:
    """The folder PILOT's trainer logs this run into (``trainer._train``)."""
    init_cls = 0 if args["init_cls"] == args["increment"] else args["init_cls"]
    return Path("logs", args["model_name"], args["dataset"], str(init_cls), str(args["increment"]))


def parameter_counts_only(results: dict[str, Any]) -> nn.Module:
    """A stand-in network for a seed that is not trained again: PILOT's trainer logs "All
    params" and "Trainable params" of ``_network`` at every task, and these must be the stored
    run's, not 0. Its two parameters are on the meta device (no memory) and hold the counts."""
    counters = results.get("counters", {})
    trainable = int(counters.get("trainable_parameters", 0))
    total = int(counters.get("parameters", trainable))
    network = nn.Module()
    network.frozen = nn.Parameter(torch.empty(total - trainable, device="meta"), False)
    network.trainable = nn.Parameter(torch.empty(trainable, device="meta"))
    return network


class OnlineLearner(BaseLearner):
    """A PILOT learner that trains one method adapter online, with the configured mixins."""

    def __init__(self, args: dict[str, Any], adapter_cls: type[MethodAdapter]) -> None:
        super().__init__(args)
        self.config = resolve_config(args)
        self.topk = 5
        self.session: OnlineSession | CompletedRun | None = None
        directory = Path(self.config["results_dir"] or pilot_log_dir(self.config))
        path = results_path(
            directory, self.config["prefix"], self.config["seed"], self.config["backbone_type"]
        )
        # PILOT runs every seed of a config in this process: a seed whose results are complete
        # for this config is not trained again (nor its network built); its stored evaluations
        # go back to PILOT's trainer. An interrupted seed resumes from its checkpoint.
        self.completed = completed_results(path, self.config)
        if self.completed is not None:
            logger.warning(
                "seed %s: results complete for this config at %s; not training it again",
                self.config["seed"],
                path,
            )
            self.results_path = path
            self._network = parameter_counts_only(self.completed)
            return
        if len(self._multiple_gpus) > 1:
            logger.warning("online learners use one device: training on %s only", self._device)
        self.adapter = adapter_cls(args=self.config)
        self.loop = self._build_loop(self.config, self.adapter)
        self._network = self.loop.network
        # The checkpoint's name is fixed by the config, so rerunning the command finds it; the
        # results file gets a timestamped name only if a finished run already wrote there.
        self.checkpoint_path = checkpoint_path_for(path)
        self.results_path = unique_results_path(path)
        logger.info(
            "online learner %s, trainable: %s",
            type(self.loop).__name__,
            {n: p.numel() for n, p in self.loop.named_parameters},
        )

    def _build_loop(self, config: dict[str, Any], adapter: MethodAdapter | None = None):
        """The network of ``config``'s method (PILOT's backbone, the adapter's head) in its
        online loop, on this learner's device. Also what ``realtime: "measured"`` times a
        fresh copy of the method and of the reference method with (``OnlineSession``)."""
        if adapter is None:
            adapter = get_method(config["model_name"])(args=config)
        with run_overrides(config):
            network = adapter.build_network(config)
        if config["sdpa"]:
            use_sdpa(network)
        return build_loop(adapter, network, config, config["nb_classes"], self._device)

    def _start(self, data_manager) -> OnlineSession | CompletedRun:
        """Build the whole stream once, from the DataManager's remapped labels and class order
        (for a seed whose results are complete: the stand-in that hands them back)."""
        if self.completed is not None:
            return CompletedRun(self.results_path, self.completed)
        cfg = self.config
        labels = data_manager._train_targets
        classes = list(range(data_manager.nb_classes))  # labels are positions in the class order
        # The stream kind reads its own config keys; the trainer fixes the number of segments.
        stream = build_stream(
            cfg["stream"], labels, classes, config=cfg, num_tasks=data_manager.nb_tasks
        )
        for summary in stream.summary():
            logger.info("stream segment %s", summary.to_dict())
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        data = PilotDataSource(data_manager, cfg, seed=cfg["seed"])
        return OnlineSession(
            self.loop,
            stream,
            data,
            cfg,
            self.results_path,
            checkpoint_path=self.checkpoint_path,
            loop_factory=self._build_loop,
        )

    def incremental_train(self, data_manager) -> None:
        """Train on the next segment. The first call builds the session, which resumes from the
        run's checkpoint if there is one: segments completed before it are then skipped."""
        self._cur_task += 1
        self.data_manager = data_manager
        if self.session is None:
            self.session = self._start(data_manager)
        try:
            self.session.train_task(self._cur_task)
        except RunInterrupted:
            raise  # checkpointed, and said so: no partial results to write
        except BaseException as err:
            self.session.write(status="failed", error=f"{type(err).__name__}: {err}")
            raise
        if self.completed is None:
            self._total_classes = int(self.loop.seen.sum())

    def eval_task(self):
        try:
            cnn_accy = self.session.complete_task(self._cur_task)
        except RunInterrupted:
            raise
        except BaseException as err:
            self.session.write(status="failed", error=f"{type(err).__name__}: {err}")
            raise
        logger.info(
            "accuracy after task %d of %d: %s",
            self._cur_task + 1,
            self.data_manager.nb_tasks,
            cnn_accy["grouped"],
        )
        if self._cur_task == self.data_manager.nb_tasks - 1:
            results = self.session.finish()
            # PILOT's trainer logs its "Average Accuracy (CNN)" right after: say which is which.
            summary_logger.info(
                "%s", run_summary_line(results["metrics"], self.session.written_path)
            )
        return cnn_accy, None

    def after_task(self) -> None:
        self._known_classes = self._total_classes
