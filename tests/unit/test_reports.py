"""The one-line cache report says what was reused, verified and recomputed for exactness."""

from __future__ import annotations

from localkv.runtime.reports import CacheReport


def test_a_hit_that_recomputed_common_tokens_says_so() -> None:
    report = CacheReport(
        hit=True,
        verified=True,
        snapshot=None,
        miss_reason=None,
        reused=256,
        restore_s=0.012,
        saved_s=1.5,
        common=300,
    )
    assert report.recomputed == 44
    assert report.line(310).count("reused") == 1  # one count of reused tokens, one denominator
    assert report.line(310) == (
        "reused 256 of 310 tokens (verified) in 12 ms; saved ≈ 1.5 s; "
        "recomputed 44 common tokens (exact)"
    )


def test_a_plain_hit_and_a_miss() -> None:
    hit = CacheReport(
        hit=True,
        verified=True,
        snapshot=None,
        miss_reason=None,
        reused=300,
        restore_s=0.012,
        saved_s=1.5,
        common=300,
    )
    assert hit.line(310) == "reused 300 of 310 tokens (verified) in 12 ms; saved ≈ 1.5 s"
    miss = CacheReport(
        hit=False,
        verified=None,
        snapshot=None,
        miss_reason="no batch end shared",
        reused=0,
        restore_s=0.001,
        saved_s=0.0,
        common=3,
    )
    assert miss.line(20) == (
        "cache miss (no batch end shared); prefilled 20 tokens; recomputed 3 common tokens (exact)"
    )
