"""The real-vLLM verdict tests' comparison of the tap's view with the joined view
(``verdict_runs.tap_view_missed``): a resource against overhead is forgiven only where
both views sit on the verdict's bound, never a phase or a reading far from it."""

from __future__ import annotations

from types import SimpleNamespace

from tests.engines.verdict_runs import on_the_bound, tap_view_missed


def verdict(phase: str, resource: str, flops: float, bandwidth: float = 0.02,
            view: str | None = None) -> dict:
    return {"phase": phase, "resource": resource, "view": view, "text": "",
            "evidence": {"of_achievable_flops": flops, "of_achievable_bandwidth": bandwidth}}


def missed(joined: dict, tap: dict) -> str:
    return tap_view_missed(SimpleNamespace(roofline={"verdict": joined}),
                           {"roofline": {"verdict": tap}})


def test_the_same_verdict_agrees():
    assert not missed(verdict("prefill", "compute", 0.8),
                      verdict("ttft", "compute", 0.78, view="client"))


def test_either_side_of_the_bound_agrees():
    # stop 46's run: the joined view just under 0.6 (overhead), the tap's just over
    joined, tap = verdict("prefill", "overhead", 0.56), verdict("ttft", "compute", 0.6,
                                                                   view="client")
    assert on_the_bound(joined, tap) and not missed(joined, tap)


def test_a_reading_far_from_the_bound_disagrees():
    joined, tap = verdict("prefill", "overhead", 0.3), verdict("ttft", "compute", 0.62,
                                                                  view="client")
    assert not on_the_bound(joined, tap)
    assert "the joined view prefill/overhead (0.32)" in missed(joined, tap)


def test_a_phase_or_view_apart_disagrees_whatever_the_figures():
    joined = verdict("prefill", "overhead", 0.58)
    assert missed(joined, verdict("decode", "compute", 0.6, view="client"))
    assert missed(joined, verdict("ttft", "compute", 0.6, view=None))


def test_two_ceilings_never_agree_on_the_bound():
    assert not on_the_bound(verdict("prefill", "compute", 0.58),
                            verdict("ttft", "memory_bandwidth", 0.02, 0.6))


def test_a_verdict_without_figures_is_not_on_the_bound():
    joined = {"phase": "prefill", "resource": "overhead"}
    assert missed(joined, verdict("ttft", "compute", 0.6, view="client"))
