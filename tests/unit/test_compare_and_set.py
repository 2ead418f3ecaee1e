"""The one compare-and-set policy (`compare_and_set`): a lost race runs the step again, a
race lost every time becomes a retryable error naming what kept changing, and nothing else
is ever retried."""

from __future__ import annotations

import pytest

from services.common.bus.registry import compare_and_set
from services.common.domain.errors import Conflict, NotFound, Raced, Transient


class Step:
    """A read-decide-write step that loses its first `losses` races."""

    def __init__(self, losses: int, error: Exception | None = None) -> None:
        self.losses = losses
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.error is not None:
            raise self.error
        if self.calls <= self.losses:
            raise Raced("k changed concurrently")
        return f"written on try {self.calls}"


async def test_a_lost_race_runs_the_step_again_until_it_wins():
    """Each lost race re-runs the whole step (read, decide, write) at once; the winner's
    answer is returned."""
    step = Step(losses=3)
    assert await compare_and_set(step, what="k", attempts=5) == "written on try 4"
    assert step.calls == 4


async def test_races_lost_every_time_become_transient_naming_what_kept_changing():
    """After `attempts` lost races the caller gets Transient (redelivered later, 503 to a
    client), caused by the last race, and the step ran exactly `attempts` times."""
    step = Step(losses=100)
    with pytest.raises(Transient, match="document d1 keeps changing concurrently") as raised:
        await compare_and_set(step, what="document d1", attempts=4)
    assert isinstance(raised.value.__cause__, Raced)
    assert raised.value.retryable
    assert step.calls == 4


@pytest.mark.parametrize(
    "error", [Conflict("a KB named x exists"), NotFound("gone"), ValueError("a bug")]
)
async def test_any_other_error_is_raised_at_once(error):
    """Only a lost compare-and-set is retried: a real conflict (a duplicate name), a missing
    record or a bug reaches the caller from the first try, unchanged."""
    step = Step(losses=0, error=error)
    with pytest.raises(type(error)) as raised:
        await compare_and_set(step, what="k", attempts=5)
    assert raised.value is error
    assert step.calls == 1


def test_a_lost_race_is_a_conflict_where_nobody_retries_it():
    """Outside `compare_and_set` (a prompt edited from a stale read) a lost race answers 409
    like any conflict."""
    assert issubclass(Raced, Conflict)
    assert Raced("x").status_code == 409
