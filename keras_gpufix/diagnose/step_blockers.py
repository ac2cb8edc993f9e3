"""What stops `tf.function` from running the user's eager step as it runs eagerly.

Before diagnose tells a user to wrap an eager step in `tf.function`, it
tries (`what_if.compile_step`). Whether or not the trace succeeds, the
advice must hold when followed, so the step's own code is read (its
source, `ast`) and the trace's error, if any, is parsed, for the patterns
that break or silently change a step under `tf.function`:

| kind               | seen as                                  | under tf.function           |
|--------------------|------------------------------------------|-----------------------------|
| `python_state`     | `self.step += 1`, `self.x = ...`, a      | runs once, at trace time,   |
|                    | `global`/`nonlocal` name assigned        | not every step (no error)   |
| `host_read`        | `.numpy()`, `.item()`, `.tolist()`,      | no value at trace time:     |
|                    | `float(t)` / `int(t)` / `bool(t)` of a   | AttributeError / TypeError  |
|                    | non-constant; the trace's error          |                             |
| `none_before_loop` | the trace's error "'x' is not allowed to | ValueError at trace time    |
|                    | be None before the loop" / "must be      |                             |
|                    | defined before the loop"; `x = None`, or |                             |
|                    | `x` unset, before a loop over a tensor   |                             |
|                    | or dataset that sets `x` (read after it) |                             |
| `trace_error`      | any other error of the trace, at its     | as raised                   |
|                    | deepest user line                        |                             |

`own_wrappers` finds where the script itself wraps the step's function in
`tf.function` (`tf.function(self.train_step, ...)`, in a branch this run
may not have taken): the smallest change is then to take that path.

Each blocker is named by the user's `file:line` and the code there; the
texts the report prints are `analysis.STEP_BLOCKERS`. Only the step's own
function is read statically; a blocker in a function it calls is found
when it is the trace's (first) error.
"""

import ast
import inspect
import re
import textwrap

__all__ = ["step_blockers", "own_wrappers"]

#: Loops autograph leaves in Python (their iterable is a Python object).
_PYTHON_ITERABLES = {"range", "enumerate", "zip", "reversed", "sorted", "list", "tuple", "dict",
                     "set", "items", "keys", "values"}
#: Calls that read a tensor's value into Python.
_READ_METHODS = {"numpy", "item", "tolist"}
_READ_BUILTINS = {"float", "int", "bool"}


def _source(fn):
    """(dedented source, first line, file) of `fn`, or None when it has none."""
    try:
        lines, first = inspect.getsourcelines(fn)
        return textwrap.dedent("".join(lines)), first, inspect.getsourcefile(fn)
    except (OSError, TypeError):
        return None


