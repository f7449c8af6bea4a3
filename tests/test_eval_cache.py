"""The evaluation query cache (issue 10): the frozen query pass runs once per test image.

With PILOT: for L2P, DualPrompt, CODA and MVP, two evaluations through ``OnlineLoop.predict`` with
the cache give logits bit-identical (``torch.equal``) to the same evaluations without it, and the
second one never calls the query pass. When the two evaluations batch the test set differently,
the cached logits are bit-identical to the prompted pass fed the queries of the filling batches
(the cache returns exactly what it stored, at the right indices); against a fresh uncached pass
they differ only as the uncached pass differs from itself across batch sizes (CPU matmuls round
per batch shape: ~1e-6), with equal predictions. Without PILOT: the refusal rules on a tiny net.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, build_smoke_method, requires_pilot

from pilot_online.engine.adapter import Evaluation, MethodAdapter, QueryPass, StepOutput
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.eval_cache import QueryCache
from pilot_online.engine.flops import method_flops
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import get_method, list_methods
from pilot_online.engine.session import ArrayDataSource

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES = 8
NUM_TEST = 10
#: Every registered method with a frozen query pass, as the FLOP model counts one (its
#: ``query_flops_per_image``, counted from ``evaluation(network).query`` by benchmarks/flops.py):
#: L2P, DualPrompt, CODA, MVP and the four APER variants today.
CACHED_METHODS = [
    name for name in list_methods() if method_flops(name).get("query_flops_per_image", 0) > 0
]
#: The methods whose ``evaluation`` is their own but the FLOP model counts no query pass: a view
#: alone (SLCA, CoFiMA, RanPAC, FeCAM, MOS, DUCT today).
VIEW_ONLY_METHODS = [
    name
    for name in list_methods()
    if get_method(name).evaluation is not MethodAdapter.evaluation and name not in CACHED_METHODS
]
#: PILOT's own forward of each network class whose adapter splits it into query + prompted pass.
UPSTREAM_FORWARD = {
    "CodaPromptVitNet": lambda network, x: network.fc(network(x, pen=True, train=False)),
    "PromptVitNet": lambda network, x: network(x, task_id=-1, train=False)["logits"],
}


class Recorder:
    """Counts query passes (the pass alone, or inside a whole forward) and records the logits of
    every evaluation forward."""

    def __init__(self, adapter) -> None:
        self.adapter, self.query_calls, self.logits = adapter, 0, []
        evaluation, forward = adapter.evaluation, adapter.forward

        def recorded_forward(network, x, train):
            self.query_calls += 1  # a whole forward runs the query pass too
            out = forward(network, x, train)
            self.logits.append(out.logits)
            return out

        def recorded_evaluation(network):
            inner = evaluation(network).query

            def features(x):
                self.query_calls += 1
                return inner.features(x)

            def from_query(x, query, train):
                out = inner.forward(x, query, train)
                self.logits.append(out.logits)
                return out

            return Evaluation(query=QueryPass(inner.parameters, features, from_query))

        adapter.evaluation = recorded_evaluation  # instance attributes shadow the methods
        adapter.forward = recorded_forward

    def take(self) -> torch.Tensor:
        logits, self.logits = torch.cat(self.logits), []
        return logits

    def close(self) -> None:
        for name in ("evaluation", "forward"):
            delattr(self.adapter, name)


def two_evaluations(adapter, network, config, images, cache: str, sizes, orders, device="cpu"):
    """Two evaluations through one loop (as a session runs them); logits, predictions and the
    query passes of each."""
    config = {**config, "eval_query_cache": cache}
    loop = build_loop(adapter, network, config, NUM_CLASSES, device)
    labels = np.arange(len(images)) % NUM_CLASSES
    recorder = Recorder(adapter)
    allowed = torch.ones(NUM_CLASSES, dtype=torch.bool)
    results = []
    try:
        for size, order in zip(sizes, orders):
            data = ArrayDataSource(images[:1], labels[:1], images, labels, eval_batch_size=size)
            calls = recorder.query_calls
            preds, _ = loop.predict(data.eval_batches(order), allowed, 3, sample_ids=order)
            results.append((recorder.take(), preds, recorder.query_calls - calls))
    finally:
        recorder.close()
    return results


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(NUM_TEST, 32, 32, 3), dtype=np.uint8)


@requires_pilot
@pytest.mark.parametrize("name", CACHED_METHODS)
def test_cached_evaluation_is_bit_identical(pilot_on_path, name, images, device):
    adapter, network, config = build_smoke_method(name)
    assert adapter.evaluation(network).query is not None, f"{name} returns no query pass"
    upstream_forward = UPSTREAM_FORWARD.get(type(network).__name__)
    if upstream_forward is not None:  # the split forward is PILOT's own forward, bit for bit
        x = ArrayDataSource._to_tensor(images)
        adapter.set_mode(network, train=False)
        with torch.no_grad():
            upstream = upstream_forward(network, x)
            assert torch.equal(adapter.forward(network, x, train=False).logits, upstream)
    everything = np.arange(NUM_TEST)
    subset = np.random.default_rng(1).permutation(NUM_TEST)[:7]

    # Same batches in both evaluations: bit-identical to no cache, no second query pass.
    sizes, orders = (4, 4), (everything, everything)
    plain = two_evaluations(adapter, network, config, images, "off", sizes, orders, device)
    cached = two_evaluations(adapter, network, config, images, "auto", sizes, orders, device)
    assert [calls for *_, calls in cached] == [3, 0], "query passes per evaluation (3 batches)"
    for (plain_logits, plain_preds, _), (logits, preds, _) in zip(plain, cached):
        assert torch.equal(logits, plain_logits)
        np.testing.assert_array_equal(preds, plain_preds)
    assert len({tuple(row) for row in plain[0][1]}) > 1, "degenerate test: one prediction"

    # Filled at batch size 4, reused at 3 on a permuted subset.
    sizes, orders = (4, 3), (everything, subset)
    plain = two_evaluations(adapter, network, config, images, "off", sizes, orders, device)
    cached = two_evaluations(adapter, network, config, images, "auto", sizes, orders, device)
    assert cached[1][2] == 0, "the reuse pass ran the query network"
    assert torch.equal(cached[0][0], plain[0][0])
    labels = np.zeros(NUM_TEST, dtype=np.int64)
    source = ArrayDataSource(images[:1], labels[:1], images, labels, eval_batch_size=4)
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        batches = source.eval_batches(everything)
        query_pass = adapter.evaluation(network).query
        fill = [query_pass.features(x.to(device)) for x, _ in batches]
        fill_queries = torch.cat(fill)
        source.eval_batch_size = 3
        reuse_ids = torch.from_numpy(subset).split(3)
        expected = torch.cat(
            [
                query_pass.forward(x.to(device), fill_queries[ids], False).logits
                for (x, _), ids in zip(source.eval_batches(subset), reuse_ids)
            ]
        )
    assert torch.equal(cached[1][0], expected)
    np.testing.assert_array_equal(cached[1][1], plain[1][1])
    torch.testing.assert_close(cached[1][0], plain[1][0], rtol=0, atol=1e-5)


@requires_pilot
@pytest.mark.parametrize("name", VIEW_ONLY_METHODS)
def test_a_method_the_flop_model_counts_no_query_pass_for_returns_none(pilot_on_path, name):
    """The FLOP model's query counts, which choose the methods above, match the adapters."""
    adapter, network, _ = build_smoke_method(name)
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        assert adapter.evaluation(network).query is None


