"""Alpha against the clamp: ``core/fgh_stats.AlphaStream`` watching FGH, and FGHMixin's report.

Expected numbers are worked by hand from Eq. 8 (alpha <- clamp(alpha + gamma * g_t * g_{t-1}))
on gradients chosen so that coefficients reach the bounds on known steps.
"""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch
from test_loop import BASE_CONFIG, make_data, make_loop, make_stream

from pilot_online.core.fgh import FineGrainedHypergradients
from pilot_online.core.fgh_stats import AlphaStream

# Element-wise, raw gradients, gamma 1, clamp (0, 2), one parameter of 4 scalars:
#   step 1: g1 = [1, 1, 1, -1]    first step, alpha stays [1, 1, 1, 1]
#           mean 1,     at lo 0/4, at hi 0/4
#   step 2: g2 = [2, -2, .5, 1]   h = g2 * g1 = [2, -2, .5, -1]
#           alpha = clamp([3, -1, 1.5, 0]) = [2, 0, 1.5, 0]
#           mean 3.5/4, at lo 2/4, at hi 1/4
#   step 3: g3 = [1, 1, 1, 1]     h = g3 * g2 (the raw g2) = [2, -2, .5, 1]
#           alpha = clamp([4, -2, 2, 1]) = [2, 0, 2, 1]
#           mean 5/4,   at lo 1/4, at hi 2/4
GRADS = [[1.0, 1.0, 1.0, -1.0], [2.0, -2.0, 0.5, 1.0], [1.0, 1.0, 1.0, 1.0]]
MEANS, AT_LO, AT_HI = [1.0, 0.875, 1.25], [0.0, 0.5, 0.25], [0.0, 0.25, 0.5]
MAXES = [1.0, 2.0, 2.0]  # the largest alpha after each step (and so far: it never falls here)
# The same steps with no upper bound (clamp (0, None), the paper's alpha >= 0 only):
#   step 2: alpha = clamp_min([3, -1, 1.5, 0]) = [3, 0, 1.5, 0]    mean 4.5/4, at lo 2/4, max 3
#   step 3: alpha = clamp_min([5, -2, 2, 1]) = [5, 0, 2, 1]        mean 8/4,   at lo 1/4, max 5
UNBOUNDED = {"mean": [1.0, 1.125, 2.0], "at_lo": [0.0, 0.5, 0.25], "max": [1.0, 3.0, 5.0]}


def element_fgh(foreach: bool | None = None) -> tuple[AlphaStream, torch.Tensor]:
    """An element-wise FGH over one parameter of 4 scalars, watched by an AlphaStream."""
    p = torch.nn.Parameter(torch.zeros(4))
    fgh = FineGrainedHypergradients([("w", p)], gamma=1.0, clamp=(0.0, 2.0), foreach=foreach)
    return AlphaStream(fgh), p


def take_steps(stream: AlphaStream, p: torch.Tensor, grads: list[list[float]]) -> None:
    """FGH steps on these gradients, each observed (as FGHMixin does after every step)."""
    for g in grads:
        p.grad = torch.tensor(g)
        stream.fgh.step()
        stream.observe()


def numbers(bounds: list[dict]) -> list[dict]:
    """alpha_bounds with its 0-d tensors read as floats."""
    return [
        {
            **b,
            "final": {k: float(v) for k, v in b["final"].items()},
            "stream": {k: float(v) for k, v in b["stream"].items()},
        }
        for b in bounds
    ]


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_fractions_at_the_bounds_equal_the_hand_values(foreach, steps) -> None:
    stream, p = element_fgh(foreach)
    take_steps(stream, p, GRADS[:steps])
    (bounds,) = numbers(stream.bounds())
    assert bounds["clamp"] == [0.0, 2.0]
    assert bounds["coefficients"] == 4
    last = steps - 1
    assert bounds["final"] == {
        "mean": MEANS[last],
        "at_lo": AT_LO[last],
        "at_hi": AT_HI[last],
        "max": MAXES[last],
    }
    stream = bounds["stream"]
    assert stream["max"] == max(MAXES[:steps])
    assert stream["steps"] == steps
    assert stream["mean"] == pytest.approx(sum(MEANS[:steps]) / steps, abs=1e-15)
    assert stream["at_lo"] == pytest.approx(sum(AT_LO[:steps]) / steps, abs=1e-15)
    assert stream["at_hi"] == pytest.approx(sum(AT_HI[:steps]) / steps, abs=1e-15)


