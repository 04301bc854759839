"""The benchmark harness's timing order (no GPU needed)."""

from fa4gen import bench


def test_rotations_put_every_implementation_in_every_place():
    names = ["fa4gen", "fa4", "cudnn", "sdpa_flash", "flex"]
    orders = bench.rotations(names, len(names))
    assert all(sorted(order) == sorted(names) for order in orders)
    for place in range(len(names)):
        assert sorted(order[place] for order in orders) == sorted(names)
    assert bench.rotations(names, 2) == orders[:2]  # fewer rounds: the first rotations
    assert bench.rotations([], 3) == []


def test_time_balanced_rotates_rounds_and_reports_failures(monkeypatch):
    """Each round runs the functions in its rotation (a warm-up and the timed launches each); a
    function that raises is reported with its exception and skipped afterwards."""
    import torch

    clock = iter(range(10**6))

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, end):
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def make(name):
        def run(*inputs):
            calls.append(name)
            if name == "broken" and calls.count(name) > 1:
                raise RuntimeError("no kernel for this shape")

        return run

    timed = bench.time_balanced({n: make(n) for n in ("a", "b", "broken")}, [(1,), (2,)], rounds=3, iters=2)
    assert timed["a"] == timed["b"] == 1.0  # one clock tick between each launch's events
    assert isinstance(timed["broken"], RuntimeError)
    # round 0: a, b, broken (fails at its first timed launch); round 1: b, a (broken skipped);
    # round 2 would start with broken: a, b. A warm-up and 2 timed launches each.
    assert calls == ["a"] * 3 + ["b"] * 3 + ["broken"] * 2 + ["b"] * 3 + ["a"] * 3 + ["a"] * 3 + ["b"] * 3
    assert calls.count("a") == calls.count("b") == 9 and calls.count("broken") == 2
