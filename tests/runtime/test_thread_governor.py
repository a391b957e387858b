"""The thread governor against a simulated machine whose step time depends on the thread
count and on whether a neighbour holds a core; and an engine that steps under it."""
from __future__ import annotations

import pytest

from contract.sampling_params import SamplingParams
from runtime.execution.thread_governor import ThreadGovernor, candidates


class Machine:
    """Two cores: quiet, two threads run a row in 1 ms and one thread in 1.8 ms; with a
    neighbour on one core, two threads stall at every barrier (60 ms: 30x one thread, as
    measured on the 2-core VMs) and one runs in 2 ms."""

    def __init__(self):
        self.now = 0.0
        self.threads = 0
        self.neighbour = False
        self.set_calls: list[int] = []
        self.stalled = 0  # steps run with every thread while the neighbour was there

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.set_calls.append(n)

    def clock(self) -> float:
        return self.now

    def run(self, governor: ThreadGovernor, rows: int = 4) -> None:
        governor.before_step()
        per_row = {(2, False): 1e-3, (1, False): 1.8e-3, (2, True): 60e-3, (1, True): 2e-3}
        self.now += rows * per_row[(self.threads, self.neighbour)]
        self.stalled += self.threads == 2 and self.neighbour
        governor.after_step(rows)

    def idle(self) -> float:
        """Idle cores: what the worker's threads and the neighbour leave of two."""
        return max(0.0, 2 - self.threads - self.neighbour - 0.1)


def governor_on(machine: Machine, **kw) -> ThreadGovernor:
    kw.setdefault("idle_cores", machine.idle)
    return ThreadGovernor(2, set_threads=machine.set_threads, clock=machine.clock, **kw)


def test_candidates_cover_all_one_fewer_and_half():
    assert candidates(2) == [1, 2]
    assert candidates(8) == [4, 7, 8]
    assert candidates(1) == [1]


def test_quiet_machine_keeps_every_thread():
    m = Machine()
    g = governor_on(m)
    for _ in range(100):
        m.run(g)
    assert g.trials == 1 and g.chosen == 2 and m.threads == 2


def test_a_neighbour_moves_it_to_one_thread_and_leaving_moves_it_back():
    m = Machine()
    g = governor_on(m, explore_every=200)
    for _ in range(50):
        m.run(g)
    assert g.chosen == 2
    m.neighbour = True
    for _ in range(50):  # the pace drifts by 8x: a new trial at once, not after 200 steps
        m.run(g)
    assert g.chosen == 1 and m.threads == 1 and g.trials == 2
    m.neighbour = False  # one thread's pace barely changes: the periodic trial finds out
    for _ in range(250):
        m.run(g)
    assert g.chosen == 2 and g.trials >= 3


def test_a_neighbour_leaving_shows_in_the_idle_cores_at_once():
    """Without the idle watch only the periodic trial (here every 10,000 steps) would
    notice; with it the full count is back within a few checks."""
    m = Machine()
    g = governor_on(m, explore_every=10_000)
    for _ in range(50):
        m.run(g)
    m.neighbour = True
    for _ in range(50):
        m.run(g)
    assert g.chosen == 1
    m.neighbour = False
    for _ in range(30):
        m.run(g)
    assert g.chosen == 2 and m.threads == 2
    m = Machine()  # the same run, with a reader that never sees an idle core
    blind = governor_on(m, explore_every=10_000, idle_cores=lambda: 0.0)
    for neighbour, steps in ((False, 50), (True, 50), (False, 30)):
        m.neighbour = neighbour
        for _ in range(steps):
            m.run(blind)
    assert blind.chosen == 1  # still waiting for the periodic trial


def test_idle_cores_from_proc_stat(tmp_path):
    from runtime.execution.cpu_idle import IdleCores
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    reader = IdleCores.open(2, stat)
    assert reader is not None
    reader()
    stat.write_text("cpu  200 0 50 880 70 0 0 0 0 0\ncpu0 1 2 3\n")
    assert reader() == 2 * 100 / 200  # 100 of 200 jiffies idle on two cores: one core
    assert IdleCores.open(2, tmp_path / "missing") is None


def test_a_lasting_neighbour_costs_one_stalled_step_a_trial_and_trials_back_off():
    m = Machine()
    g = governor_on(m, explore_every=200)
    for _ in range(50):
        m.run(g)
    m.neighbour = True
    for _ in range(20):  # the drift is seen after trial_steps steps; the trial moves to one
        m.run(g)
    assert g.chosen == 1
    stalled, trials = m.stalled, g.trials
    for _ in range(4000):
        m.run(g)
    later = g.trials - trials
    assert g.chosen == 1 and later >= 2  # it keeps looking, and keeps one thread
    assert m.stalled - stalled == later  # each trial drops two threads after one step
    assert later <= 7  # 200, 400, 800, then every 800 steps: not 20 trials of 200
    assert g.interval == 800


def test_fixed_policy_never_changes_the_count():
    m = Machine()
    g = governor_on(m, policy="fixed")
    m.neighbour = True
    for _ in range(500):
        m.run(g)
    assert m.set_calls == [2] and g.trials == 0


def test_steps_that_ran_nothing_teach_nothing():
    m = Machine()
    g = governor_on(m)
    for _ in range(100):
        g.before_step()
        g.after_step(0)
    assert g.trials == 0


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="adaptive, fixed"):
        ThreadGovernor(2, policy="spin")


def test_engine_outputs_do_not_depend_on_the_thread_count(make_tiny_engine):
    """The governor changes torch's thread count between steps; greedy outputs stay those of
    a fixed count."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # two candidates (1 and 2) whatever the machine
    try:
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        fixed = make_tiny_engine(thread_policy="fixed").generate(prompts, params)
        engine = make_tiny_engine()
        engine.threads.explore_every = 0  # a trial at every chance
        engine.threads.trial_steps = 1
        assert engine.generate(prompts, params) == fixed
        assert engine.threads.trials > 0
    finally:
        torch.set_num_threads(before)