@pytest.mark.parametrize("foreach", [True, False])
def test_no_upper_bound_reports_none_at_it_and_the_largest_alpha(foreach) -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    fgh = FineGrainedHypergradients([("w", p)], gamma=1.0, clamp=(0.0, None), foreach=foreach)
    stream = AlphaStream(fgh)
    for step, g in enumerate(GRADS):
        take_steps(stream, p, [g])
        (bounds,) = numbers(stream.bounds())
        assert bounds["clamp"] == [0.0, None]
        assert bounds["final"] == {
            "mean": UNBOUNDED["mean"][step],
            "at_lo": UNBOUNDED["at_lo"][step],
            "at_hi": 0.0,
            "max": UNBOUNDED["max"][step],
        }
        assert bounds["stream"]["max"] == UNBOUNDED["max"][step]
    assert bounds["stream"]["mean"] == pytest.approx(sum(UNBOUNDED["mean"]) / 3, abs=1e-15)


def test_the_stream_averages_are_nan_before_the_first_step() -> None:
    stream, _ = element_fgh()
    (bounds,) = numbers(stream.bounds())
    # alphas start at 1
    assert bounds["final"] == {"mean": 1.0, "at_lo": 0.0, "at_hi": 0.0, "max": 1.0}
    assert bounds["stream"]["steps"] == 0
    assert math.isnan(bounds["stream"]["mean"])


def test_class_granularity_counts_one_coefficient_per_class() -> None:
    # Classifier of 3 classes on 2 features, gamma 1, clamp (0.5, 3). Class c's hypergradient is
    # its weight row's product summed with its bias entry's:
    #   step 1: first step, alpha [1, 1, 1]
    #   step 2: class 0: 1*1 + 1*1 + 1*1 = 3    -> 4 -> 3 (hi)
    #           class 1: (-1)*1 + 0 + 0 = -1    -> 0 -> 0.5 (lo)
    #           class 2: 0                       -> 1
    #   final: mean 4.5/3 = 1.5, at lo 1/3, at hi 1/3; stream mean (1 + 1.5) / 2
    weight = torch.nn.Parameter(torch.zeros(3, 2))
    bias = torch.nn.Parameter(torch.zeros(3))
    fgh = FineGrainedHypergradients(
        [("fc.weight", weight), ("fc.bias", bias)], gamma=1.0, granularity="class", clamp=(0.5, 3)
    )
    stream = AlphaStream(fgh)
    g_weight = [torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])] * 2
    g_weight[1] = torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]])
    g_bias = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])]
    for gw, gb in zip(g_weight, g_bias):
        weight.grad, bias.grad = gw.clone(), gb.clone()
        fgh.step()
        stream.observe()
    assert torch.equal(fgh.state[weight]["alpha"], torch.tensor([3.0, 0.5, 1.0]))
    (bounds,) = numbers(stream.bounds())
    assert bounds["coefficients"] == 3
    assert bounds["final"]["mean"] == pytest.approx(1.5, abs=1e-15)
    assert bounds["final"]["at_lo"] == pytest.approx(1 / 3, abs=1e-15)
    assert bounds["final"]["at_hi"] == pytest.approx(1 / 3, abs=1e-15)
    assert bounds["stream"]["mean"] == pytest.approx(1.25, abs=1e-15)
    assert bounds["stream"]["at_hi"] == pytest.approx(1 / 6, abs=1e-15)


def test_a_coefficient_without_a_gradient_yet_counts_as_its_starting_one() -> None:
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    stream = AlphaStream(FineGrainedHypergradients([("a", a), ("b", b)], gamma=1.0, clamp=(0, 2)))
    take_steps(stream, a, GRADS[:2])  # b never gets a gradient: 4 alphas of 1
    (bounds,) = numbers(stream.bounds())
    assert bounds["coefficients"] == 8
    assert bounds["final"] == {"mean": (3.5 + 4) / 8, "at_lo": 2 / 8, "at_hi": 1 / 8, "max": 2.0}


