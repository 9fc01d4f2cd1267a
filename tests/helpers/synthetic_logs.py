"""One builder of synthetic parsed logs: the judgment's tests feed it series written out in the test,
as a parser would have read them from a file."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from lossbeat.logs import EvalRecord, ParsedLog, TrainRecord


def synthetic_log(
    losses: Sequence[float],
    grads: Sequence[float | None] | None = None,
    signals: Mapping[str, Iterable[tuple[int, float]]] | None = None,
    evals: Mapping[int, float] | None = None,
    fields: Iterable[str] = (),
    step0: int | None = None,
    every: int = 1,
    lr: float | None = None,
) -> ParsedLog:
    """A log of ``losses`` logged every ``every`` steps from ``step0`` (default: ``every``), with the
    grad norms ``grads`` (one per loss), a constant ``lr``, the eval losses ``evals`` ({step:
    value}), the task ``signals`` ({name: [(step, value)]}) and the logged ``fields`` its profile
    is detected from."""
    log = ParsedLog("test", "synthetic", fields=tuple(fields))
    first = every if step0 is None else step0
    for i, loss in enumerate(losses):
        log.train.append(TrainRecord(first + i * every, loss, None if grads is None else grads[i], lr))
    for step, value in sorted((evals or {}).items()):
        log.evals.append(EvalRecord(step, value))
    log.signals = {name: list(values) for name, values in (signals or {}).items()}
    return log
