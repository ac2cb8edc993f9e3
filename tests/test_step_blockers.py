"""What stops tf.function from running a user's eager step as written (no TensorFlow)."""

import inspect

from keras_gpufix.analysis.verdicts import compiled_step_fix
from keras_gpufix.diagnose.step_blockers import own_wrappers, step_blockers

HERE = __file__


class Trainer:
    def __init__(self):
        self.current_step = 0

    def step(self, batches):
        total = None
        for batch in batches:  # a loop TensorFlow would run (over a tensor or dataset)
            total = batch if total is None else total + batch
            last = batch
        for i in range(3):  # a Python loop: autograph leaves it in Python
            value = i
        self.current_step += 1
        return float(total), last.numpy(), value


def _compiled_path(trainer, tf, use_tf_function):
    """A trainer's own compiled step, behind a flag (never called here)."""
    if use_tf_function:
        return tf.function(trainer.step, jit_compile=True)
    return trainer.step


def _line(text):
    lines, first = inspect.getsourcelines(Trainer.step)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_step_that_traced_keeps_only_the_python_state_it_changes():
    (state,) = step_blockers(Trainer.step)
    assert state["kind"] == "python_state" and state["code"] == "self.current_step += 1"
    assert state["where"] == f"{HERE}:{_line('self.current_step += 1')}"
    # the measured fix says to move it out first, by its line
    fix = compiled_step_fix({"function": "step (t.py:1)", "eager_ms": 9.0, "function_ms": 3.0,
                             "xla_ms": 2.0, "best": "tf.function(jit_compile=True)",
                             "best_ms": 2.0, "blockers": [state]})
    assert fix.startswith("wrap the step step (t.py:1) in tf.function(jit_compile=True)")
    assert f"first move the Python state it changes out of it ({state['where']}" in fix


def test_a_step_that_failed_to_trace_names_every_blocker_by_its_line():
    error = ValueError(f'in user code:\n\n    File "{HERE}", line {_line("for batch in")}, in '
                       "step  *\n        for batch in batches:\n\n    ValueError: 'total' is "
                       "not allowed to be None before the loop\n")
    found = {(b["kind"], b["where"].rsplit(":", 1)[1]): b for b in
             step_blockers(Trainer.step, error, library=("/nowhere",))}
    assert set(found) == {
        ("none_before_loop", str(_line("total = None"))),  # the trace's error, at its line
        ("none_before_loop", str(_line("for batch in"))),  # `last`: set inside, read after
        ("python_state", str(_line("self.current_step"))),
        ("host_read", str(_line("return float"))),
    }
    none = found[("none_before_loop", str(_line("total = None")))]
    assert "is not allowed to be None before the loop" in none["message"]
    assert "'last' is first set inside the loop" in found[
        ("none_before_loop", str(_line("for batch in")))]["message"]
    # `value`, set in a Python loop, is no blocker; the fix promises no measured gain
    fix = compiled_step_fix({"function": "step (t.py:1)", "reason": "could not trace",
                             "blockers": list(found.values())})
    assert "cannot run it as written: change the 4 lines below first" in fix


def test_the_scripts_own_tf_function_of_the_step_is_named_as_the_path_to_take():
    (wrapper,) = own_wrappers(Trainer.step)
    assert wrapper["code"] == "return tf.function(trainer.step, jit_compile=True)"
    lines, first = inspect.getsourcelines(_compiled_path)
    line = first + next(i for i, text in enumerate(lines) if "return tf" in text)
    assert wrapper["where"] == f"{HERE}:{line}"
    assert own_wrappers(_line) == []  # no tf.function of it anywhere
    measured = {"function": "step (t.py:1)", "eager_ms": 9.0, "function_ms": 3.0,
                "xla_ms": None, "best": "tf.function", "best_ms": 3.0, "blockers": [],
                "own_wrappers": [wrapper]}
    fix = compiled_step_fix(measured)
    assert (f"the script already wraps it in tf.function at {wrapper['where']} "
            f"(`{wrapper['code']}`): take that path") in fix
    assert "not that path's arguments" in fix  # what diagnose did not check
    blocked = compiled_step_fix({"function": "step (t.py:1)", "reason": "could not trace",
                                 "blockers": step_blockers(Trainer.step),
                                 "own_wrappers": [wrapper]})
    assert blocked.endswith(f"the script's own tf.function of it at {wrapper['where']} "
                            f"(`{wrapper['code']}`) needs the same changes")
