"""What the adapters know about a run, handed to its detector as one object.

The step stream gathers these facts from the part of the package that knows
each (the model when the run starts, a `RetracingMonitor`, `kg.watch`,
diagnose's custom-loop patch, Keras having made the logs numbers) and hands
the whole object to the run's `OscillationDetector` (`tell`) whenever one
changes; nothing else sets the detector's view of the run.
"""

from typing import NamedTuple, Optional

__all__ = ["RunFacts"]


class RunFacts(NamedTuple):
    """Facts about one run that its judgement needs.

    Attributes:
        jit: whether the step is XLA-compiled (None: not known).
        eager: whether the step runs eagerly.
        eager_where: `file:line` where the step was made eager, or None.
        stall_where: `file:line` of the loop-body work a periodic stall runs
            (`kg.watch`'s samples of its long cycles), or None.
        synced: whether each step is timed where its device work ends
            (None: not known).
        thresholds: this run's threshold overrides by name (a
            `RetracingMonitor`'s `max_new_shapes`); a dict, never changed
            in place (`merged` makes a new one).
        async_blockers: names of the callbacks that turned Keras's
            asynchronous dispatch off (`sync_callbacks`), or None (it is
            on, or the backend has none).
        input_source: the kind of fit's Python data source (`PyDataset`,
            `Generator`, ...: `INPUT_SOURCE_FIXES`), or None.
        input_workers: the workers that make its batches in parallel (a
            `PyDataset`'s), or None.
        input_in: the phase that holds the input's time where its wait is
            not measured: `step` (`fit` takes each batch inside its train
            function), `between` (a loop that calls the hooks itself takes
            its batch between them), or None (not known, or a custom-loop
            wrapper times the input itself: `kg.watch`).
    """

    jit: Optional[bool] = None
    eager: bool = False
    eager_where: Optional[str] = None
    stall_where: Optional[str] = None
    synced: Optional[bool] = None
    thresholds: dict = {}
    async_blockers: Optional[tuple] = None
    input_source: Optional[str] = None
    input_workers: Optional[int] = None
    input_in: Optional[str] = None

    def merged(self, **changes) -> "RunFacts":
        """A copy with `changes`; `thresholds` are added to the current ones."""
        if "thresholds" in changes:
            changes["thresholds"] = {**self.thresholds, **changes["thresholds"]}
        return self._replace(**changes)
