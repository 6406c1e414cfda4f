"""The YAML recipes carry the paper's settings and build valid model configs; the accelerate configs load and launch."""

import functools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modeling_testa import TestaConfig, TestaVisionConfig


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configuration"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
ACCELERATE = sorted((CONFIGS / "accelerate").glob("*.yaml"))
TEXT_LENGTHS = {"queryd": 128, "didemo": 64, "activitynet": 64, "condensed_movies": 32}


def load(name):
    with open(CONFIGS / name, encoding="utf-8") as f:
        return yaml.safe_load(f)


def make_testa_config(recipe):
    model = dict(recipe["model"])
    model.pop("init_from")
    return TestaConfig(**model)


def test_every_recipe_is_present_and_parses():
    names = {p.name for p in RECIPES}
    expected = {f"retrieval_{d}_f{f}.yaml" for d in TEXT_LENGTHS for f in (32, 96)}
    expected |= {"vqa_activitynet_f32.yaml", "vqa_activitynet_f96.yaml", "pretrain.yaml", "synthetic_retrieval.yaml",
                 "synthetic_qa.yaml", "short_events.yaml", "short_events_qa.yaml"}
    assert expected <= names
    from train.loop import validate_recipe

    for path in RECIPES:
        recipe = yaml.safe_load(path.read_text())
        assert set(recipe) == {"task", "model", "data", "train", "eval"}, path.name
        validate_recipe(recipe, path.name)  # every key is one the code reads
        assert recipe["task"] in ("retrieval", "qa", "pretrain")
        config = make_testa_config(recipe)  # every model section is a valid TestaConfig
        vision = recipe["model"]["vision_config"]
        assert config.vision_config.num_frames == vision["num_frames"] == recipe["data"]["num_frames"], path.name
        assert config.vision_config.image_size == recipe["data"]["image_size"], path.name
        assert recipe["data"]["sampling"] in ("uniform", "headtail", "random")
        train = recipe["train"]
        assert train["weight_decay"] == 0.05
        if recipe["task"] == "retrieval":
            assert config.queue_size % train["batch_size"] == 0, path.name  # the queue holds whole global batches
            assert config.text_config.max_position_embeddings >= recipe["data"]["max_text_length"]


@pytest.mark.parametrize("dataset", sorted(TEXT_LENGTHS))
@pytest.mark.parametrize("frames", [32, 96])
def test_paper_retrieval_settings(dataset, frames):
    recipe = load(f"retrieval_{dataset}_f{frames}.yaml")
    vision = make_testa_config(recipe).vision_config
    r_t, r_s = (1, 12) if frames == 32 else (4, 8)
    assert (vision.num_frames, vision.temporal_reduction, vision.spatial_reduction) == (frames, r_t, r_s)
    assert (vision.hidden_size, vision.num_hidden_layers, vision.patch_size, vision.image_size) == (768, 12, 16, 224)
    assert vision.aggregation_strategy == "geometry" and vision.aggregation_dims == "temporal+spatial"
    model, data, train, evaluation = recipe["model"], recipe["data"], recipe["train"], recipe["eval"]
    assert data["max_text_length"] == TEXT_LENGTHS[dataset]
    assert data["dataset"] == f"data/{dataset}"
    assert (train["lr"], train["warmup_ratio"], train["batch_size"]) == (1e-5, 0.1, 16)
    assert train["epochs"] == (20 if dataset == "activitynet" else 10)
    assert (model["queue_size"], model["alpha"], model["momentum"], evaluation["k_test"]) == (32, 0.4, 0.995, 128)
    text = make_testa_config(recipe).text_config
    assert (text.vocab_size, text.hidden_size, text.num_attention_heads) == (30524, 768, 12)
    assert text.encoder_hidden_size == 768