@requires_pilot
def test_convprompt_has_no_frozen_query_pass(pilot_on_path):
    """ConvPrompt's per-layer queries pass through the prompted layers before them."""
    adapter, network, _ = build_smoke_method("convprompt_online")
    assert adapter.evaluation(network).query is None


# -- without PILOT: the refusal rules ----------------------------------------------------------
class QueryTiny(TinyAdapter):
    """``body`` is the query pass; the logits read it."""

    def evaluation(self, network):
        return Evaluation(query=self._query_pass(network))

    def _query_pass(self, network):
        return QueryPass(
            list(network.body.parameters()),
            lambda x: self.query_features(network, x),
            lambda x, query, train: StepOutput(network.fc(query), query),
        )

    def query_features(self, network, x):
        return torch.relu(network.body(x))

    def forward(self, network, x, train):
        query = self.query_features(network, x)
        return self._query_pass(network).forward(x, query, train)


def tiny_predict(loop, x, ids):  # x may live anywhere: the loop moves each batch
    batches = [(x[ids], torch.zeros(len(ids), dtype=torch.long))]
    return loop.predict(batches, torch.ones(6, dtype=torch.bool), 1, sample_ids=ids)


def test_trainable_query_pass_is_refused(device):
    adapter = QueryTiny()
    network = TinyNet(frozen_body=False)  # the query pass trains: caching would be stale
    loop = build_loop(adapter, network, {"grad_trace": False}, 6, device)
    x = torch.randn(5, 5)
    tiny_predict(loop, x, np.arange(5))
    assert loop.query_cache.refused and loop.query_cache.store is None


