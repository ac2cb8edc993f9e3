"""The step stream's feed of the run's one detector.

One `analysis.OscillationDetector` judges a run: the first
`GPUOscillationMonitor`'s, else one with the default settings. What is known
about the run reaches it as one `analysis.RunFacts` (`tell`); its
judgements and events are handed to every member as records are added.
"""

from keras_gpufix.analysis import OscillationDetector, RunFacts

__all__ = ["DetectorFeed"]


class DetectorFeed:
    """The run's detector, what it was told, and the records fed to it.

    Attributes:
        detector: the run's one `OscillationDetector`.
        facts: the `analysis.RunFacts` it was last told.
    """

    def __init__(self):
        self.detector = OscillationDetector()
        self.facts = RunFacts()
        self._own = True  # the default detector, not a member's
        self._logs_seen = False

    def adopt(self, detector):
        """Judges with `detector` (a member's) instead of the default, once per run."""
        if self._own and isinstance(detector, OscillationDetector):
            self.detector, self._own = detector, False
            detector.reset()
            detector.tell(self.facts)

    def tell(self, **facts):
        """Merges `RunFacts` fields by name (`thresholds` are added) and tells the detector."""
        self.facts = self.facts.merged(**facts)
        self.detector.tell(self.facts)

    def saw_logs(self):
        """An end hook got Keras logs (any thread): Keras waited for the step."""
        self._logs_seen = True

    def note_synced(self):
        """Tells the detector the steps are synced once logs were seen (the loop's thread)."""
        if self._logs_seen and self.facts.synced is None:
            self.tell(synced=True)

    def judge(self, records, deliver):
        """Adds `records` to the detector; `deliver(name, *args)` hands on each
        judgement (`_on_judgement`, with the last step it covers) and event (`_on_event`)."""
        det = self.detector
        for record in records:
            judged = det.judgements
            event = det.update(record)
            if det.judgements != judged:
                deliver("_on_judgement", det.last_judgement, record.index + record.steps - 1)
            if event is not None:
                deliver("_on_event", event)

    def finish(self, deliver):
        """The final judgement at the end of training; its event, if any, through `deliver`."""
        event = self.detector.finish()
        if event is not None:
            deliver("_on_event", event)
