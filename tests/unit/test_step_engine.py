"""``dmuon/step/engine.py``: the engine only dispatches. Its staged run yields before each bucket of
a staged strategy, runs an unstaged one whole, in the plan's order; ``run`` takes every stage,
lets the step's independent work (AdamW) run once, and counts the traffic."""

from __future__ import annotations

from collections.abc import Iterator

from dmuon.step.engine import Engine


class Staged:
    """A strategy that runs bucket by bucket (like the row exchange), noting what it did."""

    def __init__(self, name: str, buckets: int, log: list) -> None:
        self.name, self.buckets, self.log = name, [None] * buckets, log

    def stages(self, io, ctx) -> Iterator[int]:
        for k in range(len(self.buckets)):
            yield k
            self.log.append((self.name, k))

    def run(self, io, ctx) -> None:
        for _ in self.stages(io, ctx):
            pass


class Whole:
    """A strategy without stages (like gangs)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.buckets = name, log, []

    def run(self, io, ctx) -> None:
        self.log.append((self.name, "whole"))


class Values:
    def __init__(self, log: list) -> None:
        self.log = log

    def overlap(self) -> None:
        self.log.append("adamw")


def test_stages_yield_before_each_bucket_in_the_plans_order():
    log: list = []
    strategies = [Whole("gangs", log), Staged("rows", 2, log), Staged("experts", 1, log)]
    seen = []
    for stage in Engine().stages(strategies, Values(log)):
        seen.append((stage, list(log)))
    assert [stage for stage, _ in seen] == [(1, 0), (1, 1), (2, 0)]
    # each stage comes before its bucket runs, after everything before it
    assert seen[0][1] == [("gangs", "whole")] and seen[1][1] == [("gangs", "whole"), ("rows", 0)]
    assert log == [("gangs", "whole"), ("rows", 0), ("rows", 1), ("experts", 0)]


def test_run_takes_every_stage_then_the_independent_work_and_counts_the_traffic():
    log: list = []
    engine = Engine()
    engine.start_step()
    engine.counter.bytes_sent, engine.counter.collectives = 96, 3
    engine.run([Staged("rows", 3, log)], Values(log))
    assert log == [("rows", 0), ("rows", 1), ("rows", 2), "adamw"]
    assert (engine.stats.bytes_sent, engine.stats.collectives) == (96, 3)
