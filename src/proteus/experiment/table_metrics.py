"""The metrics of the paper's tables and figures as ``reproduce`` reads them from a run: each a reader of a
run's ``results.json`` (and its ``split.json``) and the format of its values, registered by the name the
tables use (``paper_tables.yaml``'s ``metrics`` gives each its title and unit).

A reader returns ``{None: value}`` for a final metric and ``{task: value}`` (1-based, or ``m`` for
``latency@``) for a per-task one; a missing value is None there and left out of the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proteus.registry import Registry

__all__ = ["READERS", "Reader", "fmt"]

#: (the run's results.json, its split.json or None) -> {None or task: value or None}
Reader = Callable[[dict[str, Any], "dict[str, Any] | None"], "dict[int | None, float | None]"]
#: metric name -> its reader; trait ``format``: the format of its values (two decimals where unset)
READERS: Registry[Reader] = Registry("table metric")


def fmt(metric: str, v: float) -> str:
    """``v`` as the tables print ``metric``'s values (its ``format`` trait, else two decimals)."""
    spec = READERS.trait(metric, "format") if metric in READERS else None
    return format(v, spec if isinstance(spec, str) else ".2f")


def _last(v: Any) -> float | None:
    if isinstance(v, list):
        v = v[-1] if v else None
    return None if v is None else float(v)


def _at(v: Any, i: int) -> float | None:
    if not isinstance(v, list) or not 0 <= i < len(v) or v[i] is None:
        return None
    return float(v[i])


def _number(v: Any) -> float | None:
    return None if v is None else float(v)


def _final(key: str) -> Reader:
    """The last value of the run's list ``key`` (its value after the last task)."""
    return lambda res, split: {None: _last(res.get(key))}


def _per_task(key: str) -> Reader:
    """The run's list ``key`` by task."""

    def read(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
        n = len(res.get("avg_acc") or [])
        return {k + 1: _at(res.get(key), k) for k in range(n)}

    return read


def _theory(key: str) -> Reader:
    """The theory report's ``key`` by task (Sec. 3.2's bounds)."""

    def read(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
        rows = ((res.get("theory") or {}).get("per_task")) or []
        return {int(row["task"]) + 1: _number(row.get(key)) for row in rows}

    return read


def _field(section: str, key: str) -> Reader:
    """The run's ``section.key`` (a final figure)."""
    return lambda res, split: {None: _number((res.get(section) or {}).get(key))}


def _split(read_split: Callable[[dict[str, Any]], Any]) -> Reader:
    """A figure of the run's split (its split.json; none without one)."""
    return lambda res, split: {None: _number(read_split(split))} if split is not None else {}


def _latency(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
    lat = res.get("latency") or {}
    return {int(m): float(s) for m, s in zip(lat.get("m") or [], lat.get("seconds") or [])}


def _s_nonzero(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
    tasks = res.get("tasks") or []
    return {k + 1: _number((t.get("train") or {}).get("s_nonzero_frac")) for k, t in enumerate(tasks)}


def _gpu_memory(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
    peaks = [float(t["peak_gpu_mb"]) for t in res.get("tasks") or [] if t.get("peak_gpu_mb") is not None]
    return {None: max(peaks) if peaks else None}


def _params(res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float | None]:
    tasks = res.get("tasks") or []
    return {None: _number(tasks[-1].get("trainable_params")) if tasks else None}


for _name, _reader, _format in [
    ("acc", _final("final_avg_acc"), None),
    ("forgetting", _final("forgetting"), None),
    ("retrieval", _final("retrieval_acc"), None),
    ("oracle", _final("oracle_avg_acc"), None),
    ("acc@", _per_task("avg_acc"), None),
    ("retrieval@", _per_task("retrieval_acc"), None),
    ("latency@", _latency, ".3f"),
    ("delta@", _theory("delta_mean"), None),
    ("min_delta@", _theory("min_delta_mean"), None),
    ("min_delta_a23@", _theory("min_delta_mean_a23"), None),
    ("s_nonzero@", _s_nonzero, ".3f"),
    ("orthogonality", _field("orthogonality", "max_abs_offdiag"), ".1e"),
    ("inference", _field("inference", "seconds"), ".3f"),
    ("gpu_memory", _gpu_memory, None),
    ("params", _params, ",.0f"),
    ("n_train", _split(lambda s: ((s.get("splits") or {}).get("train") or {}).get("count")), ",.0f"),
    ("n_test", _split(lambda s: ((s.get("splits") or {}).get("test") or {}).get("count")), ",.0f"),
    ("classes", _split(lambda s: s.get("num_classes")), ",.0f"),
    # computed from two others' means over seeds once every run is read (reproduce's _gains): none per run
    ("retrieval_gain", lambda res, split: {}, None),
]:  # fmt: skip
    READERS.register(_name, **({"format": _format} if _format else {}))(_reader)
