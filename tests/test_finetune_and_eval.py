"""Issue 12's optimisation, fine-tuning and evaluation controls: no weight decay on norms and
biases, --clip_grad_norm, --head_lr_scale, --freeze_backbone_epochs (and their exact resume),
--eval_resize_ratio and flip test-time augmentation in evaluate.py / predict.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from torch import nn

import imgtrainer.tools.inference as inference
import imgtrainer.training.optim as optim
import imgtrainer.training.step as training_step
from conftest import (
    CLASSES,
    CPU,
    FP32,
    ONE_CPU_PROCESS,
    TINY_FLAGS,
    data_config,
    run_main,
    run_train,
    user_error_line,
    write_image_folder,
)
from imgtrainer.checkpoints.resume import changed_settings
from imgtrainer.config import TrainConfig
from imgtrainer.data.host.transforms import eval_transforms, normalize_batch
from imgtrainer.data.loaders import build_datasets
from imgtrainer.errors import UserError
from imgtrainer.precision import Precision
from imgtrainer.tools.evaluate import main as evaluate_main
from imgtrainer.tools.predict import main as predict_main
from imgtrainer.training.build import seed_everything
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.step import RunParts, train_step

# timm's smallest ResNet (0.4 M parameters, BatchNorm, a Linear head ``fc``): the end-to-end
# runs below take seconds with it.
SMALL_MODEL = "test_resnet"


def config(**changes) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **changes)


def resnet(num_classes: int = 3) -> nn.Module:
    return timm.create_model("resnet18", num_classes=num_classes)


def names_by_group(optimizer: torch.optim.Optimizer) -> list[tuple[str, float, float, set]]:
    return [
        (g["part"], g["weight_decay"], g["lr"], set(g["param_names"]))
        for g in optimizer.param_groups
    ]


# ----------------------------------------------------------------------------- param groups


def test_norm_weights_and_biases_get_no_weight_decay():
    model = resnet()
    optimizer = optim.build_optimizer(config(weight_decay=0.05), model, world_size=1)
    groups = names_by_group(optimizer)
    assert [(part, wd) for part, wd, _, _ in groups] == [("backbone", 0.0), ("backbone", 0.05)]
    no_decay, decay = groups[0][3], groups[1][3]
    assert no_decay == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert {"bn1.weight", "bn1.bias", "layer4.1.bn2.weight", "fc.bias"} <= no_decay
    assert decay == {n for n, p in model.named_parameters() if p.ndim > 1}
    assert {"conv1.weight", "fc.weight"} <= decay


def test_decay_norm_and_bias_is_the_single_group_of_old_checkpoints():
    model = resnet()
    optimizer = optim.build_optimizer(config(decay_norm_and_bias=True), model, world_size=1)
    (group,) = optimizer.param_groups
    assert group["weight_decay"] == 0.01
    assert group["params"] == list(model.parameters())  # model order: the old layout
    assert group["param_names"] == [n for n, _ in model.named_parameters()]


def test_head_groups_have_the_scaled_learning_rate():
    model = resnet()
    optimizer = optim.build_optimizer(
        config(learning_rate=0.002, head_lr_scale=10.0), model, world_size=1
    )
    groups = names_by_group(optimizer)
    assert [(part, wd) for part, wd, _, _ in groups] == [
        ("backbone", 0.0),
        ("backbone", 0.01),
        ("head", 0.0),
        ("head", 0.01),
    ]
    assert groups[2][3] == {"fc.bias"} and groups[3][3] == {"fc.weight"}
    assert all(math.isclose(lr, 0.002) for part, _, lr, _ in groups if part == "backbone")
    assert all(math.isclose(lr, 0.02) for part, _, lr, _ in groups if part == "head")


@pytest.mark.parametrize("kind", ["cosine", "step"])
def test_head_lr_ratio_survives_the_schedule(kind):
    cfg = config(
        learning_rate=0.01,
        head_lr_scale=4.0,
        scheduler=kind,
        warmup_epochs=1,
        epochs=4,
        step_size=1,
    )
    optimizer = optim.build_optimizer(cfg, resnet(), world_size=1)
    scheduler = optim.build_scheduler(cfg, optimizer, steps_per_epoch=5)
    seen = set()
    for _ in range(20):
        lrs = {g["part"]: g["lr"] for g in optimizer.param_groups}
        assert lrs["backbone"] > 0
        assert math.isclose(lrs["head"], 4.0 * lrs["backbone"], rel_tol=1e-12)
        seen.add(round(lrs["backbone"], 12))
        optimizer.step()
        scheduler.step()
    assert len(seen) > 5  # the schedule really moved


def test_frozen_backbone_has_learning_rate_zero_then_the_schedule():
    cfg = config(learning_rate=0.01, freeze_backbone_epochs=2, epochs=4, warmup_epochs=1)
    optimizer = optim.build_optimizer(cfg, resnet(), world_size=1)
    scheduler = optim.build_scheduler(cfg, optimizer, steps_per_epoch=3)
    reference = optim.build_scheduler(
        cfg, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01), steps_per_epoch=3
    )  # one group: the schedule unfrozen
    for step in range(12):
        backbone = [g["lr"] for g in optimizer.param_groups if g["part"] == "backbone"]
        head = [g["lr"] for g in optimizer.param_groups if g["part"] == "head"]
        expected = reference.get_last_lr()[0]
        assert head == pytest.approx([expected] * 2) and expected > 0
        assert backbone == ([0.0] * 2 if step < 6 else pytest.approx([expected] * 2))
        optimizer.step()
        scheduler.step()
        reference.optimizer.step()
        reference.step()


def test_no_classifier_head_is_one_error_line():
    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

    with pytest.raises(UserError, match="classifier head"):
        optim.build_optimizer(config(head_lr_scale=2.0), NoHead(), world_size=1)


# ----------------------------------------------------------------------------- regrouping


def stepped_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = optim.build_optimizer(cfg, model, world_size=1)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    return optimizer


def test_one_group_state_moves_to_the_new_groups_by_name_only_when_asked():
    torch.manual_seed(0)
    model = timm.create_model(SMALL_MODEL, num_classes=3)
    old = stepped_optimizer(config(decay_norm_and_bias=True), model).state_dict()
    for group in old["param_groups"]:  # as written before the groups had names
        del group["param_names"]
    new = optim.build_optimizer(config(head_lr_scale=3.0), model, world_size=1)
    with pytest.raises(UserError, match="--resume_override"):
        optim.restore_optimizer_state(new, old, model)
    optim.restore_optimizer_state(new, old, model, regroup=True)
    names = dict(model.named_parameters())
    for position, (name, _) in enumerate(model.named_parameters()):
        for key, value in old["state"][position].items():
            assert torch.equal(new.state[names[name]][key], value), (name, key)
    assert [g["weight_decay"] for g in new.param_groups] == [0.0, 0.01, 0.0, 0.01]


def test_groups_of_the_same_sizes_but_other_parameters_are_another_layout():
    model = timm.create_model(SMALL_MODEL, num_classes=3)
    saved = optim.build_optimizer(config(), model, world_size=1).state_dict()
    current = optim.build_optimizer(config(), model, world_size=1)
    assert optim.same_layout(saved["param_groups"], current.param_groups)
    names = saved["param_groups"][1]["param_names"]
    names[0], names[1] = names[1], names[0]
    assert not optim.same_layout(saved["param_groups"], current.param_groups)
    with pytest.raises(UserError, match="parameter groups"):
        optim.restore_optimizer_state(current, saved, model)


def test_resume_check_names_the_grouping_of_an_old_checkpoint():
    old = {"config": {"learning_rate": 0.001}}  # a checkpoint from before these flags
    assert changed_settings(old, TrainConfig().to_dict(), 1) == [
        "--decay_norm_and_bias True -> False"
    ]
    same = TrainConfig(decay_norm_and_bias=True).to_dict()
    assert changed_settings(old, same, 1) == []
    moved = TrainConfig(head_lr_scale=2.0, freeze_backbone_epochs=1, clip_grad_norm=1.0)
    assert set(changed_settings({"config": TrainConfig().to_dict()}, moved.to_dict(), 1)) == {
        "--head_lr_scale 1.0 -> 2.0",
        "--freeze_backbone_epochs 0 -> 1",
        "--clip_grad_norm 0.0 -> 1.0",
    }


# ----------------------------------------------------------------------------- clipping


def run_parts(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler, clip: float, micro_batch: int
) -> RunParts:
    return RunParts(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler,
        nn.CrossEntropyLoss(),
        FP32,
        MemoryPlan(micro_batch=micro_batch),
        CPU,
        clip_grad_norm=clip,
    )


def test_clip_grad_norm_clips_the_unscaled_whole_step_gradient_once(monkeypatch):
    torch.manual_seed(0)
    images, targets = torch.randn(8, 5) * 10, torch.randint(0, 3, (8,))
    model = nn.Linear(5, 3)
    reference = nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())

    # The expected update: the whole batch's gradient, clipped to norm 0.1, times lr 1.
    nn.functional.cross_entropy(reference(images), targets).backward()
    grads = [p.grad for p in reference.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 1.0  # the limit below really clips
    expected = [
        p.detach() - g * (0.1 / (norm + 1e-6))
        for p, g in zip(reference.parameters(), grads, strict=True)
    ]

    calls = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def counting_clip(params, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return real_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counting_clip)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # gradients 1024x until unscaled
    state = run_parts(model, optimizer, scaler, clip=0.1, micro_batch=2)  # 4 micro-batches
    train_step(state, images, targets)
    assert calls == [0.1]
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


def test_clip_leaves_out_groups_whose_learning_rate_is_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 3))
    frozen, head = model[0], model[1]
    optimizer = torch.optim.SGD(
        [{"params": frozen.parameters(), "lr": 0.0}, {"params": head.parameters(), "lr": 1.0}]
    )
    state = run_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), 0.01, 8)
    images, targets = torch.randn(8, 5) * 10, torch.randint(0, 3, (8,))
    train_step(state, images, targets)
    head_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in head.parameters()])
    )
    assert head_norm == pytest.approx(0.01, rel=1e-3)  # clipped over the head alone
    assert torch.linalg.vector_norm(frozen.weight.grad) > 0.01  # not clipped


def test_without_clip_grad_norm_nothing_is_clipped(monkeypatch):
    monkeypatch.setattr(training_step, "clip_gradients", lambda state: pytest.fail("clipped"))
    model = nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = run_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), 0.0, 4)
    train_step(state, torch.randn(8, 5), torch.randint(0, 3, (8,)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clip_grad_norm_under_float16_gradscaler_on_cuda():
    torch.manual_seed(0)
    device = torch.device("cuda")
    images, targets = (
        torch.randn(8, 5, device=device) * 10,
        torch.randint(0, 3, (8,), device=device),
    )
    model = nn.Linear(5, 3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    state = RunParts(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        torch.amp.GradScaler("cuda", init_scale=1024.0),
        nn.CrossEntropyLoss(),
        Precision(True, torch.float16),
        MemoryPlan(micro_batch=4),
        device,
        clip_grad_norm=0.1,
    )
    train_step(state, images, targets)
    moved = torch.linalg.vector_norm(
        torch.cat(
            [(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]
        )
    ).item()  # approx compares host numbers: a CUDA tensor has no numpy view
    assert moved == pytest.approx(0.1, rel=1e-2)  # lr 1: the update is the clipped gradient


# ----------------------------------------------------------------------------- end to end


@pytest.fixture
def small_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """3 classes of 8 training images: 3 steps of 8 per epoch."""
    return (
        write_image_folder(tmp_path / "data" / "train", CLASSES, 8, seed=1),
        write_image_folder(tmp_path / "data" / "val", CLASSES, 2, seed=2),
    )


def small_flags(train: Path, val: Path, *extra: str) -> list[str]:
    return [
        "--train_dir",
        str(train),
        "--val_dir",
        str(val),
        *TINY_FLAGS,
        "--model",
        SMALL_MODEL,
        "--deterministic",
        "--no_tensorboard",
        *extra,
    ]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def is_head(name: str) -> bool:
    return name.startswith("fc.")


@pytest.mark.slow
def test_backbone_is_unchanged_while_frozen_and_trains_after(small_dataset, tmp_path):
    train, val = small_dataset
    flags = small_flags(train, val, "--epochs", "2", "--freeze_backbone_epochs", "1")
    assert run_train([*flags, "--head_lr_scale", "3"], cwd=tmp_path) == 0
    seed_everything(42)  # the run's initial weights (run_parts.build_run_parts)
    initial = timm.create_model(SMALL_MODEL, num_classes=3).state_dict()
    after_1 = load(tmp_path / "checkpoints" / "checkpoint_latest.prev.pth")
    after_2 = load(tmp_path / "checkpoints" / "checkpoint_latest.pth")
    assert after_1["epoch"] == 1 and after_2["epoch"] == 2
    params = {n for n, p in timm.create_model(SMALL_MODEL, num_classes=3).named_parameters()}
    for name in params:
        w0, w1, w2 = (
            initial[name],
            after_1["model_state_dict"][name],
            after_2["model_state_dict"][name],
        )
        if is_head(name):
            assert not torch.equal(w0, w1), f"{name}: the head trains while the backbone is frozen"
        else:
            assert torch.equal(w0, w1), f"{name} moved during the frozen epoch"
            assert not torch.equal(w1, w2), f"{name} did not train after the unfreeze"
    # BatchNorm running statistics of the frozen backbone keep adapting (a documented choice).
    running = [n for n in initial if n.endswith("running_mean")]
    assert running and all(
        not torch.equal(initial[n], after_1["model_state_dict"][n]) for n in running
    )


# Exact resume inside the frozen epochs and across the unfreeze, with --head_lr_scale and
# --clip_grad_norm: tests/test_resume.py::test_mid_epoch_resume_with_the_recipe_and_other_num_workers_is_exact.


def assert_same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def as_old_checkpoint(path: Path) -> None:
    """What a checkpoint of the trainer before these flags holds: no keys for them in its
    config, no names in its optimizer's (single) param group."""
    state = load(path)
    for key in ("decay_norm_and_bias", "clip_grad_norm", "head_lr_scale"):
        del state["config"][key]
    del state["config"]["freeze_backbone_epochs"], state["config"]["eval_resize_ratio"]
    for group in state["optimizer_state_dict"]["param_groups"]:
        del group["param_names"], group["part"]
    path.unlink()  # a new file: checkpoint_best.pth may be another name of this one (a hard link)
    torch.save(state, path)


