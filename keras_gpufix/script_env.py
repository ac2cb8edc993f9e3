"""The script diagnose runs: its command resolved, and the environment it sets itself.

`keras-gpufix diagnose` runs a training script in its own process, after it has
imported NumPy and Keras (with TensorFlow or JAX) itself. Variables those libraries
read once, at import (`OPENBLAS_NUM_THREADS`, `OMP_NUM_THREADS`, `KERAS_BACKEND`,
`XLA_FLAGS`, `TF_*`, ...), set at the top of the script would then come too late:
the script would run with other BLAS threads, another backend or other flags than it
does alone, and the run measured would not be the user's. `apply` sets them first.

Stdlib only: the CLI calls it before it imports anything that imports NumPy.
"""

import ast
import importlib.util
import os

# what diagnose imports before the script runs: an assignment after the script's own
# import of one of these is left to the script (it runs at its own moment); after its
# NumPy import, only the BLAS threads' variables are (NumPy read them there)
_IMPORTED_FIRST = frozenset({"tensorflow", "keras", "jax", "jaxlib", "keras_gpufix"})
_READ_BY_NUMPY = ("OPENBLAS_", "OMP_", "MKL_", "BLIS_", "GOTO_", "VECLIB_", "NUMEXPR_")


def resolve(command):
    """`(kind, target, argv)` for `python train.py ARGS`, `train.py ARGS`, `-m mod ARGS`
    or `-c CODE ARGS` (kind `script`, `module` or `code`; target: the script's
    absolute path, the module's name or the code).

    Raises:
        ValueError: where the command names no script, module or code to run.
    """
    command = list(command)
    if command and os.path.basename(command[0]).startswith("python") and (
            len(command) == 1 or not command[0].endswith(".py")):
        command = command[1:]
    if not command:
        raise ValueError("no script given: use `keras-gpufix diagnose -- python train.py ARGS`")
    if command[0] == "-c":
        if len(command) < 2:
            raise ValueError("`-c` needs the code to run: keras-gpufix diagnose -- python -c "
                             "'CODE'")
        return "code", command[1], ["-c", *command[2:]]
    if command[0] == "-m":
        if len(command) < 2:
            raise ValueError("`-m` needs a module name")
        spec = importlib.util.find_spec(command[1])
        if spec is None or spec.origin is None:
            raise ValueError(f"no module named {command[1]!r}")
        return "module", command[1], [spec.origin, *command[2:]]
    if not os.path.isfile(command[0]):
        raise ValueError(f"script not found: {command[0]} (diagnose runs a script file, "
                         "`-m module` or `-c CODE`)")
    return "script", os.path.abspath(command[0]), command


def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _text(node):
    """The constant string `node` holds, or None."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _settings(stmt):
    """`[(name, value, only_if_unset)]` that module-level statement `stmt` makes of
    `os.environ` with constant strings (`os.environ["K"] = "v"`, chained targets too;
    `os.environ.setdefault("K", "v")`; `os.environ.update({"K": "v"}, K2="v2")`)."""
    if isinstance(stmt, ast.Assign) and _text(stmt.value) is not None:
        return [(_text(t.slice), stmt.value.value, False) for t in stmt.targets
                if isinstance(t, ast.Subscript) and _is_environ(t.value)
                and _text(t.slice) is not None]
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and _is_environ(call.func.value)):
        return []
    args = call.args
    if call.func.attr == "setdefault" and len(args) == 2 and None not in map(_text, args):
        return [(_text(args[0]), _text(args[1]), True)]
    if call.func.attr == "update":
        pairs = [(_text(k), v) for k, v in zip(args[0].keys, args[0].values)] if (
            len(args) == 1 and isinstance(args[0], ast.Dict)) else []
        pairs += [(k.arg, k.value) for k in call.keywords if k.arg]
        return [(k, _text(v), False) for k, v in pairs
                if k is not None and _text(v) is not None]
    return []


def _imported(stmt):
    """The top-level names of the modules `stmt` imports."""
    names = ([a.name for a in stmt.names] if isinstance(stmt, ast.Import)
             else [stmt.module or ""] if isinstance(stmt, ast.ImportFrom) else [])
    return {n.split(".")[0] for n in names}


def script_environment(path):
    """`[(name, value, only_if_unset)]`: the environment variables the script at
    `path` sets to constant strings at its top level before it imports any of the
    libraries diagnose imports first (Keras, TensorFlow, JAX; for the BLAS threads'
    variables, NumPy); `[]` where the file cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    found, numpy = [], False
    for stmt in tree.body:
        imported = _imported(stmt)
        if imported & _IMPORTED_FIRST:
            break
        numpy = numpy or "numpy" in imported
        found += [s for s in _settings(stmt) if not (numpy and s[0].startswith(_READ_BY_NUMPY))]
    return found


def apply(script):
    """Sets, in this process, the environment the script at `script` sets for itself
    before its imports (`script_environment`), as the script would: an assignment
    sets, a `setdefault` keeps a value already there. Returns `{name: value}` of what
    it set."""
    done = {}
    for name, value, only_if_unset in script_environment(script):
        if only_if_unset and name in os.environ and name not in done:
            continue
        os.environ[name] = done[name] = value
    return done