def test_changed_query_weights_empty_the_cache(device):
    adapter = QueryTiny()
    network = TinyNet(frozen_body=True)
    loop = build_loop(adapter, network, {"grad_trace": False}, 6, device)
    x = torch.randn(5, 5)
    tiny_predict(loop, x, np.arange(5))
    assert loop.query_cache.misses == 5
    tiny_predict(loop, x, np.array([3, 1]))
    assert (loop.query_cache.misses, loop.query_cache.hits) == (5, 2)
    with torch.no_grad():
        loop.network.body.weight.mul_(2)  # an in-place change, as load_state_dict makes
    tiny_predict(loop, x, np.array([3, 1]))
    assert loop.query_cache.misses == 7, "stale queries served after the weights changed"


def test_cache_off_and_bad_mode():
    loop = build_loop(QueryTiny(), TinyNet(frozen_body=True), {"eval_query_cache": "off"}, 6)
    tiny_predict(loop, torch.randn(5, 5), np.arange(5))
    assert loop.query_cache.store is None
    with pytest.raises(ValueError, match="eval_query_cache"):
        QueryCache("gpu", torch.device("cpu"))
    with pytest.raises(ConfigError, match="eval_query_cache"):
        resolve_config(
            {**load_json(REPO / "exps" / "smoke_l2p_online.json"), "eval_query_cache": "gpu"}
        )


def test_checkpointed_cache_serves_the_same_queries_after_a_resume(device):
    """A resumed loop gets the cache's tensors back: no recomputation (which, in other batches,
    could differ in the last bits), and exactly the stored rows."""
    x = torch.randn(5, 5)
    config = {"grad_trace": False}
    loop = build_loop(QueryTiny(), TinyNet(frozen_body=True), config, 6, device)
    tiny_predict(loop, x, np.array([4, 0, 2]))
    state = loop.state_dict()
    fresh = build_loop(QueryTiny(), TinyNet(frozen_body=True), config, 6, device)
    with torch.no_grad():  # the query pass the checkpointed run had (TinyNet draws its own)
        for mine, theirs in zip(fresh.network.body.parameters(), loop.network.body.parameters()):
            mine.copy_(theirs)
    poisoned = torch.full((5, 5), float("nan"))  # a recomputed query would be NaN
    fresh.load_state_dict(state)
    fresh.predict(
        [(poisoned[[0, 2, 4]], torch.zeros(3, dtype=torch.long))],
        torch.ones(6, dtype=torch.bool),
        1,
        sample_ids=np.array([0, 2, 4]),
    )
    assert (fresh.query_cache.misses, fresh.query_cache.hits) == (0, 3)
    assert torch.equal(fresh.query_cache.store[[0, 2, 4]], loop.query_cache.store[[0, 2, 4]])
    assert fresh.query_cache.filled.tolist() == [True, False, True, False, True]