@pytest.mark.slow
def test_old_single_group_checkpoint_resumes_or_says_which_flag(small_dataset, tmp_path, capsys):
    train, val = small_dataset
    flags = small_flags(train, val)
    assert run_train([*flags, "--epochs", "1", "--decay_norm_and_bias"], cwd=tmp_path) == 0
    latest = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    as_old_checkpoint(latest)
    old = latest.read_bytes()

    import imgtrainer.run.train as train_ddp

    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", *flags, "--epochs", "2", "--resume", "auto"],
        capsys,
        cwd=tmp_path,
    )
    assert "--decay_norm_and_bias True -> False" in line and "--resume_override" in line
    assert latest.read_bytes() == old  # refused: nothing written
    resume = [*flags, "--epochs", "2", "--resume", "auto"]
    assert run_train([*resume, "--decay_norm_and_bias"], cwd=tmp_path) == 0
    assert len(load(latest)["optimizer_state_dict"]["param_groups"]) == 1

    latest.unlink()  # replaced, not rewritten in place: the best checkpoint may share its file
    latest.write_bytes(old)
    assert run_train([*resume, "--resume_override"], cwd=tmp_path) == 0
    groups = load(latest)["optimizer_state_dict"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.01]
    assert (
        "applied --decay_norm_and_bias True -> False"
        in (tmp_path / "logs" / "train_rank_0.log").read_text()
    )


