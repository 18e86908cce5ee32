"""Hypothesis settings for the simulator's and the pool's property suites.

``LORA_CUPY_HYPOTHESIS_PROFILE`` picks the budget: ``ci`` (the default; the stateful suites
together run in under a minute on two cores) or ``long`` (many more examples and longer
histories, for a soak run). Suites take their settings from ``hypothesis_settings`` rather
than loading a profile globally, so other suites in the same session keep their own.

Imported by tests only: ``import sim`` does not import hypothesis.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from .nodes import NodeAdapter, NodeRequest

PROFILE_ENV = "LORA_CUPY_HYPOTHESIS_PROFILE"
PROFILES = {
    # name: (example multiplier, step-count multiplier)
    "ci": (1, 1),
    "long": (20, 3),
}


def profile_name() -> str:
    name = os.environ.get(PROFILE_ENV, "ci").strip() or "ci"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={name!r}: expected one of {sorted(PROFILES)}")
    return name


def hypothesis_settings(max_examples: int, stateful_step_count: int | None = None, **extra) -> settings:
    """Settings for one suite: its ci budget, scaled up under the long profile."""
    ex, steps = PROFILES[profile_name()]
    kw = dict(max_examples=max_examples * ex, deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    if stateful_step_count is not None:
        kw["stateful_step_count"] = stateful_step_count * steps
    kw.update(extra)
    return settings(**kw)


@st.composite
def node_workloads(draw):
    """``(adapters, requests, encoder_slots, llm_slots)`` for ``sim.drain``: 1-5 adapters, each
    with something for the encoder, the LLM, both or neither; 1-12 requests (some base, some
    with an image, some whose walk reaches the encoder after the LLM); 1-3 usable slots each."""
    n_adapters = draw(st.integers(1, 5))
    adapters = [NodeAdapter(f"a{i}", draw(st.booleans()), draw(st.booleans())) for i in range(n_adapters)]
    names = [a.name for a in adapters]
    reqs = [NodeRequest(i, draw(st.none() | st.sampled_from(names)), draw(st.booleans()),
                        draw(st.integers(1, 4)), draw(st.integers(0, 6)), encoder_after_llm=draw(st.booleans()))
            for i in range(draw(st.integers(1, 12)))]
    return adapters, reqs, draw(st.integers(2, 4)), draw(st.integers(2, 4))
