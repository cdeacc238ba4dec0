"""``StepGate``: holds the engine's step thread at each model step until the test lets it pass.

The gate sits in ``runner.execute``, after the scheduler planned (and counted) the step. Requests
and aborts reach the step thread between steps, so while a step is held the test knows exactly
which steps ran and which one is in flight: "aborted after at most one more step" becomes an
exact assertion, whatever the machine's speed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

HOLD_TIMEOUT = 120.0
"""A held step gives up after this long (a failing test must not hang the run)."""


class StepGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._permits = 0
        self._open = False
        self.num_held = 0
        """Steps waiting at the gate now."""
        self.num_passed = 0

    def install(self, monkeypatch: pytest.MonkeyPatch, runner: Any) -> None:
        original = runner.execute

        def execute(*args: Any, **kwargs: Any) -> Any:
            self._pass()
            return original(*args, **kwargs)

        monkeypatch.setattr(runner, "execute", execute)

    def _pass(self) -> None:
        with self._cond:
            self.num_held += 1
            self._cond.notify_all()
            released = self._cond.wait_for(lambda: self._open or self._permits, HOLD_TIMEOUT)
            self.num_held -= 1
            if not released:
                raise TimeoutError(f"step held at the gate for {HOLD_TIMEOUT} s")
            if not self._open:
                self._permits -= 1
            self.num_passed += 1
            self._cond.notify_all()

    def allow(self, num_steps: int) -> None:
        """Let ``num_steps`` more steps through."""
        with self._cond:
            self._permits += num_steps
            self._cond.notify_all()

    def open(self) -> None:
        """Let every step through from now on."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_until_held(self, num_passed: int, timeout: float = HOLD_TIMEOUT) -> None:
        """Wait until ``num_passed`` steps went through and the next one waits at the gate."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.num_passed == num_passed and self.num_held == 1, timeout
            )
        assert ok, f"not held after {num_passed} steps: {self.num_passed} passed, {self.num_held}"


@contextmanager
def step_gate(monkeypatch: pytest.MonkeyPatch, runner: Any) -> Iterator[StepGate]:
    """A gate on ``runner`` (closed: no step passes until ``allow``), opened on the way out so
    that the engine never stays blocked after the test."""
    gate = StepGate()
    gate.install(monkeypatch, runner)
    try:
        yield gate
    finally:
        gate.open()
