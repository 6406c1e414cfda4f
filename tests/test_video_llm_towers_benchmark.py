"""`benchmarks.video_llm_towers --quick` (tiny towers of both architectures): it runs, and its token counts are the
schedule's and the grid's (no timing or memory figure is asserted: they depend on the machine)."""

import json

import pytest

from benchmarks import video_llm_towers as bench


def _check(result, families, frames):
    rows = result["rows"]
    for family in families:
        for count in frames:
            by_mode = {r["mode"]: r for r in rows if r["family"] == family and r["frames"] == count}
            stock = by_mode["stock"]
            assert stock["llm_video_tokens"] == stock["stock_llm_video_tokens"] == count // 2 * 2  # 1x2 units
            for mode, keep in (("testa50", 0.5), ("testa25", 0.25)):
                plan = bench.plan_for(4, count // 2, 2, keep)
                assert by_mode[mode]["schedule"] == plan
                assert by_mode[mode]["llm_video_tokens"] <= keep * stock["llm_video_tokens"]
            assert stock["pruned_llm_video_tokens"] == by_mode["testa25"]["llm_video_tokens"]
        long = {r["mode"]: r for r in rows if r["family"] == family and r["frames"] == 32}
        assert long["idle-chunk"]["llm_video_tokens"] == long["stock"]["llm_video_tokens"] == 16 * 2
        assert long["testa25-chunk"]["llm_video_tokens"] == 16 * 2 // 4  # the 25% schedule of that grid, exactly
        assert f"testa25_time_over_stock@{frames[0]}" in result["ratios"][family]


def test_quick_mode_in_process():
    result = bench.main(["--quick", "--in-process", "--families", "qwen3_vl", "--frames", "8"])
    _check(result, ["qwen3_vl"], [8])


@pytest.mark.slow
def test_quick_mode_with_a_child_per_configuration(tmp_path):
    path = tmp_path / "towers.json"
    bench.main(["--quick", "--frames", "8", "--json", str(path)])
    result = json.loads(path.read_text())
    _check(result, list(bench.FAMILIES), [8])
    assert all(r["activation_peak_mib"] is not None for r in result["rows"])  # the peak was reset in every child
