"""Step trace: one JSON line per engine step, as the serving loop ran it.

``goodserve serve --step-trace FILE`` writes it; ``goodserve profile --from-step-trace FILE`` fits the
simulator's cost model to it. Each line holds the step's :class:`~goodserve.scheduler.output.StepShape`
and two durations in seconds:

* ``step_s``: ``Engine.step()`` alone (schedule, model, sampling, detokenisation);
* ``cycle_s``: the whole loop iteration around it (queued adds and aborts applied, the step, outputs handed
  to the event loop). Under ``serve`` the engine thread shares the CPU and the GIL with the HTTP server,
  so ``cycle_s`` is what a simulated step must last for the simulator to keep pace with the real server.

``t`` is seconds since the trace opened and ``after_idle`` is true when the engine had slept for lack of
work just before the step.
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
        ValueError: on an unreadable file or a malformed line (with its line number).
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
            steps.append(TracedStep(float(d["t"]), float(d["cycle_s"]), float(d["step_s"]), bool(d["after_idle"]),
                                    StepShape.from_dict(d)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{i}: not a step-trace line ({exc!r})") from None
    return steps
