"""Which of the static scan's flagged lines the run executed, at no cost per step.

A finding at a line the run never executed (a `run_eagerly=True` under an
`if debug:` that was False) is not a cause of this run. No tracing hook is
used (`sys.settrace` would slow every Python call, the eager step's
included, and so distort what diagnose measures): each file that holds a
finding is compiled with one marker call before the statement at each
flagged line, and the marker records the line the first time it runs. The
script itself runs from that code as `__main__` (as `runpy.run_path` runs
it), its own modules through an import finder that loads them the same way;
the line numbers, and so tracebacks, stay the file's own.
"""

import ast
import builtins
import importlib.abc
import importlib.machinery
import linecache
import os
import sys
import types

__all__ = ["LinesRun"]

MARK = "__keras_gpufix_line_ran__"


def _span(stmt):
    return stmt.lineno, getattr(stmt, "end_lineno", None) or stmt.lineno


def _blocks(stmt):
    """The statement lists nested directly in `stmt` (bodies, else, handlers, cases)."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(stmt, field, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield stmt, field
    for child in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())):
        yield child, "body"


class LinesRun:
    """Context manager: the run's flagged lines, and which of them ran.

    Args:
        findings: the static scan's findings (`file`, `line`).
        sources: `{path: text}` of files to run from that text instead of the file
            (a patch applied in memory: `patched_run`); tracebacks, `inspect` and
            AutoGraph read it too. Defaults to None.
    """

    def __init__(self, findings, sources=None):
        self.lines = {}
        self.sources = {os.path.abspath(p): text for p, text in (sources or {}).items()}
        for path in self.sources:
            self.lines.setdefault(path, set())
        for f in findings:
            self.lines.setdefault(os.path.abspath(f["file"]), set()).add(f["line"])
        self.ran = set()  # (absolute file, line)
        self.instrumented = set()  # files that ran from marked code
        self._finder = None

    def __enter__(self):
        self._finder = _Finder(self)
        sys.meta_path.insert(0, self._finder)
        if self.sources:
            self._updatecache = linecache.updatecache
            linecache.updatecache = self._lines  # AutoGraph re-reads a module's file with it
            for path in self.sources:
                self._lines(path)
        return self

    def _lines(self, filename, module_globals=None):
        """`linecache.updatecache` that keeps a patched file's text (no mtime: never
        checked against the file)."""
        text = self.sources.get(filename)
        if text is None:
            return self._updatecache(filename, module_globals)
        lines = text.splitlines(True)
        linecache.cache[filename] = (len(text), None, lines, filename)
        return lines

    def __exit__(self, *exc):
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        if self.sources:
            linecache.updatecache = self._updatecache
            for path in self.sources:
                linecache.cache.pop(path, None)
        return False

    def status(self, finding):
        """True when the finding's line ran, False when it never did, None when not known
        (its file did not run from marked code)."""
        path = os.path.abspath(finding["file"])
        if path not in self.instrumented:
            return None
        return (path, finding["line"]) in self.ran

    def code(self, path):
        """`path` compiled with its markers, or None (no finding there, or it cannot be)."""
        path = os.path.abspath(path)
        wanted = self.lines.get(path)
        if not wanted and path not in self.sources:
            return None
        try:
            if path in self.sources:
                text = self.sources[path]
            else:
                with open(path, "rb") as f:
                    text = f.read()
            tree = ast.parse(text, path)
            tree.body = self._mark(tree.body, wanted)
            return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            return None

    def namespace(self, path):
        """The marker for the globals of the module made from `path`."""
        path = os.path.abspath(path)
        ran = self.ran
        self.instrumented.add(path)

        def mark(line):
            ran.add((path, line))

        return {MARK: mark}

    def run_main(self, path):
        """Runs the script `path` as `__main__` from its marked code (as `runpy.run_path`);
        returns False, without running it, when it has no marked code."""
        code = self.code(path)
        if code is None:
            return False
        module = types.ModuleType("__main__")
        module.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                               __loader__=None, __package__=None, __spec__=None,
                               **self.namespace(path))
        saved = sys.modules.get("__main__")
        sys.modules["__main__"] = module
        try:
            exec(code, module.__dict__)
        finally:
            sys.modules["__main__"] = saved
        return True

    def _mark(self, block, wanted):
        """`block` with a marker before each statement that holds a wanted line
        (the innermost statement that does)."""
        out = []
        for stmt in block:
            first, last = _span(stmt)
            here = {line for line in wanted if first <= line <= last}
            for owner, field in _blocks(stmt):
                inner = getattr(owner, field)
                here -= {line for s in inner for line in wanted
                         if _span(s)[0] <= line <= _span(s)[1]}
                setattr(owner, field, self._mark(inner, wanted))
            for line in sorted(here):
                call = ast.Call(ast.Name(MARK, ast.Load()), [ast.Constant(line)], [])
                out.append(ast.copy_location(ast.Expr(call), stmt))
            out.append(stmt)
        return out


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the user's modules that hold findings from their marked code."""

    def __init__(self, lines):
        self.lines = lines
        # module names the files could have (`pkg/viz.py` -> "viz", `pkg/__init__.py` ->
        # "pkg"): any other import goes straight to the usual finders
        self.names = {os.path.basename(os.path.dirname(f)) if f.endswith("__init__.py")
                      else os.path.splitext(os.path.basename(f))[0] for f in lines.lines}

    def find_spec(self, name, path, target=None):
        if name.rpartition(".")[2] not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = spec and spec.origin
        if not origin or os.path.abspath(origin) not in self.lines.lines:
            return None
        code = self.lines.code(origin)
        if code is None:
            return None
        spec.loader = _Loader(self.lines, origin, code)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, lines, origin, code):
        self.lines, self.origin, self.code = lines, origin, code

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__dict__.update(self.lines.namespace(self.origin))
        exec(self.code, module.__dict__)
