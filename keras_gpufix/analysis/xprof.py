"""What an XProf trace says of a run: XProf's own classification by its input share.

`profiling.analyze_trace` reads a trace headless (XProf's
`input_pipeline_analyzer`); the classification of its input share is
XProf's (op_stats_to_input_pipeline_analysis.cc), with its thresholds in
`THRESHOLDS`. `analysis.weigh` weighs the classified traces into the run's
one verdict; a trace never makes a verdict of its own.
"""

from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["classify_input_percent", "reads_not_input_bound"]


def classify_input_percent(percent: "float | None") -> "str | None":
    """XProf's classification of a run by the share of step time spent on input.

    Returns:
        `highly_input_bound` (>= `THRESHOLDS["xprof_highly_input_bound_percent"]`,
        20%), `moderately_input_bound` (>=
        `THRESHOLDS["xprof_moderately_input_bound_percent"]`, 5%),
        `not_input_bound`, or None when `percent` is None.
    """
    if percent is None:
        return None
    if percent >= THRESHOLDS["xprof_highly_input_bound_percent"]:
        return "highly_input_bound"
    if percent >= THRESHOLDS["xprof_moderately_input_bound_percent"]:
        return "moderately_input_bound"
    return "not_input_bound"


def reads_not_input_bound(analysis: dict) -> bool:
    """Whether XProf classified a trace (`profiling.analyze_trace`'s dict) as not
    input-bound by its input wait."""
    return analysis.get("classification") == "not_input_bound"
