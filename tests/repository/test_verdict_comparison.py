"""The real-vLLM verdict tests' comparison of the tap's view with the joined view
(``verdict_runs.tap_view_missed``): a resource against overhead is forgiven only where
both views sit on the verdict's bound, or where the client's view timed the prefills by
the engine's mean and reads as far above the joined view as that timing does; never a
phase or a reading far from it."""

from __future__ import annotations

from types import SimpleNamespace

from tests.engines.verdict_runs import (
    CLIENT_PREFILL_READS,
    on_the_bound,
    tap_view_missed,
    within_the_clients_reading,
)


def verdict(phase: str, resource: str, flops: float, bandwidth: float = 0.02,
            view: str | None = None) -> dict:
    return {"phase": phase, "resource": resource, "view": view, "text": "",
            "evidence": {"of_achievable_flops": flops, "of_achievable_bandwidth": bandwidth}}


def missed(joined: dict, tap: dict, prefill_interval: str = "arrival_to_first_token"
           ) -> str:
    return tap_view_missed(SimpleNamespace(roofline={"verdict": joined}),
                           view(tap, prefill_interval))


def view(tap: dict, prefill_interval: str) -> dict:
    return {"roofline": {"verdict": tap, "estimate": {"inputs": {
        "prefill_interval": f"{prefill_interval}: what the JSON API says of it"}}}}


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


def test_the_clients_engine_timed_prefill_reads_above_the_joined_view_as_measured():
    """The full make tests of b2fa346 and 7c9b05e: prefill_heavy joined 0.528 and 0.541
    of the ceilings (overhead), through the tap 0.58-0.656 (compute), every prefill
    timed by the engine's mean prefill (``CLIENT_PREFILL_READS``): no disagreement. The
    same figures from a client's view that timed prefills otherwise, a tap reading past
    the band, a joined reading whose band does not reach the bound, or a client's view
    reading overhead against a joined ceiling still disagree."""
    engine = "engine_mean_prefill"
    for ours, theirs in ((0.528, 0.58), (0.528, 0.648), (0.528, 0.656), (0.541, 0.615),
                         (0.541, 0.63)):
        joined = verdict("prefill", "overhead", ours - 0.02)
        tap = verdict("ttft", "compute", theirs - 0.02, view="client")
        assert within_the_clients_reading(joined, view(tap, engine)), (ours, theirs)
        assert not missed(joined, tap, engine), (ours, theirs)
        assert missed(joined, tap), (ours, theirs)  # timed from the arrivals
    high = CLIENT_PREFILL_READS[1]
    joined = verdict("prefill", "overhead", 0.48)  # 0.5 used: its band reaches 0.65
    assert missed(joined, verdict("ttft", "compute", 0.5 * high + 0.01, view="client"),
                  engine)  # past the band
    far = verdict("prefill", "overhead", 0.4)  # 0.42 x 1.3 = 0.546: short of the bound
    assert missed(far, verdict("ttft", "compute", 0.53, view="client"), engine)
    assert missed(verdict("prefill", "compute", 0.64),
                  verdict("ttft", "overhead", 0.52, view="client"), engine)
