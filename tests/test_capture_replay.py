"""What other consumers see while ``gt.detect`` replays a step: nothing. A replay is not a
training step, so a Monitor's statistics and a transform's state end exactly as in the same
run without detect; a listener that declares ``sees_replays`` does see it. Then the replay kit:
autocast state entered again, buffers and RNG state put back."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor, nn

import gradtap as gt
from gradtap.capture import (
    AUTOCAST_DEVICES,
    AutocastState,
    HookSet,
    Listener,
    RngState,
    buffers_restored,
    replaying,
)
from tests._models import assert_no_hooks

BAD_STEP = 2
STEPS = 4


class MaybeSqrt(nn.Module):
    """sqrt on the bad step only: after a ReLU its gradient is Inf where the ReLU output is 0,
    and the ReLU zeroes exactly those, so only ``screen="modules"`` sees it (then replays)."""

    on = False

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x) if self.on else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.sqrt, self.fc2 = (nn.Linear(8, 16), nn.ReLU(), MaybeSqrt(),
                                                    nn.Linear(16, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.sqrt(self.relu(self.fc1(x))))


class Counter(Listener):
    def __init__(self) -> None:
        self.records = 0

    def on_record(self, record: gt.GradRecord) -> None:
        self.records += 1


class SeesReplays(Counter):
    sees_replays = True


def train(with_detect: bool):
    torch.manual_seed(0)
    net = Net()
    data = [torch.randn(12, 8) for _ in range(STEPS)]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    counters = (Counter(), SeesReplays())
    with gt.Monitor(net, kinds=("param_grad", "grad_output")) as mon, \
            gt.transform(net, {"fc2": gt.normalize(0.9)}, on="grad_output") as on_outputs, \
            gt.transform(net, {"fc1.weight": gt.normalize(0.9)}, when="backward") as on_calls, \
            gt.tap(net, "fc2", store=False, listener=counters[0]), \
            gt.tap(net, "fc2", store=False, listener=counters[1]):
        det = gt.detect(net, action="record", screen="modules") if with_detect else None
        for step, x in enumerate(data):
            net.sqrt.on = step == BAD_STEP
            net(x).pow(2).mean().backward()
            mon.step()
            if det is not None:
                assert det.should_skip() == (step == BAD_STEP)
                det.step()
            if step != BAD_STEP:
                opt.step()
            opt.zero_grad()
        if det is not None:
            det.remove()
    assert_no_hooks(net)
    return (mon, on_outputs.state_dict(), on_calls.state_dict(), counters,
            det.anomalies if det is not None else [])


def test_a_replay_moves_no_monitor_statistic_and_no_transform_state():
    mon, outputs_state, calls_state, counters, _ = train(with_detect=False)
    mon_d, outputs_state_d, calls_state_d, counters_d, anomalies = train(with_detect=True)
    # The replay ran, with a backward: its per-call watch named the origin from a record.
    (a,) = anomalies
    assert (a.module_name, a.kind, a.where, a.step) == ("sqrt", "inf", "grad_input", BAD_STEP)
    assert a.record is not None
    # A listener that declares sees_replays saw the replayed backward; the others did not.
    assert counters[1].records == counters[0].records == STEPS
    assert counters_d[0].records == STEPS
    assert counters_d[1].records == STEPS + 1
    # The Monitor: the same steps, the same statistics (the bad step's Inf included).
    assert mon_d.steps_done == mon.steps_done == STEPS
    frame, frame_d = mon.frame(), mon_d.frame()
    assert sorted(frame["step"].unique()) == list(range(STEPS))
    assert frame["value"].isin([float("inf")]).any()  # the bad step is in the statistics
    frame_d = frame_d.set_index(["step", "name", "kind", "stat"]).sort_index()
    frame = frame.set_index(["step", "name", "kind", "stat"]).sort_index()
    assert frame.equals(frame_d)
    # The transforms: the same state (normalize counts its steps in its state).
    for got, want in ((outputs_state_d, outputs_state), (calls_state_d, calls_state)):
        assert want["state"] and got["plan"] == want["plan"]
        torch.testing.assert_close(got["state"], want["state"], rtol=0, atol=0)


@pytest.mark.parametrize("sees", [False, True])
def test_a_hook_set_sees_a_replay_only_when_it_says_so(sees):
    w = nn.Parameter(torch.ones(3))
    seen = []
    with HookSet(sees_replays=sees) as hooks:
        hooks.post_accumulate_grad(w, lambda p: seen.append(p.grad.clone()))
        (2 * w).sum().backward()
        with replaying(Counter()):
            (3 * w).sum().backward()
    assert len(seen) == (2 if sees else 1)
    assert torch.equal(seen[0], torch.full((3,), 2.0))


def test_the_owner_of_a_replay_sees_it_and_replays_do_not_nest():
    net = nn.Linear(2, 2)
    owner, other = Counter(), Counter()
    with gt.tap(net, "", store=False, listener=owner), \
            gt.tap(net, "", store=False, listener=other), gt.tap(net, "") as plain:
        with replaying(owner):
            net(torch.randn(1, 2)).sum().backward()
            with pytest.raises(RuntimeError, match="do not nest"), replaying(other):
                pass
        net(torch.randn(1, 2)).sum().backward()
    assert (owner.records, other.records, len(plain.records)) == (2, 1, 1)


# -- the replay kit -------------------------------------------------------------------------------


def test_an_autocast_state_is_entered_again_on_and_off_alike():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = AutocastState.capture()
    off = AutocastState.capture()
    assert [d for d, _, _ in on.settings] == list(AUTOCAST_DEVICES)
    assert on.settings[0] == ("cpu", True, torch.bfloat16)
    assert not any(enabled for _, enabled, _ in off.settings)
    with on.entered():
        assert AutocastState.capture() == on
        assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.bfloat16
        with off.entered():  # a call made with autocast off replays with it off
            assert AutocastState.capture() == off
            assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32
        assert AutocastState.capture() == on
    assert AutocastState.capture() == off


def test_autocast_off_keeps_a_dtype_set_outside_any_autocast_block():
    # What a torch.autocast without dtype inside the replayed call would pick.
    default = torch.get_autocast_dtype("cpu")
    other = torch.float16 if default != torch.float16 else torch.bfloat16
    torch.set_autocast_dtype("cpu", other)
    try:
        state = AutocastState.capture()
    finally:
        torch.set_autocast_dtype("cpu", default)
    assert state.settings[0] == ("cpu", False, other)
    assert AutocastState.capture().settings[0] == ("cpu", False, default)
    with state.entered():
        assert torch.get_autocast_dtype("cpu") == other
        assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == default


class _Reassigns(nn.Module):
    """Updates one buffer in place and replaces another with a new tensor."""

    def __init__(self, shared: Tensor) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("shared", shared, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        self.count += 1
        self.scale = self.scale * 2
        self.shared.add_(1.0)
        return x * self.scale


@pytest.mark.parametrize("fails", [False, True])
def test_buffers_come_back_bit_for_bit_and_as_the_same_tensors(fails):
    torch.manual_seed(0)
    shared = torch.randn(3)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), _Reassigns(shared), _Reassigns(shared))
    net(torch.randn(5, 3))  # running statistics that are not the initial ones
    before = {name: (b, b.clone()) for name, b in net.named_buffers(remove_duplicate=False)}
    with pytest.raises(ZeroDivisionError) if fails else contextlib.nullcontext(), \
            buffers_restored(net):
        net(torch.randn(5, 3) * 100)
        assert not torch.equal(net[1].running_mean, before["1.running_mean"][1])
        assert net[2].scale is not before["2.scale"][0]
        if fails:
            raise ZeroDivisionError
    after = dict(net.named_buffers(remove_duplicate=False))
    assert after.keys() == before.keys()
    for name, (b, value) in before.items():
        assert after[name] is b, name
        assert torch.equal(b, value) and b.dtype == value.dtype, name
    assert net[2].shared is net[3].shared is shared


def test_an_rng_state_says_whether_numbers_were_drawn_and_draws_them_again():
    torch.manual_seed(0)
    saved = RngState()
    assert not saved.moved()
    drawn = torch.rand(4)
    assert saved.moved()
    saved.restore()
    assert not saved.moved()
    assert torch.equal(torch.rand(4), drawn)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_rng_state_keeps_the_cuda_generators_it_is_given():
    saved = RngState([0])
    drawn = torch.rand(4, device="cuda:0")
    assert saved.moved()
    saved.restore()
    assert not saved.moved()
    assert torch.equal(torch.rand(4, device="cuda:0"), drawn)