def _saved(stream: AlphaStream) -> dict:
    """FGH's state and the stream's, as FGHMixin checkpoints them (the stream beside FGH's)."""
    return copy.deepcopy({"fgh": stream.fgh.state_dict(), "alpha_stream": stream.state_dict()})


def _load(stream: AlphaStream, saved: dict) -> None:
    stream.fgh.load_state_dict(saved["fgh"])
    stream.load_state_dict(saved.get("alpha_stream"))


def test_state_dict_round_trip_continues_the_stream_averages_exactly() -> None:
    straight, p = element_fgh()
    take_steps(straight, p, GRADS)
    first, q = element_fgh()
    take_steps(first, q, GRADS[:2])
    saved = _saved(first)
    resumed, r = element_fgh()
    _load(resumed, saved)
    take_steps(resumed, r, GRADS[2:])
    assert numbers(resumed.bounds()) == numbers(straight.bounds())
    assert torch.equal(resumed.sums, straight.sums)


def test_an_older_state_dict_without_the_sums_loads_with_a_warning(caplog) -> None:
    first, q = element_fgh()
    take_steps(first, q, GRADS[:2])
    saved = _saved(first)
    del saved["alpha_stream"]
    resumed, _ = element_fgh()
    with caplog.at_level(logging.WARNING):
        _load(resumed, saved)
    assert "alpha_stream" in caplog.text
    assert resumed.steps == 0


def test_a_state_dict_with_misshaped_sums_is_refused() -> None:
    first, q = element_fgh()
    take_steps(first, q, GRADS[:1])
    saved = _saved(first)
    saved["alpha_stream"]["sums"] = torch.zeros(2, 3, dtype=torch.float64)
    resumed, _ = element_fgh()
    with pytest.raises(ValueError, match=r"alpha_stream\['sums'\] has shape \(2, 3\)"):
        _load(resumed, saved)


def test_a_group_added_later_gets_its_own_row() -> None:
    stream, p = element_fgh()
    extra = torch.nn.Parameter(torch.zeros(2))
    stream.fgh.add_param_group({"params": [("extra", extra)], "clamp": (0.0, 1.0)})
    take_steps(stream, p, GRADS[:2])
    first, second = numbers(stream.bounds())
    assert first["final"]["at_lo"] == 0.5
    # The added group's 2 alphas never moved and start at 1, its upper bound.
    assert second["clamp"] == [0.0, 1.0]
    assert second["final"] == {"mean": 1.0, "at_lo": 0.0, "at_hi": 1.0, "max": 1.0}
    assert second["stream"]["at_hi"] == 1.0 and second["stream"]["max"] == 1.0


def test_the_loop_report_averages_the_fractions_over_the_stream() -> None:
    """FGHMixin.report: the stream averages equal fractions recomputed from every step's alphas
    (read on the host after each step, which the accumulator itself never does)."""
    train_x, train_y, _, _ = make_data()
    clamp = (0.95, 1.05)  # tight, so that coefficients reach both bounds in 8 steps
    loop = make_loop({**BASE_CONFIG, "fgh": {"gamma": 10.0, "clamp": list(clamp)}})
    labels = torch.as_tensor(train_y)
    per_step = []
    for batch in make_stream(train_y).batches():
        index = torch.from_numpy(np.array(batch.indices))
        loop.train_step(train_x[index], labels[index])
        # float32 alphas: a bound is compared in that dtype (0.95 is not a float32 value).
        alphas = torch.cat([a.reshape(-1) for a in loop.fgh.coefficients().values()])
        per_step.append(
            [
                alphas.double().mean().item(),
                (alphas == clamp[0]).double().mean().item(),
                (alphas == clamp[1]).double().mean().item(),
            ]
        )
    hand = np.mean(per_step, axis=0)
    (report,) = loop.report()["fgh"]["alpha_bounds"]
    assert report["clamp"] == list(clamp)
    assert report["stream"]["steps"] == len(per_step) == 8
    assert report["stream"]["mean"] == pytest.approx(hand[0], rel=1e-6)  # float32 sums
    assert report["stream"]["at_lo"] == pytest.approx(hand[1], rel=1e-12)
    assert report["stream"]["at_hi"] == pytest.approx(hand[2], rel=1e-12)
    assert report["final"]["at_lo"] == pytest.approx(per_step[-1][1], rel=1e-12)
    assert report["final"]["at_hi"] == pytest.approx(per_step[-1][2], rel=1e-12)
    assert hand[1] > 0 and hand[2] > 0  # both bounds were reached: the test is not trivial
    assert all(isinstance(v, float) for v in report["final"].values())  # JSON-ready numbers