@pytest.mark.parametrize("frames", [32, 96])
def test_paper_qa_settings(frames):
    recipe = load(f"vqa_activitynet_f{frames}.yaml")
    vision = make_testa_config(recipe).vision_config
    assert (vision.temporal_reduction, vision.spatial_reduction) == ((1, 12) if frames == 32 else (4, 8))
    assert recipe["task"] == "qa" and recipe["data"]["max_question_length"] == 35
    assert (recipe["train"]["lr"], recipe["train"]["epochs"], recipe["train"]["batch_size"]) == (2e-5, 10, 16)


def test_pretraining_settings():
    recipe = load("pretrain.yaml")
    config = make_testa_config(recipe)
    vision, train = config.vision_config, recipe["train"]
    assert vision.num_frames == 8 and vision.temporal_reduction == 0 and vision.spatial_reduction == 0
    assert config.queue_size == 57600 and config.queue_size % train["batch_size"] == 0
    assert recipe["data"]["streaming"] is True and recipe["data"]["max_text_length"] == 30
    assert recipe["data"]["dataset"] == ["data/webvid", "data/cc3m"]


def test_synthetic_recipes_fit_the_synthetic_data():
    from transformers import BertTokenizer

    from modeling_testa.flops import count_encoder_gmac
    from processing.synthetic import make_specs, paragraph, qa_pairs

    retrieval, qa = load("synthetic_retrieval.yaml"), load("synthetic_qa.yaml")
    config = make_testa_config(retrieval)
    vision, text = config.vision_config, config.text_config
    assert retrieval["model"]["init_from"] is None  # from scratch
    assert 128 <= vision.hidden_size <= 192 and vision.num_hidden_layers == 4 and vision.num_frames == 8
    assert 64 <= vision.image_size <= 96 and text.encoder_hidden_size == vision.hidden_size
    assert retrieval["data"]["dataset"] == qa["data"]["dataset"] == "data/synthetic"
    # the QA recipe uses the same model
    assert qa["model"]["vision_config"] == retrieval["model"]["vision_config"]
    assert make_testa_config(qa).text_config.hidden_size == text.hidden_size
    # aggregation at about 55% of the encoder's GMAC (the demo's comparison)
    full = TestaVisionConfig(**{**retrieval["model"]["vision_config"], "temporal_reduction": 0, "spatial_reduction": 0})
    ratio = count_encoder_gmac(vision)[0] / count_encoder_gmac(full)[0]
    assert 0.5 <= ratio <= 0.6, ratio
    # every synthetic paragraph / question fits the recipes' text lengths, so nothing is truncated
    tokenizer = BertTokenizer(vocab=str(ROOT / "modeling_testa" / "vocab.txt"))
    specs = make_specs(400, seed=11)
    longest = max(len(tokenizer(paragraph(s.events))["input_ids"]) for s in specs)
    assert longest <= retrieval["data"]["max_text_length"] <= text.max_position_embeddings
    pairs = [p for s in specs for p in qa_pairs(s.events, random.Random(0), 10)]
    assert max(len(tokenizer(q)["input_ids"]) for q, _ in pairs) <= qa["data"]["max_question_length"]
    assert max(len(tokenizer(a)["input_ids"]) for _, a in pairs) <= qa["data"]["max_answer_length"]