def _python_loop(node):
    """Whether a `for` loop's iterable is one autograph leaves to Python."""
    it = node.iter
    if isinstance(it, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        return True
    if isinstance(it, ast.Call):
        name = it.func.attr if isinstance(it.func, ast.Attribute) else getattr(it.func, "id", "")
        owner = getattr(getattr(it.func, "value", None), "id", None)
        return name in _PYTHON_ITERABLES and owner not in ("tf",)
    return False


def _assigned(node):
    """Names a statement's body assigns (plain names)."""
    return {t.id for n in ast.walk(node) for t in getattr(n, "targets", [getattr(n, "target",
                                                                                   None)])
            if isinstance(t, ast.Name)}


class _Reader(ast.NodeVisitor):
    """The static blockers of one function's body (not of functions nested in it)."""

    def __init__(self):
        self.found = []  # (kind, line number in the source, details)
        self.shared = set()  # global / nonlocal names
        self._depth = 0

    def visit_FunctionDef(self, node):
        self._depth += 1
        if self._depth == 1:
            self.generic_visit(node)
            self._loop_vars(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        return None

    def visit_ClassDef(self, node):
        return None

    def visit_Global(self, node):
        self.shared.update(node.names)

    visit_Nonlocal = visit_Global

    def _target(self, target, node):
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._target(t, node)
        elif isinstance(target, ast.Attribute) or (isinstance(target, ast.Name)
                                                   and target.id in self.shared):
            self.found.append(("python_state", node.lineno, {}))

    def visit_Assign(self, node):
        for target in node.targets:
            self._target(target, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self._target(node.target, node)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _READ_METHODS and not node.args:
            self.found.append(("host_read", node.lineno, {}))
        elif (isinstance(func, ast.Name) and func.id in _READ_BUILTINS and len(node.args) == 1
              and not isinstance(node.args[0], ast.Constant)):
            self.found.append(("host_read", node.lineno, {}))
        self.generic_visit(node)

    def _loop_vars(self, node):
        """A TensorFlow loop (over a tensor or dataset) at the top of the body that sets
        a name which is None before it (`x = None`) or not set before it and read after."""
        defined = {a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                   *node.args.kwonlyargs, node.args.vararg, node.args.kwarg)
                   if a is not None}
        nones = {}
        for i, stmt in enumerate(node.body):
            if isinstance(stmt, (ast.For, ast.While)) and not (
                    isinstance(stmt, ast.For) and _python_loop(stmt)):
                later = {n.id for s in node.body[i + 1:] for n in ast.walk(s)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                inside = _assigned(stmt) - (_assigned(ast.Module(body=[stmt.target], type_ignores=[]))
                                            if isinstance(stmt, ast.For) else set())
                for name in sorted(inside & set(nones)):
                    self.found.append(("none_before_loop", nones.pop(name),
                                       {"name": name, "loop_line": stmt.lineno}))
                for name in sorted((inside - defined) & later):
                    self.found.append(("none_before_loop", stmt.lineno,
                                       {"name": name, "loop_line": stmt.lineno, "undefined": True}))
            if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                    and stmt.value.value is None):
                nones.update({t.id: stmt.lineno for t in stmt.targets if isinstance(t, ast.Name)})
            defined |= _assigned(stmt)


def _static(fn):
    """The blockers read in `fn`'s own source."""
    source = _source(fn)
    if source is None:
        return []
    text, first, path = source
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    reader = _Reader()
    reader.visit(tree)
    out = []
    for kind, number, details in reader.found:
        code = lines[number - 1].strip() if number <= len(lines) else ""
        message = ""
        if kind == "none_before_loop":
            message = (f"'{details['name']}' is " + ("first set inside the loop at line {}, "
                       "and read after it" if details.get("undefined") else
                       "None before the loop at line {}").format(
                           first + details["loop_line"] - 1))
        out.append({"kind": kind, "where": f"{path}:{first + number - 1}", "code": code,
                    "message": message, "name": details.get("name")})
    return out


_USER_LINE = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*(.*)')


def _traced(exc, library):
    """The blocker the trace's error names: its kind, the deepest user line the
    error message (autograph's "in user code:") or the traceback names."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = lines[-1] if lines else type(exc).__name__
    frames = [m for m in _USER_LINE.finditer(text) if not m.group(1).startswith(library)]
    if frames:
        path, number, code = frames[-1].groups()
    else:
        import traceback

        tb = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(library) and not f.filename.startswith("<")
              and "__autograph_generated" not in f.filename]
        if not tb:
            return None
        path, number, code = tb[-1].filename, tb[-1].lineno, tb[-1].line or ""
    if ("is not allowed to be None before the loop" in message
            or "must be defined before the loop" in message):
        kind = "none_before_loop"
    elif ("has no attribute 'numpy'" in message or "has no attribute 'item'" in message
          or "argument must be a string or a" in message or "OperatorNotAllowedInGraph"
          in type(exc).__name__ or "__float__" in message):
        kind = "host_read"
    else:
        kind = "trace_error"
    if not message.startswith(type(exc).__name__):
        message = f"{type(exc).__name__}: {message}"
    return {"kind": kind, "where": f"{path}:{number}", "code": code.strip(), "message": message,
            "name": None}


def step_blockers(fn, exc=None, library=()):
    """What stops `tf.function(fn)` from running the step as it runs eagerly.

    Args:
        fn: the user's step function (plain Python).
        exc: the error `tf.function` raised tracing it, or None when it traced.
        library: path prefixes of library code (never named as the user's line).

    Returns:
        A list of dicts `kind` (`python_state`, `host_read`, `none_before_loop`,
        `trace_error`), `where` (`file:line`), `code` (the line's code) and
        `message` (the trace's error where it named this one, or what was read),
        the trace's error first, each line once. When the step traced, only
        `python_state` (which never fails a trace: it silently runs once) is kept.
    """
    found = _static(fn)
    if exc is None:
        return [b for b in found if b["kind"] == "python_state"]
    traced = _traced(exc, tuple(library) or ("\0",))
    if traced and traced["kind"] == "none_before_loop":  # named at its `x = None` line
        named = re.search(r"'(\w+)' (?:is not allowed|must be defined)", traced["message"])
        line = next((b for b in found if b["kind"] == "none_before_loop" and named
                     and b["name"] == named.group(1)), None)
        if line is not None:
            line["message"] = f"{line['message']}: {traced['message']}"
            traced = None
    out = [traced] if traced else []
    seen = {b["where"] for b in out}
    for blocker in found:
        if blocker["where"] not in seen:
            seen.add(blocker["where"])
            out.append(blocker)
    return out


def own_wrappers(fn) -> list:
    """Where the script's own code wraps `fn` in `tf.function`: each call
    `tf.function(X, ...)` in `fn`'s file whose `X` is `fn`'s name (`step`,
    `self.step`), as a dict `where` (`file:line`) and `code`."""
    try:
        path = inspect.getsourcefile(fn)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError, UnicodeDecodeError):
        return []
    lines, name, out = text.splitlines(), fn.__name__, []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if not (isinstance(node, ast.Call) and node.args and isinstance(func, ast.Attribute)
                and func.attr == "function" and getattr(func.value, "id", None) == "tf"):
            continue
        target = node.args[0]
        if (getattr(target, "id", None) or getattr(target, "attr", None)) == name:
            out.append({"where": f"{path}:{node.lineno}",
                        "code": lines[node.lineno - 1].strip()})
    return sorted(out, key=lambda w: int(w["where"].rpartition(":")[2]))
