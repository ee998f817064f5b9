"""Schedulers: the order of the computing tasks (communication runs on its own lane).

* ``sequential``: chunk after chunk, and communication is not overlapped at all (it runs inline,
  blocking): the default execution of Eq. (10), ``t_1 = sum of all task times``.
* ``pipelined``: all C1 first (every dispatch all-to-all is queued at once, as Tutel / FasterMoE
  do), then chunk after chunk ``D1^i E^i C2^i D2^i``: each chunk's result is decoded as soon as it
  returns, which makes the computing lane wait for ``A2^i``.
* ``optsche``: ScheMoE's Theorem 1, Eq. (12):
  ``(C1^1..C1^r)(D1^1 E^1 C2^1)...(D1^r E^r C2^r)(D2^1..D2^r)``.

A user scheduler subclasses :class:`Scheduler`, implements ``order(r)`` and registers itself with
``@register_scheduler("name")``; ``MoEConfig(schedule="name")`` then uses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from moeflow.registry import Registry
from moeflow.schedule.tasks import Task


class Scheduler(ABC):
    name: str = "?"
    overlap: bool = True      # False: communication runs inline on the computing thread

    @abstractmethod
    def order(self, r: int) -> list[Task]:
        """The computing tasks of r chunks in execution order."""


SCHEDULERS = Registry("scheduler", Scheduler)
register_scheduler = SCHEDULERS.register


@register_scheduler("sequential")
class Sequential(Scheduler):
    overlap = False

    def order(self, r: int) -> list[Task]:
        return [Task(k, i) for i in range(r) for k in ("C1", "D1", "E", "C2", "D2")]


@register_scheduler("pipelined")
class Pipelined(Scheduler):
    def order(self, r: int) -> list[Task]:
        return ([Task("C1", i) for i in range(r)]
                + [Task(k, i) for i in range(r) for k in ("D1", "E", "C2", "D2")])


@register_scheduler("optsche")
class OptSche(Scheduler):
    def order(self, r: int) -> list[Task]:
        return ([Task("C1", i) for i in range(r)]
                + [Task(k, i) for i in range(r) for k in ("D1", "E", "C2")]
                + [Task("D2", i) for i in range(r)])