def launch_args(path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return args


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    assert {p.name for p in ACCELERATE} == {"single_gpu.yaml", "ddp.yaml", "fsdp.yaml", "multi_node.yaml",
                                            "cpu_2proc.yaml"}  # DeepSpeed: not runnable here, see configuration/README.md
    expected = {  # file: (distributed type, processes, machines)
        "single_gpu.yaml": ("NO", 1, 1),
        "ddp.yaml": ("MULTI_GPU", 8, 1),
        "fsdp.yaml": ("FSDP", 8, 1),
        "multi_node.yaml": ("MULTI_GPU", 16, 2),
        "cpu_2proc.yaml": ("MULTI_GPU", 2, 1),
    }
    for path in ACCELERATE:
        config = load_config_from_file(str(path))  # raises on unknown keys
        kind, processes, machines = expected[path.name]
        assert (str(config.distributed_type).split(".")[-1], config.num_processes, config.num_machines) == (
            kind, processes, machines), path.name
        launch_args(path)  # the launcher accepts it
    multi = load_config_from_file(str(CONFIGS / "accelerate" / "multi_node.yaml"))
    assert multi.main_process_ip and multi.main_process_port == 29500 and multi.same_network


def test_fsdp_config_wraps_the_encoder_and_text_blocks(monkeypatch):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from transformers import BlipTextConfig
    from transformers.models.blip.modeling_blip_text import BlipTextLayer, BlipTextModel

    from modeling_testa import TestaVisionModel
    from modeling_testa.modeling_testa_vision import TestaVisionLayer

    env = prepare_multi_gpu_env(launch_args(CONFIGS / "accelerate" / "fsdp.yaml"))
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    vision = TestaVisionModel(TestaVisionConfig(num_frames=2, image_size=32, patch_size=16, hidden_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                                temporal_reduction=0, spatial_reduction=0))
    text = BlipTextModel(BlipTextConfig(hidden_size=32, encoder_hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64))
    plugin.set_auto_wrap_policy(torch.nn.ModuleDict({"vision": vision, "text": text}))
    policy = plugin.auto_wrap_policy
    assert isinstance(policy, functools.partial)
    assert policy.keywords["transformer_layer_cls"] == {TestaVisionLayer, BlipTextLayer}


PROBE = """
import sys
import torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=not torch.cuda.is_available())
with open(f"{sys.argv[1]}/rank{accelerator.process_index}.txt", "w") as f:
    f.write(f"{accelerator.process_index} {accelerator.num_processes} {accelerator.distributed_type}")
"""


def test_cpu_2proc_launches_two_gloo_processes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(CONFIGS / "accelerate" / "cpu_2proc.yaml"), str(script), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reports = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert reports == ["0 2 DistributedType.MULTI_CPU", "1 2 DistributedType.MULTI_CPU"], reports


def test_pretraining_learning_rate_schedule():
    """The paper: linearly warmed up from 1e-6 to 5e-6 in the first 5000 steps, then cosine decayed to 5e-7. The
    scheduler the loop builds (`build_scheduler`, stepped as Accelerate steps a prepared scheduler with 2 processes)
    gives those rates at step 0, at the end of the warm-up, at the last step and after it."""
    import math

    import torch

    from train.loop import build_scheduler

    train, steps, processes = load("pretrain.yaml")["train"], 20000, 2
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=train["lr"])
    scheduler = build_scheduler(optimizer, train, steps, ticks_per_step=processes)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate of this optimiser step
        optimizer.step()
        for _ in range(processes):
            scheduler.step()
    assert rates[0] == pytest.approx(1e-6)
    assert rates[2500] == pytest.approx(3e-6)
    assert rates[5000] == pytest.approx(5e-6) and max(rates) == pytest.approx(5e-6)
    last = 5e-7 + 4.5e-6 * 0.5 * (1 + math.cos(math.pi * (steps - 1 - 5000) / (steps - 5000)))
    assert rates[-1] == pytest.approx(last) and rates[-1] == pytest.approx(5e-7, rel=1e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-7)  # after the last step: min_lr
    assert all(a >= b for a, b in zip(rates[5000:], rates[5001:]))  # decays monotonically


@pytest.mark.parametrize("kind", ["linear", "constant"])
def test_other_schedules(kind):
    from train.loop import learning_rate

    train = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2, "warmup_start_lr": 0.5, "scheduler": kind}
    rates = [learning_rate(step, train, 12) for step in range(13)]
    assert rates[:3] == pytest.approx([0.5, 0.75, 1.0])
    expected = [1.0 - 0.9 * i / 10 for i in range(11)] if kind == "linear" else [1.0] * 11
    assert rates[2:] == pytest.approx(expected)


