"""kvsim's replay from Python: the same engine, policies and results (docs/python.md).

    >>> import kvscope.sim as ks
    >>> res = ks.sweep("traces/tiny-shapes-fine.h5", ["h2o", "snapkv", "int8"], [0.2, 0.5])
    >>> res.df                 # pandas DataFrame with exactly kvsim's CSV columns
    >>> ks.write_results(res, "results.h5")   # the HDF5 results file (docs/results-format.md)

C++ runs with the GIL released; errors are raised with the C++ message (PolicyError and TraceError are
ValueErrors, ReportError an OSError).
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from kvscope._native import core
from kvscope.trace import Trace

PolicyError = core.PolicyError
ReportError = core.ReportError
TraceError = core.TraceError
Policy = core.Policy

TraceLike = Union[str, os.PathLike, Trace]
PolicyLike = Union[str, "core.Policy"]
BudgetLike = Union[str, float, int, None]
Progress = Union[bool, None, Callable[[int, int], Any]]


def policy(name: str, *, rename: Optional[str] = None, policy_files: Sequence[str] = (), **params: Any) -> Policy:
    """A policy: a preset (``"h2o"``), a composition (``"h2o+int8"``, ``"h2o~decode:4"``), an INI policy of
    `policy_files`, or a custom scorer registered with kvscope.stages, with INI keys set on top, e.g.
    ``policy("h2o", scorer="my-scorer", rename="my-h2o")`` or ``policy("snapkv", snap_window=16)``.
    Parameter names and meanings: `parameters()`. Raises PolicyError for unknown names or bad values."""
    return core.make_policy(name, dict(params), [os.fspath(f) for f in policy_files], rename or "")


def policies(policy_files: Sequence[str] = ()) -> list:
    """Names of every preset (and of the INI policies of `policy_files`), from the C++ registry."""
    return core.policy_names([os.fspath(f) for f in policy_files])


def parameters() -> list:
    """(key, meaning) of every key a policy (INI section or `policy(**params)`) may set."""
    return core.policy_parameters()


def _policy(p: PolicyLike, policy_files: Sequence[str]) -> Policy:
    if isinstance(p, core.Policy):
        return p
    if not isinstance(p, str):
        raise TypeError(f"a policy is a name or a kvscope.sim.policy(...), not {type(p).__name__}")
    return policy(p, policy_files=policy_files)


def _budget_text(b: BudgetLike) -> str:
    if b is None:
        return "-"
    if isinstance(b, bool):
        raise TypeError("a budget is a fraction (0.3), a token count ('512tok') or bytes ('64MiB'), not a bool")
    if isinstance(b, (int, float)):
        return repr(float(b)) if isinstance(b, float) else str(b)
    if isinstance(b, str):
        return b
    raise TypeError(f"a budget is a number or a string, not {type(b).__name__}")


def _budgets_text(budgets: Union[str, BudgetLike, Iterable[BudgetLike]]) -> str:
    if isinstance(budgets, str):
        return budgets
    if budgets is None or isinstance(budgets, (int, float)):
        return _budget_text(budgets)
    return ",".join(_budget_text(b) for b in budgets)


def _trace_path(trace: TraceLike) -> str:
    return trace.path if isinstance(trace, Trace) else os.fspath(trace)


def _progress(progress: Progress, label: str):
    """A callback (done, total) for the C++ replay: tqdm when installed (notebook-aware), else a line on
    stderr; a callable is used as is; False / None: none."""
    if progress is None or progress is False:
        return None, lambda: None
    if callable(progress):
        return progress, lambda: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=1, desc=label, unit="step")

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.n = done
            bar.refresh()

        return update, bar.close

    def line(done: int, total: int) -> None:
        sys.stderr.write(f"\r{label}: {done}/{total}")
        sys.stderr.flush()

    return line, lambda: sys.stderr.write("\n")


class Results:
    """The results of `run` or `sweep`: `df` (the CSV's rows), `points()`, `table()`, the warnings, and the
    writers `write_hdf5` / `write_csv` (the same files as kvsim -o / --csv)."""

    def __init__(self, native: "core.Results"):
        self._native = native
        self._df = None

    @property
    def df(self):
        """pandas DataFrame with exactly kvsim's CSV columns and rows (one per point x layer x modality, with
        "all" rows; docs/results-format.md), read from the same CSV writer."""
        if self._df is None:
            import pandas as pd

            # Empty fields (no flags) stay empty strings, as in the file; "nan" reads as NaN.
            self._df = pd.read_csv(io.StringIO(self._native.csv()), keep_default_na=False, na_values=["nan"])
        return self._df

    def points(self) -> list:
        """One dict per point: policy, budget, mode, kind, budget_value, bytes_ratio, bytes_full, bytes_kept,
        output_error, attention_recall, kl, pareto, seconds, flags."""
        return self._native.points()

    def table(self) -> str:
        """kvsim's stdout table."""
        return self._native.table()

    def csv(self) -> str:
        """The CSV file's text."""
        return self._native.csv()

    def write_hdf5(self, path: Union[str, os.PathLike]) -> None:
        """The HDF5 results file (format kvscope-results; written to PATH.partial, then renamed)."""
        self._native.write_hdf5(os.fspath(path))

    def write_csv(self, path: Union[str, os.PathLike]) -> None:
        """The CSV file (written to PATH.partial, then renamed)."""
        self._native.write_csv(os.fspath(path))

    @property
    def warnings(self) -> list:
        """The replay's warnings (budgets raised to the forced set, ignored budgets, ...)."""
        return self._native.warnings

    @property
    def backend(self) -> str:
        """The kernels that computed the results."""
        return self._native.backend

    @property
    def context_tokens(self) -> int:
        return self._native.context_tokens

    @property
    def decode_steps(self) -> int:
        return self._native.decode_steps

    def __repr__(self) -> str:
        return f"<kvscope Results: {len(self.points())} points, {self._native.trace_path}>"


