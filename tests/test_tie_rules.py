"""`benchmarks/tie_rules.py`: its tie rules move only ties, never the order of scores that differ after snapping."""

import pytest
import torch

import benchmarks.tie_rules as tie_rules
import modeling_testa.aggregation as aggregation
from modeling_testa.aggregation import geometry_matching


@pytest.mark.parametrize("rule", ["nearest", "seed1", "seed7"])
def test_offsets_stay_below_half_a_grid_step_and_are_reproducible(rule):
    offsets = tie_rules.tie_offsets(9, 8, rule)
    assert offsets.shape == (9, 8) and offsets.abs().max() < 0.5
    assert torch.equal(offsets, tie_rules.tie_offsets(9, 8, rule))
    assert tie_rules.tie_offsets(9, 8, "lowest") is None and tie_rules.tie_offsets(9, 8, "raw") is None
    with pytest.raises(ValueError, match="Unknown tie rule 'seedx'"):
        tie_rules.tie_offsets(2, 2, "seedx")


def test_a_rule_breaks_ties_its_own_way_and_keeps_every_other_decision(monkeypatch):
    monkeypatch.setattr(aggregation, "round_to_grid", aggregation.round_to_grid)  # undone after the test
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(1, 12, 6, generator=generator, dtype=torch.float64)  # no two cosines in one grid cell
    static = torch.randn(6, generator=generator, dtype=torch.float64).expand(1, 12, 6).clone()  # all ties
    lowest = [geometry_matching(metric, 3) for metric in (distinct, static)]
    tie_rules.apply_rule("seed2")
    seeded = [geometry_matching(metric, 3) for metric in (distinct, static)]
    assert torch.equal(seeded[0].kept, lowest[0].kept) and torch.equal(seeded[0].targets, lowest[0].targets)
    assert lowest[1].sources.tolist() == [[0, 2, 4]] and lowest[1].targets.tolist() == [[3, 3, 3]]
    assert not torch.equal(seeded[1].targets, lowest[1].targets)  # the ties went elsewhere


def test_a_mistyped_option_stops_before_any_training():
    with pytest.raises(SystemExit):
        tie_rules.main(["--evalonly", "somewhere"])
    with pytest.raises(SystemExit):
        tie_rules.main(["--rules", "lowest", "--", "train.py"])  # only the worker takes a script after "--"