def test_unknown_recipe_keys_raise_with_the_file_and_the_allowed_keys(tmp_path):
    from train.loop import load_recipe, parse_args

    recipe = load("synthetic_retrieval.yaml")
    recipe["train"]["min_learning_rate"] = 0.0  # a typo of min_lr
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match=r"typo\.yaml.*min_learning_rate.*in train; allowed keys are .*'min_lr'"):
        load_recipe(parse_args("t", ["--config", str(path)]))
    base = ["--config", str(CONFIGS / "synthetic_retrieval.yaml")]
    for override, where in (("eval.every_epochs=1", "in eval"), ("data.augment=true", "in data"),
                            ("model.vision_config.temporal_reduce=2", "model.vision_config"),
                            ("model.queue=4", r"model \(TestaConfig"), ("evaluation.k_test=3", "top level")):
        with pytest.raises(ValueError, match=where):
            load_recipe(parse_args("t", base + ["--set", override]))
    with pytest.raises(ValueError, match="allowed values"):
        load_recipe(parse_args("t", base + ["--set", "train.scheduler=step"]))
    assert load_recipe(parse_args("t", base + ["--set", "train.min_lr=1.0e-6"]))["train"]["min_lr"] == 1e-6


def test_a_recipe_for_another_task_is_refused():
    from train.finetune_retrieval import TASK
    from train.loop import main

    with pytest.raises(ValueError, match="task='qa', but this script trains 'retrieval'"):
        main(TASK, ["--config", str(CONFIGS / "synthetic_qa.yaml")])


MIXED_PRECISION_PROBE = """
import sys
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from train.loop import resolve_mixed_precision
results = []
for value in sys.argv[1:]:
    value = None if value == "null" else value
    results.append(Accelerator(cpu=True, mixed_precision=resolve_mixed_precision(value)).mixed_precision)
    AcceleratorState._reset_state(reset_partial_state=True)
print(" ".join(results))
"""


@pytest.mark.parametrize("launch_config, expected", [("bf16", "bf16 bf16 no bf16"), ("no", "no no no bf16")])
def test_mixed_precision_recipe_value_or_launch_config(launch_config, expected):
    """The recipe's value wins when set (no / bf16); auto or null defer to the launch configuration."""
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": launch_config, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", MIXED_PRECISION_PROBE, "auto", "null", "no", "bf16"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == expected


def test_decoder_settings_reach_the_video_processor(tmp_path):
    """`data.video_backend` / `data.isolate_decoder` configure the processor the loop builds (and saves)."""
    from train.loop import build_processor

    chosen = build_processor({"data": {"num_frames": 4, "image_size": 32, "video_backend": "pyav",
                                       "isolate_decoder": False}})
    assert chosen.video_processor.video_backend == "pyav" and chosen.video_processor.isolate_decoder is False
    chosen.save_pretrained(tmp_path)
    from modeling_testa.processing_testa import TestaProcessor

    reloaded = TestaProcessor.from_pretrained(tmp_path)
    assert reloaded.video_processor.video_backend == "pyav" and reloaded.video_processor.isolate_decoder is False
    default = build_processor({"data": {"num_frames": 4, "image_size": 32}})
    assert default.video_processor.video_backend == "auto" and default.video_processor.isolate_decoder is True
    with pytest.raises(ValueError, match="video_backend"):
        build_processor({"data": {"num_frames": 4, "image_size": 32, "video_backend": "ffmpeg"}})


# ----------------------------------------------------------------------------------------------------- typed recipe


