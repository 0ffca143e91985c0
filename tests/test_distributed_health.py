"""Health statistics on 2 gloo ranks against one process: the noise scale from ranks (each
rank's gradient before the reduction) and from micro-batches under DDP and FSDP2, against the
float64 oracle of explicit per-sample gradients; gain and the loss against one process on the
concatenated batch; ``split=`` slices with the expert dimension sharded by FSDP2; and still at
most two collectives per ``mon.step``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._dist import gloo_available
from tests._dist_shared import ranks_once
from tests.test_health import gns_oracle

needs_gloo = pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo needed")

# [mode, source, micro-batches per rank and step]
RUNS = [["ddp", "ranks", 1], ["ddp", "ranks", 2], ["ddp", "microbatches", 2],
        ["fsdp", "ranks", 1], ["fsdp", "ranks", 2], ["fsdp", "microbatches", 2]]


def _pieces(source: str, micro: int, world: int, batch: int) -> list[list[int]]:
    per = batch // world
    size = per if source == "ranks" else per // micro
    return [list(range(i, i + size)) for i in range(0, batch, size)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both tests' rank results, from one start of two ranks."""
    from tests import _dist_health as W

    return ranks_once(tmp_path_factory, "health", 2,
                      {"gns": (W.gns_modes, {"runs": RUNS}), "split": W.split_run},
                      timeout=480)


@needs_gloo
def test_noise_scale_gain_and_loss_under_ddp_and_fsdp2_match_one_process(ranks):
    from tests import _dist_health as W
    from tests._dist_monitor import BATCH

    results = [r["gns"] for r in ranks]
    ref = W.reference_gns()
    for mode, source, micro in RUNS:
        key = f"{mode}/{source}/{micro}"
        rows = [r[key]["rows"] for r in results]
        assert rows[0] == rows[1], key  # every rank has the same numbers
        got = {(s, n, k, st): v for s, n, k, st, v in rows[0]}
        pieces = _pieces(source, micro, 2, BATCH)
        expected = gns_oracle([(g, pieces) for g in ref["grads"]], W.BETA)
        for step, row in enumerate(expected):
            for name, triple in row.items():
                for stat, want in zip(W.GNS_STATS, triple):
                    assert got[(step, name, "param_grad", stat)] == pytest.approx(
                        want, rel=1e-9), (key, step, name, stat)
            assert got[(step, "<loss>", "health", "value")] == pytest.approx(
                ref["loss"][step], rel=1e-12), key
        for step, name, value in ref["gain"]:
            assert got[(step, name, "grad_output", "gain")] == pytest.approx(value, rel=1e-9)
        # The ranks' squared norms ride in the Monitor's two all_reduces.
        for r in results:
            assert r[key]["calls"] == [["all_reduce", "all_reduce"]] * len(expected), key


@needs_gloo
def test_split_slices_with_the_expert_dimension_sharded_by_fsdp2(ranks):
    from tests import _dist_health as W
    from tests.test_tensorops import oracle

    results = [r["split"] for r in ranks]
    rows = [r["rows"] for r in results]
    assert rows[0] == rows[1]
    got = {(s, n, k, st): v for s, n, k, st, v in rows[0]}
    ref = W.reference_split()
    expected = {}
    for step, kinds in enumerate(ref):
        for kind, tensors in kinds.items():
            for name, t in tensors.items():
                parts = {name: t}
                if name == "experts.w1":
                    parts.update({f"{name}[{i}]": p for i, p in enumerate(t.unbind(0))})
                if name == "experts.w2":
                    parts.update({f"{name}[{i}]": p for i, p in enumerate(t.unbind(1))})
                for part_name, part in parts.items():
                    stats = oracle(part.numpy())
                    for stat in W.SPLIT_STATS:
                        expected[(step, part_name, kind, stat)] = stats[stat]
    assert set(got) == set(expected)
    for key, want in expected.items():
        assert got[key] == pytest.approx(want, rel=1e-9, abs=1e-13), key
    assert {n for _, n, _, _ in got if n.startswith("experts.w1[")} == {
        f"experts.w1[{i}]" for i in range(W.E)}
    for r in results:
        assert r["calls"] == [["all_reduce", "all_reduce"]] * 2
    assert np.isfinite(list(got.values())).all()