def test_the_proxy_benchmark_writes_results_that_fig3_draws_by_form(tmp_path) -> None:
    """benchmarks/fgh_proxy.py on a tiny problem: its results files load, and Fig. 3's data has
    one panel per FGH form (the paper configs' first) and the clamp panels below them."""
    pytest.importorskip("matplotlib", reason="figures need matplotlib")
    import subprocess
    import sys
    from pathlib import Path

    from pilot_online.harness import figures

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "fgh_proxy.py"
    tiny = ["--classes", "4", "--tasks", "2", "--dim", "8", "--train-per-class", "10"]
    tiny += ["--test-per-class", "4", "--batch", "5", "--seeds", "1", "--sweep-seeds", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *tiny, "--gamma-sweep", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "| + P + FGH | nobound_g1 |" in done.stdout and "| clamp10 | 10 |" in done.stdout
    # 4 cells x (base, + P, 2 rows x 6 FGH settings); sweep: + P, 3 forms x 8 gammas.
    assert len(list((tmp_path / "table").glob("*.results.json"))) == 4 * 14
    runs = figures.load_runs([tmp_path / "gamma"])
    assert len(runs) == 1 + 3 * 8
    data = figures.gamma_sensitivity_data(runs)
    forms = [
        figures.FORM_TITLES["appendix"] + " (paper configs)",
        figures.FORM_TITLES["eq8"],
        figures.FORM_TITLES["appendix_clamp10"],
    ]
    # the paper's form has no upper bound: below it, its final alpha; below the others, the
    # fraction at their bound
    lower = [figures.ALPHA_PANEL + forms[0]] + [figures.CLAMP_PANEL + t for t in forms[1:]]
    assert list(data.panels) == forms + lower
    (final,) = data.panels[lower[0]]
    assert np.all(final.y >= 0)
    (bounds,) = data.panels[lower[2]]
    assert np.all((bounds.y >= 0) & (bounds.y <= 1))


def test_every_fgh_paper_config_runs_paper_fgh() -> None:
    """scripts/make_exps.py, over every registered method: every "+ FGH" and "+ ours" config
    (variants fgh_only and fgh, both streams, smoke configs included) writes ``PAPER_FGH``: the
    appendix algorithm at the paper's gamma 1 with only alpha >= 0; the other named forms are one
    config each, on CODA."""
    from conftest import make_exps

    from pilot_online.engine.config import FGH_FORMS, PAPER_FGH, VARIANTS, variant_of
    from pilot_online.engine.registry import method_card
    from pilot_online.harness.scale.grid import runs as scale_runs

    assert PAPER_FGH == {
        "gamma": 1.0,
        "granularity": "class",
        "direction": "adam",
        "apply": "grad",
        "clamp": [0.0, None],
    }
    exps = make_exps()
    # The scale model's grid asks FGH's other forms on purpose (gamma sweep, granularities,
    # SGD): its runs that set FGH options are left out (pilot_online/harness/scale/grid.py).
    tagged = {f"scale/{r.name}.json" for r in scale_runs() if r.fgh}
    configs = {n: c for n, c in exps.all_configs().items() if n not in tagged}
    others = {f"coda_online_fgh_{name}.json": form for name, form in FGH_FORMS.items()}
    del others["coda_online_fgh_appendix.json"]  # PAPER_FGH itself
    for name, form in others.items():
        assert configs.pop(name)["fgh"] == form
    expected = {
        f"{short}_online_{variant}{suffix}.json"
        for short in exps.short_names()
        for variant in ("fgh_only", "fgh")
        if variant in method_card(exps.model_name(short)).variants
        for suffix in ("", "_blurry")
    }
    with_fgh = {n for n, c in configs.items() if variant_of(c) in ("fgh_only", "fgh")}
    assert expected and expected <= with_fgh
    assert all(configs[n]["fgh"] == PAPER_FGH for n in with_fgh), with_fgh
    assert VARIANTS["fgh"]["fgh"] == VARIANTS["fgh_only"]["fgh"] == PAPER_FGH
