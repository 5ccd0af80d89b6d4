"""``beyond_paper.compile_speedup``: ``Proteus.predict`` with ``compile=default`` (the backbone's prefix and
suffix forwards through ``torch.compile``, :class:`proteus.devices.CompiledForward`) against the same
learner's eager predict, on the same batch, interleaved, after warm-up (the issue's "``torch.compile`` as an
option measured in the bench").

The compile time of the first calls (the full batch, then a smaller one that makes the graphs' batch size
symbolic) is reported apart, with the number of graphs dynamo built; a batch of a third, unseen size is then
timed once to show that it reuses them. The compiled logits are compared with the eager ones (float
round-off: fused kernels may sum in another order).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from perf_settings import Settings, _figure
from perf_state import _State
from perf_timing import _median, interleaved

from proteus import devices


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def section_compile(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    key, case = "compile_speedup", s.compile_case
    st = _State(case, dev, s, s.m)
    st.grow(s.m)
    model = st.learner.model_
    model.prepare_merged()
    x_full = st.x
    backend0 = devices.COMPILE_BACKEND
    devices.COMPILE_BACKEND = s.compile_backend
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            eager = st.predict()
            model.compile_mode = "default"
            g0, t0 = _graphs(), time.perf_counter()
            compiled = st.predict()  # compiles the graphs of this batch size
            st.x = x_full[: max(1, s.batch // 2 + 1)]
            st.predict()  # another size: the batch dimension becomes symbolic
            compile_s, graphs = time.perf_counter() - t0, _graphs() - g0
            st.x = x_full[: max(1, s.batch - 3)]
            t1 = time.perf_counter()
            st.predict()  # an unseen size: no new graph expected
            unseen_s, unseen_graphs = time.perf_counter() - t1, _graphs() - g0 - graphs
            st.x = x_full
            failure = devices._compile_failure
            if failure is not None:
                return {"beyond_paper": {key: _figure(key, None, reason=f"torch.compile failed: {failure}")}}

            def run_eager() -> Any:
                model.compile_mode = "none"
                return st.predict()

            def run_compiled() -> Any:
                model.compile_mode = "default"
                return st.predict()

            t = interleaved({"eager": run_eager, "compiled": run_compiled}, dev, s.compile_reps, warmup=1)
        warned = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    finally:
        model.compile_mode = "none"
        model._compiled.clear()
        st.x = x_full
        devices.COMPILE_BACKEND = backend0
        torch._dynamo.reset()
    te, tc = _median(t["eager"]), _median(t["compiled"])
    diff = float((compiled.logits.double() - eager.logits.double()).abs().max())
    scale = float(eager.logits.double().abs().max())
    same_labels = bool(torch.equal(compiled.label, eager.label))
    log(f"  {case.label}: eager {te:.3f} s, compiled {tc:.3f} s, speedup {te / tc:.3f} "
        f"(compile {compile_s:.1f} s, {graphs} graphs; unseen size {unseen_s:.3f} s, "
        f"{unseen_graphs} new graphs; max |logit diff| {diff:.2e} of {scale:.2e})")  # fmt: skip
    return {
        "beyond_paper": {
            key: _figure(
                key,
                te / tc,
                measured=f"Proteus.predict (the m-forward route, m = {s.m}, batch {s.batch}) eager over the "
                "same with compile=default (torch.compile of the backbone's prefix and suffix forwards, "
                f"backend {s.compile_backend}, dynamic=True), interleaved after warm-up",
                case=case.label,
                backend=s.compile_backend,
                eager_s=te,
                compiled_s=tc,
                eager_times_s=t["eager"],
                compiled_times_s=t["compiled"],
                compile_s=compile_s,
                graphs=graphs,
                unseen_batch_s=unseen_s,
                unseen_batch_new_graphs=unseen_graphs,
                max_abs_logit_diff=diff,
                max_abs_logit=scale,
                same_labels=same_labels,
                warnings=warned,
            )
        }
    }
