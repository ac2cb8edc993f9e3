"""A check over every printed line of a run's report (issue 47): each figure inside its own
range, the headline's gain the top fix's wherever it is said again, and step counts that
agree between the report's lines and the monitors' lines."""

import re

_RANGED = re.compile(r"(\d+(?:\.\d+)?)x \((\d+(?:\.\d+)?)x-(\d+(?:\.\d+)?)x")
_HEADLINE_GAIN = re.compile(r"^fix: .*: the (?:whole run|steps) (?:at most )?(\d+\.\d+)x faster",
                            re.M)
_FIT = re.compile(r"^(?:fit|loop) \d+: (\d+) steps in [0-9.]+ s(?: \(stopped by --steps\))?"
                  r"(?:; the (\d+) steady ones took [^;]*(?:; the other (\d+) \(warm-up)?)?",
                  re.M)
_MONITOR_STEADY = re.compile(r"^  (\d+) steady steps in ", re.M)


def check_report_lines(text: str) -> dict:
    """Asserts the report's figures hold together; returns what it checked (counts), so
    a caller can assert that there was something to check."""
    ranged = _RANGED.findall(text)
    for x, low, high in ranged:  # a figure and its range contain each other
        assert float(low) <= float(x) <= float(high), (x, low, high)
    gains = _HEADLINE_GAIN.findall(text)
    assert len(gains) <= 1, gains  # one headline, one gain
    if gains:  # the top fix says the same gain where it says it again
        top = re.search(r"^  1\. \[.*\n     (predicted: .*)$", text, re.M)
        if top and "x" in top.group(1):
            assert f"{gains[0]}x" in top.group(1), (gains[0], top.group(1))
    fits = _FIT.findall(text)
    for total, steady, other in fits:  # every step counted once: steady + the others
        if steady:
            assert int(total) == int(steady) + int(other or 0), (total, steady, other)
    steady = [int(s) for _, s, _ in fits if s]
    monitors = [int(s) for s in _MONITOR_STEADY.findall(text)]
    if fits and monitors:  # the monitors' lines count the steps the report counts
        assert monitors == steady, (monitors, steady)
    return {"ranges": len(ranged), "gains": len(gains), "fits": len(fits),
            "monitors": len(monitors)}
