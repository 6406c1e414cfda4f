"""`benchmarks/merge_kernels.py`: its counting rule on hand-made profiler trees, and a run on a tiny encoder whose
counts are checked against what the rule implies (and against a bound on the merge's calls per aggregation step)."""

from dataclasses import dataclass, field

import pytest

import benchmarks.merge_kernels as merge_kernels


@dataclass(eq=False)
class Event:
    """The three fields of a profiler event the rule reads."""

    name: str
    cpu_children: list = field(default_factory=list)
    cpu_parent: "Event | None" = None


def tree(name: str, *children: Event) -> Event:
    event = Event(name, list(children))
    for child in children:
        child.cpu_parent = event
    return event


def flatten(*roots: Event) -> list[Event]:
    events = []
    for root in roots:
        events.append(root)
        events += flatten(*root.cpu_children)
    return events


def test_rule_counts_top_level_kernels_and_copies_but_not_metadata():
    no_op_cast = tree("aten::to")  # returns its input: no kernel below it
    real_cast = tree("aten::to", tree("aten::_to_copy", tree("aten::empty_strided"), tree("aten::copy_")))
    linear = tree("aten::linear", tree("aten::t", tree("aten::transpose")), tree("aten::addmm"))
    copying_reshape = tree("aten::reshape", tree("aten::clone", tree("aten::copy_")))
    view_reshape = tree("aten::reshape", tree("aten::view"))
    eval_dropout = tree("aten::dropout")
    roots = [no_op_cast, real_cast, linear, copying_reshape, view_reshape, eval_dropout, tree("aten::view"),
             tree("aten::promote_types"), tree("aten::gather"), tree("aten::expand"),
             tree("autograd::engine::evaluate_function: GatherBackward0", tree("aten::scatter_add_"))]
    counts = merge_kernels.count_calls(flatten(*roots), "kernels")
    # one each: the real cast, the linear (not again its addmm), the copying reshape, the gather, and the backward's
    # scatter (its parent is an autograd node, not an ATen op)
    assert counts == {"to": 1, "linear": 1, "reshape": 1, "gather": 1, "scatter_add_": 1}
    issue = merge_kernels.count_calls(flatten(*roots), "issue")
    assert issue == {"to": 2, "linear": 1, "promote_types": 1, "gather": 1, "scatter_add_": 1}


@pytest.fixture(scope="module")
def tiny_run():
    argv = ["--frames", "6", "--image-size", "64", "--hidden-size", "32", "--layers", "2", "--heads", "2",
            "--temporal-reduction", "1", "--spatial-reduction", "3"]
    return merge_kernels.main(argv)


def test_tiny_encoder_counts_are_the_difference_and_within_the_bound(tiny_run, capsys):
    plain, testa, added = tiny_run["plain"], tiny_run["testa"], tiny_run["added"]
    for rule in ("kernels", "issue"):
        assert sum(plain[rule].values()) > 0
        for name in plain[rule].keys() | testa[rule].keys():
            assert added[rule].get(name, 0) == testa[rule][name] - plain[rule][name]
    kernels = added["kernels"]
    assert kernels["argsort"] == 4 and kernels["sort"] == 4  # one matching per axis and block: 2 blocks x 2 axes
    assert kernels["scatter_add_"] == 8  # one scatter per merged tensor: features and sizes
    assert "view" not in kernels and "expand" not in kernels
    merges = 4  # 22.25 calls per aggregation step today (10 decide, 12 merge); 25.5 before the score path was
    # rewritten (one normalisation, the grid's scale inside the matmul), 42.5 before the merge rewrite
    assert sum(kernels.values()) <= 23 * merges
    assert kernels["linalg_vector_norm"] == 4 and kernels["baddbmm"] == 4  # keys normalised once; one scaled matmul


def test_fused_launches_count_once_and_hide_the_interpreters_ops():
    launch = tree("testa::merge_pairs", tree("aten::copy_"), tree("aten::detach"))
    counts = merge_kernels.count_calls(flatten(launch, tree("aten::mean")), "kernels")
    assert counts == {"testa::merge_pairs": 1, "mean": 1}


@pytest.mark.skipif(not merge_kernels.fused_aggregation.triton_available(), reason="Triton is not installed")
def test_tiny_encoder_with_fused_kernels_launches_two_per_matching(capsys):
    argv = ["--frames", "6", "--image-size", "64", "--hidden-size", "32", "--layers", "2", "--heads", "2",
            "--temporal-reduction", "1", "--spatial-reduction", "3", "--fused"]
    run = merge_kernels.main(argv)
    assert run["checked"]["source_map"] and run["checked"]["token_sizes"]
    assert run["checked"]["max_difference"] < 1e-5
    # 2 blocks x 2 axes: one decision and one merge kernel each; the frames' mean keys stay an ATen op
    added = {name: count for name, count in run["added"]["kernels"].items() if count > 0}
    assert added == {"testa::geometry_pairs": 4, "testa::merge_pairs": 4, "mean": 2}
    traffic = run["traffic"]
    assert traffic.calls["testa::merge_pairs"] == 4 and traffic.largest_index < 6 * (64 // 16) ** 2
    assert "with the fused kernels" in capsys.readouterr().out


def test_tiny_encoder_merge_traffic_has_no_index_the_size_of_the_hidden_states(tiny_run):
    traffic = tiny_run["traffic"]
    assert sum(traffic.calls.values()) > 0 and sum(traffic.bytes_written.values()) > 0
    tokens = 6 * (64 // 16) ** 2
    assert 0 < traffic.largest_index < tokens  # indices over tokens, never over tokens x hidden


def test_training_step_timing_prints_a_ratio(capsys):
    merge_kernels.main(["--train-step", "--train-frames", "4", "--train-image-size", "32", "--train-hidden-size", "32",
                        "--train-layers", "2", "--train-heads", "2", "--train-spatial-reduction", "1",
                        "--train-batch", "1", "--repeats", "2"])
    printed = capsys.readouterr().out
    assert "TESTA speed-up:" in printed and "no aggregation:" in printed
    seconds = [float(line.split(": ")[1].split(" s")[0]) for line in printed.splitlines() if line.endswith("of 2)")]
    ratio = float(printed.split("TESTA speed-up: ")[1].split("x")[0])
    assert len(seconds) == 2 and ratio == pytest.approx(seconds[0] / seconds[1], rel=0.05)


def test_merge_variants_agree_and_the_premultiplied_one_writes_more_bytes():
    """`--merge-variants` on a tiny block: both merges give the same tokens and sizes (checked inside), and ToMe's
    premultiplied merge, which copies every row into an fp32 ``[x * s, s]`` tensor, writes more bytes."""
    results = merge_kernels.main(["--merge-variants", "--frames", "4", "--image-size", "64", "--hidden-size", "32",
                                  "--spatial-reduction", "3", "--repeats", "1", "--variant-batch", "2"])
    assert set(results) == {(dtype, batch) for dtype in ("torch.float32", "torch.bfloat16") for batch in (1, 2)}
    for row in results.values():
        library, premultiplied = row["library"], row["premultiplied"]
        assert library["calls"] > 0 and premultiplied["calls"] > 0
        assert premultiplied["bytes"] > library["bytes"] > 0
