"""ThreadGuard (kernels/threads.py): the thread count it picks from injected /proc readings (no timing), its
two-window hysteresis, the engine calling it once per step, where api.py installs it, and the property that makes
it safe: q4x8 results do not depend on the thread count."""
import pytest
import torch

from draftwise.kernels.linear import Q4x8Linear
from draftwise.kernels.threads import WINDOW_S, ThreadGuard, read_proc, threads_for


def test_threads_for_gives_back_the_cores_others_keep_busy():
    assert threads_for(2, 2, 0.0) == 2
    assert threads_for(2, 2, 0.4) == 2  # a daemon's fraction of a core is not worth a thread
    assert threads_for(2, 2, 0.7) == 1
    assert threads_for(2, 2, 3.0) == 1  # never below one
    assert threads_for(4, 8, 3.4) == 4  # never above what was asked
    assert threads_for(8, 8, 3.6) == 4
    assert threads_for(2, 2, -0.2) == 2  # jiffy rounding can make "others" slightly negative


class FakeProc:
    """/proc readings where the other processes keep `others` cores busy and we use `ours` cores, HZ = 100."""

    def __init__(self):
        self.t, self.busy, self.mine = 0.0, 0, 0
        self.others, self.ours = 0.0, 2.0

    def advance(self, seconds: float):
        self.t += seconds
        self.busy += round(100 * seconds * (self.others + self.ours))
        self.mine += round(100 * seconds * self.ours)

    def read(self):
        return self.busy, self.mine


def guard(proc: FakeProc, calls: list):
    return ThreadGuard(2, cores=2, read=proc.read, clock=lambda: proc.t, set_threads=calls.append, hz=100, log=False)


def test_guard_drops_a_thread_after_two_busy_windows_and_returns_when_the_machine_is_free():
    proc, calls = FakeProc(), []
    g = guard(proc, calls)
    proc.advance(WINDOW_S / 2)
    assert g.tick() is None  # window not over: nothing read, nothing changed
    proc.others = 1.0
    proc.advance(WINDOW_S / 2)
    assert g.tick() is None and calls == []  # one busy window is a blip
    proc.advance(WINDOW_S)
    assert g.tick() == 1 and calls == [1] and g.threads == 1 and g.others == pytest.approx(1.0)
    proc.advance(WINDOW_S)
    assert g.tick() is None and calls == [1]  # still busy: stays
    proc.others, proc.ours = 0.0, 1.0
    proc.advance(WINDOW_S)
    assert g.tick() is None  # free for one window
    proc.advance(WINDOW_S)
    assert g.tick() == 2 and calls == [1, 2] and g.changes == 2


def test_a_single_busy_window_between_free_ones_changes_nothing():
    proc, calls = FakeProc(), []
    g = guard(proc, calls)
    for others in (0.0, 1.5, 0.0, 1.5, 0.0):
        proc.others = others
        proc.advance(WINDOW_S)
        g.tick()
    assert calls == [] and g.threads == 2


def test_no_proc_means_no_change():
    calls = []
    t = [0.0]
    g = ThreadGuard(2, cores=2, read=lambda: None, clock=lambda: t[0], set_threads=calls.append, log=False)
    for _ in range(5):
        t[0] += WINDOW_S
        assert g.tick() is None
    assert calls == []


def test_read_proc_reads_this_machine():
    from draftwise.kernels.threads import our_cpus

    r = read_proc()
    if r is None:
        pytest.skip("no /proc here")
    busy, mine = r
    assert busy >= mine >= 0
    cpus = our_cpus()
    if cpus:
        ours = read_proc(cpus)
        assert ours is not None and 0 <= ours[0] <= read_proc()[0] + 100  # our CPUs' busy time, within a tick
        assert read_proc({max(cpus) + 1000})[0] == 0  # a CPU that does not exist is never busy


def test_engine_ticks_the_guard_once_per_step():
    from tests.harness import tiny_llm

    llm = tiny_llm()

    class Counting:
        ticks = 0

        def tick(self):
            Counting.ticks += 1

    llm.engine.thread_guard = Counting()
    steps, step = [], llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    from draftwise import SamplingParams

    llm.generate(["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert Counting.ticks == len(steps) >= 2


def test_guard_only_where_the_thread_count_cannot_change_a_result():
    from draftwise.api import LLM
    from draftwise.config import EngineConfig

    from draftwise.kernels import attention
    from draftwise.kernels.plan import resolve_plan

    q4 = resolve_plan("q4x8", "auto", None)
    assert isinstance(LLM._thread_guard(EngineConfig(model="m"), q4), ThreadGuard) == attention.available()
    assert LLM._thread_guard(EngineConfig(model="m", thread_guard=False), q4) is None
    for other in ("q4x8+bf16", "int4", "fp32"):
        assert LLM._thread_guard(EngineConfig(model="m"), resolve_plan(other, "auto", None)) is None


@pytest.mark.parametrize("rows", [1, 5, 9, 40])
def test_q4x8_results_do_not_depend_on_the_thread_count(rows):
    from draftwise.kernels import q4x8

    if "avx2" not in q4x8.cpu_paths() and "scalar" not in q4x8.cpu_paths():
        pytest.skip("no q4x8 kernel here")
    gen = torch.Generator().manual_seed(0)
    lin = Q4x8Linear(torch.randn(200, 256, generator=gen) * 0.05)  # [N, K]
    x = torch.randn(rows, 256, generator=gen)  # [M, K]
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
