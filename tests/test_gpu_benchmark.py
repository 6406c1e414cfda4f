"""`benchmarks/gpu.py`: its dry run (tiny models on the CPU) runs every section and writes gpu.md and gpu.json with
positive, finite numbers; the time budget skips sections with a reason; the SDPA backend, the merge comparison and the
README rows are checked on cases worked out independently."""

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import benchmarks.gpu as gpu
from modeling_testa import TestaVisionConfig, TestaVisionModel


@pytest.fixture(scope="module")
def partial_and_resumed(tmp_path_factory):
    """A dry run of two sections, then one with --resume that keeps them and runs the rest."""
    output_dir = tmp_path_factory.mktemp("gpu")
    partial = gpu.main(["--dry-run", "--output-dir", str(output_dir), "--sections", "headline,cuda_vs_cpu"])
    report = gpu.main(["--dry-run", "--output-dir", str(output_dir), "--resume"])
    return partial, report, output_dir


@pytest.fixture(scope="module")
def dry_run(partial_and_resumed):
    _, report, output_dir = partial_and_resumed
    return report, output_dir


def numbers(value, path=""):
    """Every number in a nested json value, with its path (booleans are not numbers here)."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")


# may be 0: no aggregation has R = 0, and the CPU against itself gives identical outputs
MAY_BE_ZERO = ("reductions", "max_abs_output_difference", "fused_launches")  # fused kernels: CUDA only


def test_dry_run_runs_every_section_and_writes_both_files(dry_run):
    report, output_dir = dry_run
    assert [name for name in report["sections"]] == [section.name for section in gpu.SECTIONS]
    for name, state in report["sections"].items():
        assert state["status"] == "done", (name, state["reason"])
        assert state["seconds"] > 0
    assert sorted(path.name for path in output_dir.iterdir()) == ["gpu.json", "gpu.md"]
    saved = json.loads((output_dir / "gpu.json").read_text())
    assert saved["sections"].keys() == report["sections"].keys()
    markdown = (output_dir / "gpu.md").read_text()
    assert markdown == gpu.render_markdown(saved) + "\n"  # the page is the json, rendered
    for section in gpu.SECTIONS:
        assert f"## {section.title}\n" in markdown
    assert "--dry-run --output-dir OUTPUT_DIR" in saved["command"]  # no path of the machine in the page
    assert str(output_dir) not in markdown
    for header in ("| encoder | attention | SDPA kernel (calls) |", "| precision | pass | no aggregation |",
                   "| model | seconds per step |", "| input | same merges (source map) |",
                   "| | median s per batch | compile s (first call) |", "| encoder | frames | batch | dtype |"):
        assert header in markdown


def test_every_number_is_positive_and_finite(dry_run):
    report, _ = dry_run
    found = list(numbers(report["sections"]))
    assert len(found) > 300
    for path, value in found:
        assert math.isfinite(value), path
        if not any(part in path for part in MAY_BE_ZERO):
            assert value > 0, path


def test_headline_ratios_and_counts_recomputed(dry_run):
    report, _ = dry_run
    headline = report["sections"]["headline"]["results"]
    speed = {(e["variant"], e["attention"]): e for e in headline["entries"]}
    assert {("testa", "sdpa"), ("testa-none", "sdpa"), ("timesformer", "eager")} <= speed.keys()
    for entry in headline["entries"]:
        if "seconds" in entry:
            assert entry["videos_per_second"] == pytest.approx(entry["batch"] / entry["seconds"])
            times, middle = sorted(entry["all_seconds"]), len(entry["all_seconds"]) // 2
            median = times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2
            assert entry["seconds"] == pytest.approx(median)
        else:  # transformers' TimesformerModel has no SDPA path (it raises); nothing else may be missing
            assert entry["variant"] == "timesformer" and "does not support" in entry["unsupported"]
    ratio = speed[("testa", "sdpa")]["videos_per_second"] / speed[("testa-none", "sdpa")]["videos_per_second"]
    assert headline["ratios"]["vs_no_aggregation"] == pytest.approx(ratio)
    assert headline["targets"]["vs_no_aggregation"]["met"] == (ratio >= 1.7)
    frames, patches = headline["frames"], (gpu.DRY_SCALE.encoder["image_size"] // 16) ** 2
    assert speed[("testa-none", "sdpa")]["output_tokens"] == 1 + frames * patches
    assert speed[("testa", "sdpa")]["output_tokens"] < 1 + frames * patches


def test_grid_covers_every_combination_and_counts_sdpa_calls(dry_run):
    report, _ = dry_run
    entries = report["sections"]["speed_grid"]["results"]["entries"]
    combinations = {(e["variant"], e["frames"], e["batch"], e["dtype"], e["attention"]) for e in entries}
    assert len(combinations) == len(entries) == 3 * 3 * 2 * 3 * 2
    layers = gpu.DRY_SCALE.encoder["layers"]
    for entry in entries:
        assert "seconds" in entry or "unsupported" in entry, entry
        if "seconds" in entry and entry["attention"] == "sdpa":
            # a divided block attends twice (over time, then over space): one SDPA call each
            assert sum(entry["sdpa_kernels"].values()) == 2 * layers, entry
        if entry["attention"] == "eager":
            assert "sdpa_kernels" not in entry


def test_cuda_only_parts_ran_on_the_cpu(dry_run):
    report, _ = dry_run
    sections = {name: state["results"] for name, state in report["sections"].items()}
    for row in sections["memory_96"]["rows"]:
        assert row["inference"] is None and row["train_step"] is None
        assert "CUDA" in row["memory_unavailable"]
        assert row["train_step_seconds"] > 0 and math.isfinite(row["loss"])
    assert {row["aggregation"] for row in sections["memory_96"]["rows"]} == {"none", "aggregation"}
    comparison = sections["cuda_vs_cpu"]
    assert comparison["devices"] == ["cpu", "cpu"]
    for result in comparison["inputs"].values():
        assert result["same_merges"] and result["source_map_agreement"] == 1.0
        assert result["max_abs_output_difference"] == 0.0
    assert comparison["mode_ties"]["torch_mode_agreement"] == 1.0
    assert sections["compile"]["backend"] == "eager" and sections["compile"]["same_output_shape"]
    for row in sections["train_step"]["rows"]:
        assert row["memory"] is None and row["videos_per_second"] > 0


def test_time_budget_skips_sections_with_the_reason(tmp_path):
    report = gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--time-budget", "0"])
    for state in report["sections"].values():
        assert state["status"] == "skipped" and "time budget" in state["reason"]
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert all(state["status"] == "skipped" for state in saved["sections"].values())
    assert "**skipped**: needs at least" in (tmp_path / "gpu.md").read_text()


def test_unknown_section_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--sections", "headline,speed"])


def test_sdpa_kernels_names_the_forced_backend():
    query = torch.randn(2, 4, 16, 8)

    def attend():
        torch.nn.functional.scaled_dot_product_attention(query, query, query)

    with sdpa_kernel([SDPBackend.MATH]):
        assert gpu.sdpa_kernels(attend) == {"math": 1}
    assert gpu.sdpa_backend("aten::_scaled_dot_product_flash_attention_for_cpu") == "flash (CPU)"
    assert gpu.sdpa_backend("aten::_scaled_dot_product_efficient_attention") == "efficient"
    assert gpu.sdpa_backend("aten::_scaled_dot_product_cudnn_attention") == "cudnn"
    assert gpu.sdpa_backend("aten::scaled_dot_product_attention") is None  # the dispatcher, not a kernel
    assert gpu.sdpa_backend("aten::linear") is None


def test_compare_runs_tells_different_merges_apart():
    settings = dict(num_frames=4, image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, temporal_reduction=1, trace_source=True)
    merging = TestaVisionModel(TestaVisionConfig(**settings, spatial_reduction=3)).eval()
    not_merging = TestaVisionModel(TestaVisionConfig(**settings, spatial_reduction=0)).eval()
    not_merging.load_state_dict(merging.state_dict())
    video = torch.randn(1, 4, 3, 32, 32)
    same = gpu.compare_runs(merging, merging, video, "cpu", "cpu")
    assert same["same_merges"] and same["max_abs_output_difference"] == 0.0
    different = gpu.compare_runs(merging, not_merging, video, "cpu", "cpu")
    assert not different["same_merges"] and not different["same_token_sizes"]
    assert different["source_map_agreement"] < 1.0
    assert "max_abs_output_difference" not in different  # different token counts: nothing to subtract


def test_readme_rows_link_the_page_and_state_the_memory_ratio(dry_run):
    report, _ = dry_run
    text = gpu.readme_rows(report)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and all(row.count("|") == 7 and "[gpu]" in row for row in rows)
    assert "[gpu]: docs/gpu.md" in text
    assert "training step" not in text  # no memory measured on the CPU, so no sentence about it
    measured = json.loads(json.dumps(report))
    rows_96 = measured["sections"]["memory_96"]["results"]["rows"]
    for row, peak in zip(rows_96, (10 * gpu.GiB, 6 * gpu.GiB, 20 * gpu.GiB, 12 * gpu.GiB)):
        row["train_step"] = dict(peak_allocated=peak, peak_reserved=peak, allocated_before=0)
    assert "[6.00 GiB][gpu]" in gpu.readme_rows(measured) and "[0.60x][gpu]" in gpu.readme_rows(measured)


def test_memory_ratios_against_the_paper_target():
    def row(precision, aggregation, train_gib, inference_gib=None):
        measured = lambda gib: None if gib is None else dict(peak_allocated=gib * gpu.GiB)  # noqa: E731
        return dict(precision=precision, aggregation=aggregation, train_step=measured(train_gib),
                    inference=measured(inference_gib))

    rows = [row("bf16", "none", 10, 4), row("bf16", "aggregation", 7, 3), row("fp32", "none", 20),
            row("fp32", "aggregation", 12)]
    result = gpu.memory_ratios(rows)
    assert result["ratios"] == pytest.approx({"bf16 train_step": 0.7, "bf16 inference": 0.75, "fp32 train_step": 0.6})
    assert result["targets"]["bf16 train_step"]["met"] is False  # 0.7 > 0.66
    assert result["targets"]["fp32 train_step"]["met"] is True
    assert "bf16 inference" not in result["targets"]
    assert gpu.memory_ratios(rows[:1]) == dict(ratios={}, targets={})  # one side only: no ratio yet


def test_resume_keeps_finished_sections_and_reuses_their_timings(partial_and_resumed):
    partial, report, _ = partial_and_resumed
    assert [name for name, state in partial["sections"].items() if state["status"] == "done"] == \
        ["headline", "cuda_vs_cpu"]
    for name in ("headline", "cuda_vs_cpu"):
        assert report["sections"][name]["kept_from_earlier_run"]
        assert report["sections"][name]["results"] == json.loads(json.dumps(partial["sections"][name]["results"]))
    assert not report["sections"]["memory_96"].get("kept_from_earlier_run")
    grid = {(e["variant"], e["frames"], e["batch"], e["dtype"], e["attention"]): e
            for e in report["sections"]["speed_grid"]["results"]["entries"]}
    for entry in partial["sections"]["headline"]["results"]["entries"]:
        if "seconds" in entry:  # measured once, by the earlier run
            key = (entry["variant"], entry["frames"], entry["batch"], entry["dtype"], entry["attention"])
            assert grid[key]["all_seconds"] == entry["all_seconds"]
    assert "sections the earlier run finished are kept" in report["resumed"]
    assert "--sections headline,cuda_vs_cpu" in report["earlier_command"]


def test_resume_keeps_nothing_from_another_device(tmp_path):
    earlier = gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--sections", "cuda_vs_cpu"])
    earlier["environment"]["device"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "gpu.json").write_text(json.dumps(earlier))
    report = gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--resume", "--time-budget", "0"])
    assert "device" in report["resumed"] and "nothing kept" in report["resumed"]
    assert report["sections"]["cuda_vs_cpu"]["status"] == "skipped"


def test_redo_measures_a_kept_section_again_and_render_rewrites_the_page(tmp_path):
    earlier = gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--sections", "cuda_vs_cpu"])
    again = gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--resume", "--sections", "cuda_vs_cpu",
                      "--redo", "cuda_vs_cpu"])
    assert earlier["sections"]["cuda_vs_cpu"]["status"] == again["sections"]["cuda_vs_cpu"]["status"] == "done"
    assert not again["sections"]["cuda_vs_cpu"].get("kept_from_earlier_run")
    page = (tmp_path / "gpu.md").read_text()
    (tmp_path / "gpu.md").write_text("stale")
    rendered = gpu.main(["--output-dir", str(tmp_path), "--render"])
    assert (tmp_path / "gpu.md").read_text() == page
    assert rendered["command"] == again["command"]
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--output-dir", str(tmp_path), "--redo", "no_such_section"])


def test_batch_scaling_dry_run_reports_both_encoders_at_every_batch(dry_run):
    report, _ = dry_run
    results = report["sections"]["batch_scaling"]["results"]
    entries = {(e["variant"], e["batch"]): e for e in results["entries"]}
    assert set(entries) == {(v, b) for v in ("testa", "testa-none") for b in gpu.DRY_SCALE.scaling_batches}
    assert all(e["eager_seconds"] > 0 and e["graph_error"] == "CUDA graphs need a CUDA device" for e in entries.values())
    table = gpu.render_batch_scaling(results)
    first = next(line for line in table if line.startswith(f"| {gpu.DRY_SCALE.scaling_batches[0]} |"))
    testa, none = entries[("testa", 1)], entries[("testa-none", 1)]
    assert f"{(1 / testa['eager_seconds']) / (1 / none['eager_seconds']):.2f}x" in first


def test_same_mode_dry_run_compares_both_encoders_in_every_mode(dry_run):
    """Every (encoder, frames, batch, mode) is measured or says why not; the ratios and targets are recomputed."""
    report, _ = dry_run
    results = report["sections"]["same_mode"]["results"]
    scale = gpu.DRY_SCALE
    entries = {(e["variant"], e["frames"], e["batch"], e["mode"]): e for e in results["entries"]}
    assert len(entries) == len(results["entries"]) == 2 * 3 * len(scale.same_mode_batches) * 3
    assert {key[1] for key in entries} == set(scale.frames) and {key[3] for key in entries} == set(gpu.EXECUTION_MODES)
    for (variant, frames, batch, mode), entry in entries.items():
        if mode == "eager" or (mode == "compile" and frames == scale.headline_frames):
            assert entry["seconds"] > 0 and entry["videos_per_second"] == pytest.approx(batch / entry["seconds"])
        elif mode == "cuda_graph":
            assert entry["unavailable"] == "CUDA graphs need a CUDA device"
        else:
            assert "compiled at" in entry["unavailable"]
        if mode == "compile" and "seconds" in entry:  # the eager backend in a dry run: the same ops as eager
            assert entry["compile_seconds"] > 0 and entry["max_abs_output_difference"] < 0.1
    ratios = {(r["frames"], r["batch"], r["mode"]): r["ratio"] for r in results["ratios"]}
    assert len(ratios) == 3 * len(scale.same_mode_batches) + len(scale.same_mode_batches)  # eager + compile
    for (frames, batch, mode), ratio in ratios.items():
        expected = entries[("testa-none", frames, batch, mode)]["seconds"] / entries[("testa", frames, batch, mode)]["seconds"]
        assert ratio == pytest.approx(expected)
    headline = [t for t in results["targets"] if t["frames"] == scale.headline_frames]
    assert [t["batch"] for t in headline] == [scale.headline_batch, scale.same_mode_batches[0]]
    for target in headline:
        best = max(ratio for (f, b, _), ratio in ratios.items() if f == target["frames"] and b == target["batch"])
        assert target["value"] == pytest.approx(best) and target["met"] == (best >= target["target"])
    shortest = next(t for t in results["targets"] if t["batch"] is None)
    worst = min(max(ratio for (f, b, _), ratio in ratios.items() if f == scale.frames[0] and b == batch)
                for batch in scale.same_mode_batches)
    assert shortest["value"] == pytest.approx(worst)
    table = "\n".join(gpu.render_same_mode(results))
    key = (scale.headline_frames, scale.headline_batch, "eager")
    assert f"| {key[0]} | {key[1]} | eager |" in table and f"{ratios[key]:.2f}x |" in table
    assert "| target | required | measured (best mode) | met |" in table


def test_fused_merge_dry_run_compares_the_two_merges(dry_run):
    """On the CPU the fused kernels are not used ("auto"): 0 launches, the same merges, both eager times measured."""
    report, _ = dry_run
    results = report["sections"]["fused_merge"]["results"]
    entries = results["entries"]
    assert [e["batch"] for e in entries] == sorted({gpu.DRY_SCALE.same_mode_batches[0], gpu.DRY_SCALE.headline_batch})
    for entry in entries:
        assert entry["fused_launches"] == 0 and entry["same_merges"] is True
        assert entry["max_abs_output_difference"] == 0.0  # the same ops ran twice
        assert entry["eager_auto_seconds"] > 0 and entry["eager_off_seconds"] > 0
        assert "graph_auto_seconds" not in entry  # CUDA only
    table = "\n".join(gpu.render_fused_merge(results))
    first = entries[0]
    assert f"{first['eager_off_seconds'] / first['eager_auto_seconds']:.2f}x" in table