def test_a_minimal_recipe_takes_every_default_from_the_dataclasses():
    """Defaults are declared once, on the section dataclasses (hand-written here as the reference)."""
    from train.recipe import DataRecipe, EvalRecipe, TrainRecipe, parse_recipe

    recipe = parse_recipe({"task": "retrieval"}, "minimal.yaml")
    assert recipe.data == DataRecipe() and recipe.train == TrainRecipe() and recipe.eval == EvalRecipe()
    assert (recipe.train.lr, recipe.train.weight_decay, recipe.train.batch_size, recipe.train.seed) == (
        1e-5, 0.05, 16, 42)
    assert (recipe.train.scheduler, recipe.train.min_lr, recipe.train.warmup_steps, recipe.train.epochs) == (
        "cosine", 0.0, None, 1)
    assert (recipe.data.num_frames, recipe.data.image_size, recipe.data.sampling, recipe.data.num_workers) == (
        32, 224, "random", 2)
    assert (recipe.data.max_text_length, recipe.data.eval_split, recipe.data.streaming) == (64, "test", False)
    assert (recipe.eval.k_test, recipe.eval.batch_size, recipe.eval.store_dir) == (128, 8, None)
    # the dict view (what train/evaluation.py reads) holds the same values
    assert recipe["data"]["num_frames"] == 32 and recipe.get("eval")["k_test"] == 128
    assert recipe.to_dict()["train"] == recipe["train"]
    # pretraining's own defaults: streamed, 30-token captions, evaluation only when a split is named
    for raw, task in (({"task": "pretrain"}, None), ({}, "pretrain")):
        pretrain = parse_recipe(raw, "minimal.yaml", task=task)
        assert (pretrain.data.streaming, pretrain.data.max_text_length, pretrain.data.eval_split) == (True, 30, None)
        assert pretrain.train == TrainRecipe()


def test_no_reader_restates_a_recipe_default():
    """The loop, the data pipeline and the task scripts read recipe values as attributes: no `.get(key, default)` of
    a recipe key (that would be a second default)."""
    import ast

    from train.recipe import RECIPE_KEYS

    keys = set().union(*RECIPE_KEYS.values())
    for name in ("loop.py", "data.py", "recipe.py", "evaluation.py", "finetune_retrieval.py", "finetune_qa.py",
                 "pretrain.py"):
        tree = ast.parse((ROOT / "train" / name).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in keys):
                pytest.fail(f"train/{name}:{node.lineno} reads {node.args[0].value!r} with its own default")


def test_recipe_values_are_typed_and_checked(tmp_path):
    from train.loop import load_recipe, parse_args

    base = ["--config", str(CONFIGS / "synthetic_retrieval.yaml")]
    recipe = load_recipe(parse_args("t", base + ["--set", "train.lr=1e-4", "--set", "train.max_grad_norm=null",
                                                 "--set", "data.num_frames=16", "--set", "eval.store_dir=/tmp/x"]))
    assert recipe.train.lr == 1e-4 and isinstance(recipe.train.lr, float)  # YAML reads `1e-4` as a string
    assert recipe.train.max_grad_norm is None and recipe.data.num_frames == 16 and recipe.eval.store_dir == "/tmp/x"
    assert recipe.train.min_lr == 0.0 and recipe.train.seed == 0  # the file's values
    for override, message in (
        ("train.lr=fast", r"train\.lr='fast': expected float"),
        ("data.num_frames=8.5", r"data\.num_frames=8\.5: expected int"),
        ("data.streaming=maybe", r"data\.streaming='maybe': expected bool"),
        ("data.sampling=every", r"data\.sampling='every'; allowed values are \['uniform', 'headtail', 'random'\]"),
        ("train.mixed_precision=fp64", r"train\.mixed_precision='fp64'; allowed values are .* or null"),
        ("task=caption", r"task='caption'; allowed values are"),
        ("model.vision_config=3", r"model\.vision_config must be a mapping"),
    ):
        with pytest.raises(ValueError, match=message):
            load_recipe(parse_args("t", base + ["--set", override]))
    # a null section (pretrain.yaml's `eval: null`) still takes --set values
    pretrain = load_recipe(parse_args("t", ["--config", str(CONFIGS / "pretrain.yaml"), "--set", "eval.k_test=5"]))
    assert pretrain.eval.k_test == 5 and pretrain.eval.batch_size == 8
