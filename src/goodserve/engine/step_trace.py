"""Step trace: one JSON line per engine step, as the serving loop ran it.

``goodserve serve --step-trace FILE`` writes it; ``goodserve profile --from-step-trace FILE`` fits the
simulator's cost model to it. Each line holds the step's :class:`~goodserve.scheduler.output.StepShape`
and two durations in seconds:

* ``step_s``: ``Engine.step()`` alone (schedule, model, sampling, detokenisation);
* ``cycle_s``: the whole loop iteration around it, from the end of the previous iteration (or from waking
  up, after the engine slept): waits for the lock and the GIL, queued adds and aborts applied, the step,
  outputs handed to the event loop. Under ``serve`` the engine thread shares the CPU and the GIL with the
  HTTP server, so ``cycle_s`` is what a simulated step must last for the simulator to keep pace with the
  real server.

``t`` is when the cycle began, in seconds since the engine loop started (after the model was loaded), and
``after_idle`` is true when the engine had slept just before the step (no work, or paused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from goodserve.scheduler.output import StepShape


@dataclass(frozen=True)
class TracedStep:
    """One line of a step trace (see the module docstring)."""

    t: float
    cycle_s: float
    step_s: float
    after_idle: bool
    shape: StepShape

    def to_json(self) -> str:
        return json.dumps({"t": round(self.t, 6), "cycle_s": round(self.cycle_s, 7), "step_s": round(self.step_s, 7),
                           "after_idle": self.after_idle, **self.shape.to_dict()})


class StepTraceWriter:
    """Appends :class:`TracedStep` lines to a file (line-buffered, so a killed server loses at most one).

    Raises:
        OSError: if the file cannot be opened.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", buffering=1)

    def write(self, step: TracedStep) -> None:
        self._file.write(step.to_json() + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_trace(path: Union[str, Path]) -> list[TracedStep]:
    """Read a step trace.

    Raises:
        ValueError: on an unreadable file or a malformed line (with its line number), e.g. a duration <= 0.
    """
    steps = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read step trace {path}: {exc}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            step = TracedStep(float(d["t"]), float(d["cycle_s"]), float(d["step_s"]), bool(d["after_idle"]),
                              StepShape.from_dict(d))
            if not step.cycle_s > 0 or not step.step_s > 0:
                raise ValueError("durations must be > 0")
            steps.append(step)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{i}: not a step-trace line ({exc!r})") from None
    return steps
