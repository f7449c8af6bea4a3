"""Runs PILOT's ``main.py`` in the current directory (a patched PILOT checkout) with probes.

Used by test_pilot_integration.py (and through it test_contract.py) as
``python pilot_driver.py CONFIG REPORT_JSON [CONFIG REPORT_JSON ...]``: one ``main.py`` run per
pair, in turn, in one process (torch, timm and PILOT are imported once). The probes record every
task-boundary hook of upstream PILOT that online training must never call, every ``task_id``
that reaches a prompt network, which parameters and buffers changed during the run, and which
parameters form the adapter's classifier.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback

import torch

runs = list(zip(sys.argv[1::2], sys.argv[2::2], strict=True))
sys.path.insert(0, os.getcwd())

import backbone.prompt  # noqa: E402  (PILOT)
import models.dualprompt  # noqa: E402
import models.l2p  # noqa: E402
import utils.inc_net  # noqa: E402

import pilot_online.pilot.learner  # noqa: E402

report: dict = {}


def record_call(owner, name):
    original = getattr(owner, name)

    def probe(self, *args, **kwargs):
        report["boundary_calls"].append(f"{owner.__name__}.{name}")
        return original(self, *args, **kwargs)

    setattr(owner, name, probe)


record_call(backbone.prompt.CodaPrompt, "process_task_count")
record_call(models.l2p.Learner, "_init_prompt")
record_call(models.dualprompt.Learner, "_init_prompt")

prompt_forward = utils.inc_net.PromptVitNet.forward


def forward_probe(self, x, task_id=-1, train=False):
    if task_id not in report["task_ids"]:
        report["task_ids"].append(task_id)
    return prompt_forward(self, x, task_id=task_id, train=train)


utils.inc_net.PromptVitNet.forward = forward_probe

Learner = pilot_online.pilot.learner.OnlineLearner
learner_init, learner_eval = Learner.__init__, Learner.eval_task
initial: dict[str, torch.Tensor] = {}
initial_buffers: dict[str, torch.Tensor] = {}


def init_probe(self, args, adapter_cls):
    learner_init(self, args, adapter_cls)
    initial.update({n: p.detach().clone() for n, p in self._network.named_parameters()})
    head = {id(p) for p in self.adapter.classifier(self._network).parameters()}
    report["classifier"] = [n for n, p in self._network.named_parameters() if id(p) in head]
    initial_buffers.update({n: b.detach().clone() for n, b in self._network.named_buffers()})


def eval_probe(self):
    report["learner_calls"].append("eval_task")
    result = learner_eval(self)
    report["changed"] = {
        name: {
            "trainable": p.requires_grad,
            # A parameter added at a firing (a new adapter) did not exist at the start.
            "changed": name not in initial or not torch.equal(initial[name], p.detach()),
        }
        for name, p in self._network.named_parameters()
    }
    report["buffers_changed"] = {
        name: not torch.equal(initial_buffers[name], b.detach())
        for name, b in self._network.named_buffers()
        if name in initial_buffers
    }
    report["results_path"] = str(self.session.written_path or "")
    return result


Learner.__init__, Learner.eval_task = init_probe, eval_probe

failed = False
for config_path, report_path in runs:
    report.clear()  # each run's own record
    report.update(boundary_calls=[], task_ids=[], changed={}, learner_calls=[])
    initial.clear()
    initial_buffers.clear()
    sys.argv = ["main.py", "--config", config_path]
    try:
        runpy.run_path("main.py", run_name="__main__")
    except (Exception, SystemExit):  # recorded for this run; the next runs still run
        report["error"] = traceback.format_exc()
        failed = True
    with open(report_path, "w") as handle:
        json.dump(report, handle)
    gc.collect()
sys.exit(1 if failed else 0)