def write_results(results: Results, path: Union[str, os.PathLike]) -> None:
    """Writes `results` as kvsim does: a ``.csv`` path gets the CSV file, any other the HDF5 results file."""
    p = os.fspath(path)
    if p.lower().endswith(".csv"):
        results.write_csv(p)
    else:
        results.write_hdf5(p)


def _command_line(fn: str, **kw: Any) -> str:
    """What the results files store as the command line: the Python call."""
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"kvscope.sim.{fn}({args})"


def run(
    trace: TraceLike,
    policy: PolicyLike,
    budget: BudgetLike = None,
    *,
    policy_files: Sequence[str] = (),
    question_in_context: bool = False,
    threads: int = 0,
    backend: str = "cpu",
    blind_recall: float = 0.5,
    kl_threshold: float = 0.1,
    progress: Progress = False,
) -> Results:
    """Replays `trace` through one policy, as ``kvsim run --policy POLICY@BUDGET``.

    trace: a path or an open kvscope.trace.Trace. policy: a name (``"h2o"``, ``"h2o+int8"``,
    ``"h2o~decode:4"``, ``"h2o@0.3"`` with the budget in it) or a `policy(...)`. budget: a fraction of tokens
    kept per layer and head (0.3), tokens ("512tok") or total bytes ("64MiB"); None for policies that need
    none (quantizers, adaptive, unicache). threads: CPU threads (0 = all cores). backend: "cpu", "cuda" or
    "auto". progress: True for a progress bar (tqdm when installed), or a callable (done, total).
    Raises PolicyError (unknown policy, bad or missing budget), TraceError (missing or bad file)."""
    if isinstance(policy, str) and "@" in policy and budget is None:
        policy, budget = policy.rsplit("@", 1)
    spec = _policy(policy, policy_files)
    cb, close = _progress(progress, "kvscope.sim.run")
    try:
        native = core.run(
            _trace_path(trace),
            spec,
            _budget_text(budget),
            question_in_context,
            threads,
            backend,
            blind_recall,
            kl_threshold,
            cb,
            _command_line("run", trace=_trace_path(trace), policy=spec.name, budget=budget),
        )
    finally:
        close()
    return Results(native)


def sweep(
    trace: TraceLike,
    policies: Union[str, Sequence[PolicyLike]],
    budgets: Union[str, BudgetLike, Iterable[BudgetLike]] = "0.1:0.9:0.1",
    *,
    policy_files: Sequence[str] = (),
    bound: bool = True,
    alloc_search: Optional[PolicyLike] = "tova",
    question_in_context: bool = False,
    threads: int = 0,
    backend: str = "cpu",
    blind_recall: float = 0.5,
    kl_threshold: float = 0.1,
    batch_budgets: bool = True,
    progress: Progress = False,
) -> Results:
    """Replays `trace` through every policy at every budget, as ``kvsim sweep``: policies x budgets points
    (policies that do not compress tokens once, budget "-"), the oracle-topk bound rows (`bound`) and the
    allocation search of one scorer (`alloc_search`, None to skip) beside them, the Pareto front over the
    policies, collapse flags.

    policies: a list of names / `policy(...)` objects, or one comma-separated string. budgets: a list of
    budgets (0.3, "512tok", "64MiB") or kvsim's text ("0.1:0.9:0.1,512tok"). Other arguments as `run`.
    Raises PolicyError, TraceError with the C++ message."""
    if isinstance(policies, str):
        policies = [p for p in policies.split(",")]
    specs = [_policy(p, policy_files) for p in policies]
    search = None if alloc_search is None or alloc_search == "none" else _policy(alloc_search, policy_files)
    text = _budgets_text(budgets)
    cb, close = _progress(progress, "kvscope.sim.sweep")
    try:
        native = core.sweep(
            _trace_path(trace),
            specs,
            text,
            bound,
            search,
            question_in_context,
            threads,
            backend,
            blind_recall,
            kl_threshold,
            batch_budgets,
            cb,
            _command_line("sweep", trace=_trace_path(trace), policies=[s.name for s in specs], budgets=text),
        )
    finally:
        close()
    return Results(native)


def budgets(text: str) -> list:
    """kvsim's budget list syntax expanded: ``budgets("0.1:0.3:0.1,512tok")`` -> ["0.1", "0.2", "0.3", "512tok"]."""
    return core.parse_budget_list(text)


__all__ = [
    "run",
    "sweep",
    "Results",
    "write_results",
    "policy",
    "policies",
    "parameters",
    "budgets",
    "Policy",
    "PolicyError",
    "TraceError",
    "ReportError",
]
