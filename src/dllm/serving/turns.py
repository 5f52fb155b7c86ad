"""Turns between the sampler calls in flight in the serving engine (engine.py)."""

from __future__ import annotations

import threading
from collections import deque


class Turns:
    """Round-robin turns between the sampler calls in flight: one runs its next step (a model forward and
    what the loop does with it) while the others wait, then it goes to the back of the line. A long call
    thus no longer holds the model until it ends: a short request started beside it finishes after about
    its own steps times the number of calls in flight, and the calls never run their forwards at the
    same time (they would fight over the same cores or device)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.line: deque[int] = deque()

    def join(self, me: int) -> None:
        with self.cond:
            self.line.append(me)
            self.cond.wait_for(lambda: self.line[0] == me)

    def next(self, me: int) -> None:
        """End my step: the next call in line runs its step, I run mine after every other."""
        with self.cond:
            if len(self.line) > 1:
                self.line.remove(me)
                self.line.append(me)
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.line[0] == me)

    def leave(self, me: int) -> None:
        with self.cond:
            self.line.remove(me)
            self.cond.notify_all()