# ----------------------------------------------------------------------------- evaluation


def centre_square_image(side: int = 100) -> Image.Image:
    """Black, with a white square over the central half of each side."""
    image = Image.new("RGB", (side, side))
    image.paste((255, 255, 255), (side // 4, side // 4, 3 * side // 4, 3 * side // 4))
    return image


def test_eval_resize_ratio_is_the_share_of_the_short_side_kept():
    image = centre_square_image()
    half = eval_transforms(32, 0.5)(image)
    whole = eval_transforms(32, 1.0)(image)
    default = eval_transforms(32)  # 1/0.875
    assert half.shape == whole.shape == (3, 32, 32)
    assert half.float().mean() > 250  # resized to 64, the central 32: the white square only
    assert 0.2 < whole.float().mean() / 255 < 0.3  # the whole picture: a quarter white
    assert default.transforms[1].size == [37]  # ceil(32 / 0.875)


def test_training_validates_with_the_ratio_cached_or_not(tiny_dataset):
    train, val = tiny_dataset
    for cache in ("none", "ram"):
        cfg = data_config(
            train, val, image_size=16, seed=0, eval_resize_ratio=0.5, cache_images=cache
        )
        _, val_set, *_ = build_datasets(cfg, ONE_CPU_PROCESS)
        assert val_set.transform.transforms[1].size == [32]
        image, _ = val_set[0]
        assert image.shape == (3, 16, 16)
        if cache == "ram":  # kept at the evaluation resize: the transform only crops
            assert min(val_set.images.cached(0).shape[1:]) == 32


def with_config(checkpoint: Path, path: Path, **changes) -> Path:
    state = load(checkpoint)
    state["config"] = {**state["config"], **changes}
    for key in [k for k, v in changes.items() if v is None]:
        del state["config"][key]
    torch.save(state, path)
    return path


def test_inference_tools_use_the_training_ratio_unless_told(trained_run, tmp_path):
    custom = with_config(trained_run.best, tmp_path / "r.pth", eval_resize_ratio=0.5)
    old = with_config(trained_run.best, tmp_path / "old.pth", eval_resize_ratio=None)
    assert inference.load_classifier(custom, CPU).eval_resize_ratio == 0.5
    assert inference.load_classifier(custom, CPU).transform.transforms[1].size == [32]
    assert inference.load_classifier(custom, CPU, eval_resize_ratio=1.0).transform.transforms[
        1
    ].size == [16]
    assert inference.load_classifier(old, CPU).eval_resize_ratio == 0.875


def test_eval_resize_ratio_out_of_range_is_one_error_line(trained_run, capsys):
    line = user_error_line(
        predict_main,
        ["--checkpoint", trained_run.best, trained_run.val, "--eval_resize_ratio", "1.5"],
        capsys,
    )
    assert "--eval_resize_ratio must be in (0, 1]" in line


class ColumnWeights(nn.Module):
    """Logits from a weighted sum over image columns: a mirror image gets other logits, unless
    the weights are symmetric."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.weights = weights  # (classes, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(1, 2)) @ self.weights.T


def test_flip_tta_averages_the_softmax_of_both_views():
    torch.manual_seed(0)
    images = torch.randn(4, 3, 8, 8)
    skewed = ColumnWeights(torch.randn(3, 8) * 3)
    got = inference.FlipAveraged(skewed)(images)
    expected = (skewed(images).softmax(1) + skewed(images.flip(-1)).softmax(1)) / 2
    torch.testing.assert_close(got.softmax(1), expected)
    torch.testing.assert_close(got.exp().sum(1), torch.ones(4))  # log-probabilities
    assert not torch.allclose(expected, skewed(images).softmax(1))  # the flip mattered

    weights = torch.randn(3, 8)
    symmetric = ColumnWeights(weights + weights.flip(-1))
    torch.testing.assert_close(
        inference.FlipAveraged(symmetric)(images).softmax(1), symmetric(images).softmax(1)
    )


def test_predict_with_flip_tta_reports_the_averaged_probabilities(trained_run, tmp_path, capsys):
    photos = write_image_folder(tmp_path / "photos", CLASSES, 1, seed=9, ext="png")
    argv = ["--checkpoint", trained_run.best, photos, "--json", "--device", "cpu", "--topk", "3"]
    capsys.readouterr()
    assert run_main(predict_main, [*argv, "--tta", "flip"]) == 0
    records = json.loads(capsys.readouterr().out)

    plain = inference.load_classifier(trained_run.best, CPU)
    for record in records:
        image = plain.transform(Image.open(record["path"]).convert("RGB"))
        x = normalize_batch(image[None], plain.mean, plain.std)
        with torch.no_grad():
            expected = (plain.model(x).softmax(1) + plain.model(x.flip(-1)).softmax(1)) / 2
        for prediction in record["predictions"]:
            index = plain.class_names.index(prediction["class"])
            assert prediction["probability"] == pytest.approx(expected[0, index].item(), rel=1e-5)


def test_evaluate_with_flip_tta_records_it(trained_run, tmp_path):
    out = tmp_path / "eval"
    argv = ["--checkpoint", trained_run.best, "--data_dir", trained_run.val, "--device", "cpu"]
    assert (
        run_main(evaluate_main, [*argv, "--output", out, "--tta", "flip", "--num_workers", "0"])
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tta"] == "flip" and metrics["eval_resize_ratio"] == 0.875
    assert metrics["images"] == 15 and 0.0 <= metrics["top1"] <= 1.0
    assert math.isfinite(metrics["loss"])
