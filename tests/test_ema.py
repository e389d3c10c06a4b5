"""EMA of the weights (src/ema.py, --model_ema): the update arithmetic and its warm-up against a
hand computation, steps the GradScaler skipped, BatchNorm buffers, the checkpoint keys, exact
resume, and the inference tools choosing the EMA or the raw weights."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

from conftest import TINY_FLAGS, run_main, run_train, user_error_line, write_image_folder
from imgtrainer.checkpoints.files import CHECKPOINT_SCHEMA, CheckpointError
from imgtrainer.hooks import StepInfo
from imgtrainer.tools.evaluate import main as evaluate_main
from imgtrainer.tools.inference import choose_weights
from imgtrainer.tools.predict import main as predict_main
from imgtrainer.training.best import metric_value
from imgtrainer.training.ema import ModelEma, ema_decay

SUMS = torch.zeros(3, dtype=torch.float64)


def taken_step(step: int = 1) -> StepInfo:
    return StepInfo(step, step, SUMS)


def skipped_step(step: int = 1) -> StepInfo:
    """What train_step reports after the GradScaler skipped the step (float16 overflow)."""
    return StepInfo(step, step, SUMS, _skipped=torch.tensor(True))


def scalar_model(value: float) -> nn.Linear:
    """One weight and no bias: the EMA of it is one number to follow by hand."""
    model = nn.Linear(1, 1, bias=False)
    set_weight(model, value)
    return model


def set_weight(model: nn.Linear, value: float) -> None:
    with torch.no_grad():
        model.weight.fill_(value)


def ema_weight(ema: ModelEma) -> float:
    return ema.module.weight.item()


# ----------------------------------------------------------------------------- arithmetic


def test_decay_warm_up_by_hand():
    # decay(n) = min(cap, 1 - n^-0.75): 2^-0.75 = 0.5946035575, 100^-0.75 = 0.0316227766
    assert ema_decay(1, 0.999) == 0.0  # the first update copies the weights
    assert ema_decay(2, 0.999) == pytest.approx(1 - 0.5946035575, abs=1e-9)
    assert ema_decay(100, 0.999) == pytest.approx(1 - 0.0316227766, abs=1e-9)
    assert ema_decay(10_000, 0.999) == pytest.approx(0.999, abs=1e-12)  # 10^4^-0.75 = 10^-3
    assert ema_decay(50_000, 0.999) == 0.999  # capped
    assert ema_decay(50_000, 0.9) == 0.9
    # The formula we document is the one timm's ModelEmaV3 runs with our update count.
    ema = ModelEma(scalar_model(0.0), decay=0.999)
    for n in (1, 2, 3, 10, 100, 1_500, 10_000, 20_000):
        assert ema._ema.get_decay(n) == pytest.approx(ema_decay(n, 0.999), abs=1e-15)


def test_update_arithmetic_by_hand():
    model = scalar_model(1.0)
    ema = ModelEma(model, decay=0.999)
    set_weight(model, 5.0)
    ema.on_step_end(taken_step(1))  # decay 0: a copy
    assert ema_weight(ema) == 5.0 and ema.updates == 1
    set_weight(model, 1.0)
    ema.on_step_end(taken_step(2))  # 5 + (1 - decay(2)) * (1 - 5) = 5 - 4 * 2^-0.75
    assert ema_weight(ema) == pytest.approx(5 - 4 * 0.5946035575, abs=1e-6)  # 2.6215858
    set_weight(model, 3.0)
    ema.on_step_end(taken_step(3))  # 2.6215858 + 3^-0.75 * (3 - 2.6215858), 3^-0.75 = 0.438691
    assert ema_weight(ema) == pytest.approx(2.6215858 + 0.4386913 * 0.3784142, abs=1e-6)
    assert ema.updates == 3
    assert model.weight.item() == 3.0  # the trained weights are never touched


def test_cap_is_the_decay_once_warmed_up():
    model = scalar_model(0.0)
    ema = ModelEma(model, decay=0.9)
    ema.updates = 1_000  # far past the warm-up: 1 - 1001^-0.75 > 0.9
    set_weight(model, 10.0)
    ema.update()
    assert ema_weight(ema) == pytest.approx(0.0 + (1 - 0.9) * 10.0, abs=1e-6)


def test_a_step_the_grad_scaler_skipped_does_not_update():
    model = scalar_model(2.0)
    ema = ModelEma(model, decay=0.999)
    ema.on_step_end(taken_step(1))
    set_weight(model, 7.0)
    assert ema.on_step_end(skipped_step(2)) is False  # never stops the epoch
    assert ema_weight(ema) == 2.0 and ema.updates == 1
    # A step flagged on the device as not skipped counts.
    ema.on_step_end(StepInfo(3, 3, SUMS, _skipped=torch.tensor(False)))
    assert ema.updates == 2 and ema_weight(ema) != 2.0


def test_disabled_it_does_nothing():
    ema = ModelEma(None)
    assert not ema.enabled and ema.state_dict() is None
    assert ema.on_step_end(taken_step()) is False and ema.updates == 0
    ema.resume({"model_ema_state_dict": {"weight": torch.ones(1, 1)}, "ema_updates": 4})
    assert ema.updates == 0
    with pytest.raises(RuntimeError, match="disabled"):
        ema.module  # noqa: B018


def test_batchnorm_statistics_are_averaged_and_counters_copied():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    bn = model[1]
    ema = ModelEma(model, decay=0.999)
    model.train()
    model(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))  # running stats move; counter 1
    ema.on_step_end(taken_step(1))
    first_mean = bn.running_mean.clone()
    assert torch.equal(ema.module[1].running_mean, first_mean)  # decay 0: copied
    model(torch.tensor([[5.0, -2.0], [7.0, 0.0]]))  # counter 2
    ema.on_step_end(taken_step(2))
    weight = 2**-0.75  # 1 - decay(2)
    expected = first_mean + weight * (bn.running_mean - first_mean)
    assert torch.allclose(ema.module[1].running_mean, expected, atol=1e-6)
    assert not torch.allclose(ema.module[1].running_mean, bn.running_mean)
    assert ema.module[1].num_batches_tracked.item() == 2  # integer buffers: copied
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_resume_continues_the_average_or_starts_from_the_weights():
    model = scalar_model(1.0)
    ema = ModelEma(model, decay=0.999)
    for value in (4.0, 2.0, 8.0):
        set_weight(model, value)
        ema.update()
    saved = {"model_ema_state_dict": ema.state_dict(), "ema_updates": ema.updates}
    resumed = ModelEma(scalar_model(8.0), decay=0.999)
    resumed.resume(saved)
    assert resumed.updates == 3 and ema_weight(resumed) == ema_weight(ema)
    for each in (ema, resumed):
        each.source.weight.data.fill_(-1.0)
        each.update()
    assert ema_weight(resumed) == ema_weight(ema)  # the same next step, bitwise
    # A checkpoint of a run without EMA: the average starts from the resumed weights.
    fresh = ModelEma(scalar_model(0.0), decay=0.999)
    set_weight(fresh.source, 6.0)
    fresh.resume({"model_ema_state_dict": None})
    assert fresh.updates == 0 and ema_weight(fresh) == 6.0


def test_best_weights_and_score():
    raw_better = {"val_acc": 0.8, "val_acc_ema": 0.7}
    ema_better = {"val_acc": 0.6, "val_acc_ema": 0.7}
    assert metric_value(raw_better, "val_acc", ema_enabled=True) == (0.8, "raw")
    assert metric_value(ema_better, "val_acc", ema_enabled=True) == (0.7, "ema")
    tie = {"val_acc": 0.7, "val_acc_ema": 0.7}
    assert metric_value(tie, "val_acc", ema_enabled=True) == (0.7, "ema")
    # No EMA weights saved.
    assert metric_value(ema_better, "val_acc", ema_enabled=False) == (0.6, "raw")
    assert metric_value({"val_acc": 0.5}, "val_acc", ema_enabled=True) == (0.5, "raw")


def test_inference_weights_choice():
    raw, ema = {"w": torch.zeros(1)}, {"w": torch.ones(1)}
    state = {"model_state_dict": raw, "model_ema_state_dict": ema, "best_weights": "ema"}
    path = Path("c.pth")
    assert choose_weights(state, path)[:2] == ("ema", ema)
    assert choose_weights(state, path, "raw")[:2] == ("raw", raw)
    assert choose_weights({**state, "best_weights": "raw"}, path)[:2] == ("raw", raw)
    assert choose_weights({**state, "best_weights": "raw"}, path, "ema")[:2] == ("ema", ema)
    assert choose_weights({**state, "best_weights": None}, path)[:2] == ("ema", ema)
    no_ema = {"model_state_dict": raw, "model_ema_state_dict": None, "best_weights": "raw"}
    assert choose_weights(no_ema, path)[:2] == ("raw", raw)
    assert choose_weights({"model_state_dict": raw}, path)[:2] == ("raw", raw)  # older file
    with pytest.raises(CheckpointError, match="no EMA weights"):
        choose_weights(no_ema, path, "ema")
    by_loss = {**state, "best_weights": "raw", "best_metric": "val_loss"}
    assert "they scored a lower val_loss than the EMA" in choose_weights(by_loss, path)[2]


def weights_help(tool: str) -> str:
    parser = importlib.import_module(f"imgtrainer.tools.{tool}").build_parser()
    return next(a.help for a in parser._actions if "--weights" in a.option_strings)


def test_the_weights_help_names_the_runs_best_metric():
    for tool in ("evaluate", "predict"):
        assert "--best_metric" in weights_help(tool) and "val_acc" not in weights_help(tool)
    assert "as in evaluate.py" in weights_help("export")


# ----------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """One tiny epoch with --model_ema (48 images, batch 8: 6 steps); (its folder, its flags)."""
    root = tmp_path_factory.mktemp("ema_run")
    classes = ["cat", "dog", "fox"]
    train = write_image_folder(root / "data" / "train", classes, 16, seed=1)
    val = write_image_folder(root / "data" / "val", classes, 5, seed=2)
    # --cache_images none: training's evaluation reads the files as evaluate.py does (the RAM
    # cache decodes and resizes them its own way, which moves the loss in the 4th digit).
    flags = ["--train_dir", train, "--val_dir", val, *TINY_FLAGS, "--no_tensorboard"]
    flags += ["--cache_images", "none"]
    assert run_train([*flags, "--epochs", "1", "--model_ema"], cwd=root) == 0
    return root, flags


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_the_checkpoint_carries_the_ema(ema_run):
    root, _ = ema_run
    state = load(root / "checkpoints" / "checkpoint_latest.pth")
    assert state.keys() == CHECKPOINT_SCHEMA.keys()
    ema, raw = state["model_ema_state_dict"], state["model_state_dict"]
    assert ema.keys() == raw.keys()  # plain keys: no module. / _orig_mod. prefix
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ema)
    assert state["ema_updates"] == 6  # one per optimizer step of the epoch
    assert any(not torch.equal(ema[k], raw[k]) for k in raw if raw[k].is_floating_point())
    # timm's key holds the same tensors, stored once.
    assert (
        all(state["state_dict_ema"][k].data_ptr() == ema[k].data_ptr() for k in ema)
        and state["state_dict_ema"].keys() == ema.keys()
    )
    plain = timm.create_model("test_resnet", num_classes=3)
    plain.load_state_dict(ema)  # strict
    # timm's own loader prefers the EMA weights.
    via_timm = timm.create_model(
        "test_resnet",
        num_classes=3,
        checkpoint_path=str(root / "checkpoints" / "checkpoint_best.pth"),
    )
    assert torch.equal(via_timm.fc.weight, ema["fc.weight"])


def test_history_and_log_line_have_the_ema_metrics(ema_run):
    root, _ = ema_run
    history = json.loads((root / "logs" / "training_history.json").read_text())
    record = history["epochs"][0]
    for key in ("val_loss_ema", "val_acc_ema", "val_top5_ema"):
        assert isinstance(record[key], float), key
    assert record["val_loss_ema"] != record["val_loss"]
    best = load(root / "checkpoints" / "checkpoint_best.pth")
    best_acc, weights = metric_value(record, "val_acc", ema_enabled=True)
    assert (best["best_weights"], best["best_acc"]) == (weights, best_acc)
    log = (root / "logs" / "train_rank_0.log").read_text()
    assert f"val_acc_ema {record['val_acc_ema']:.4f}" in log
    assert "(best: " in log and " weights, epoch 1)" in log


def test_evaluate_uses_the_ema_weights_and_the_flag_the_raw_ones(ema_run, capsys):
    root, _ = ema_run
    checkpoint = root / "checkpoints" / "checkpoint_latest.pth"
    record = json.loads((root / "logs" / "training_history.json").read_text())["epochs"][0]
    state = load(checkpoint)
    data = root / "data" / "val"
    # Training's batch size: the same pass as training's evaluation, so the same loss.
    common = ["--checkpoint", checkpoint, "--data_dir", data, "--batch_size", "8"]
    common += ["--num_workers", "0", "--device", "cpu"]
    auto = "ema" if state["best_weights"] == "ema" else "raw"
    capsys.readouterr()
    assert run_main(evaluate_main, [*common, "--output", root / "eval_auto"]) == 0
    assert (
        run_main(evaluate_main, [*common, "--output", root / "eval_raw", "--weights", "raw"]) == 0
    )
    assert (
        run_main(evaluate_main, [*common, "--output", root / "eval_ema", "--weights", "ema"]) == 0
    )
    out = capsys.readouterr().out
    metrics = {
        name: json.loads((root / f"eval_{name}" / "metrics.json").read_text())
        for name in ("auto", "raw", "ema")
    }
    assert metrics["auto"]["weights"] == auto
    assert metrics["raw"]["weights"] == "raw" and metrics["ema"]["weights"] == "ema"
    # Exactly: the same pass over the same images with the same weights.
    assert metrics["ema"]["loss"] == record["val_loss_ema"] != record["val_loss"]
    assert metrics["raw"]["loss"] == record["val_loss"]
    assert metrics["ema"]["top1"] == record["val_acc_ema"]
    assert metrics["raw"]["top1"] == record["val_acc"]
    assert "with the EMA weights" in out and "with the raw weights (--weights raw)" in out


def test_predict_uses_the_ema_weights_and_the_flag_the_raw_ones(ema_run, tmp_path, capsys):
    root, _ = ema_run
    checkpoint = root / "checkpoints" / "checkpoint_latest.pth"
    state = load(checkpoint)
    # Pin the choice: this checkpoint says the EMA weights scored higher.
    torch.save({**state, "best_weights": "ema"}, tmp_path / "ema_best.pth")
    photos = root / "data" / "val" / "cat"
    common = [photos, "--json", "--device", "cpu", "--num_workers", "0"]

    def predictions(*extra) -> tuple[list, str]:
        capsys.readouterr()
        assert run_main(predict_main, [*common, *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err

    by_default, err_default = predictions("--checkpoint", tmp_path / "ema_best.pth")
    as_ema, _ = predictions("--checkpoint", tmp_path / "ema_best.pth", "--weights", "ema")
    as_raw, err_raw = predictions("--checkpoint", tmp_path / "ema_best.pth", "--weights", "raw")
    assert by_default == as_ema and by_default != as_raw
    assert "Predicting with the EMA weights" in err_default
    assert "Predicting with the raw weights (--weights raw)" in err_raw
    # When the checkpoint says the raw weights scored higher, auto takes them.
    torch.save({**state, "best_weights": "raw"}, tmp_path / "raw_best.pth")
    raw_best, err = predictions("--checkpoint", tmp_path / "raw_best.pth")
    assert raw_best == as_raw
    assert "the raw weights (they scored a higher val_acc" in err


def test_weights_ema_without_ema_is_one_error_line(ema_run, tmp_path, capsys):
    root, _ = ema_run
    state = load(root / "checkpoints" / "checkpoint_latest.pth")
    no_ema = tmp_path / "no_ema.pth"
    torch.save({**state, "model_ema_state_dict": None, "state_dict_ema": None}, no_ema)
    photo = next((root / "data" / "val" / "cat").iterdir())
    line = user_error_line(
        predict_main, ["--checkpoint", no_ema, photo, "--weights", "ema", "--device", "cpu"], capsys
    )
    assert "no EMA weights" in line and "--weights raw" in line


def test_ema_decay_out_of_range_is_one_error_line(ema_run, capsys):
    import imgtrainer.run.train as train_ddp

    root, flags = ema_run
    line = user_error_line(
        train_ddp.main, ["--device", "cpu", *flags, "--model_ema", "--ema_decay", "1"], capsys
    )
    assert "--ema_decay must be in (0, 1), got 1.0" in line


# The EMA through a SIGKILL and torchrun's restart of 2 processes, bitwise:
# tests/test_resume.py::test_sigkill_mid_epoch_then_torchrun_restart_is_bitwise_exact.


def test_resume_with_another_decay_of_a_kept_average_is_refused():
    from imgtrainer.checkpoints.resume import changed_settings
    from imgtrainer.config import TrainConfig

    saved = {"config": TrainConfig(model_ema=True, ema_decay=0.999).to_dict()}
    other = TrainConfig(model_ema=True, ema_decay=0.99).to_dict()
    assert changed_settings(saved, other, 1) == ["--ema_decay 0.999 -> 0.99"]
    # Without an average in both runs there is nothing whose decay changes.
    assert changed_settings(saved, TrainConfig(ema_decay=0.99).to_dict(), 1) == []
    before_ema = {"config": {k: v for k, v in saved["config"].items() if k != "ema_decay"}}
    assert changed_settings(before_ema, other, 1) == []  # written before the flag existed


def bits(module: nn.Module) -> list[torch.Tensor]:
    """Every state value as integers: equal bits, not just equal values (-0.0, NaN)."""
    return [
        v.view(torch.int64 if v.dtype == torch.int64 else torch.int32).clone()
        for v in module.state_dict().values()
    ]


def test_device_update_matches_timm_bitwise_and_a_skip_changes_nothing():
    """The update decided on the device (no host read of the skip flag) gives timm's numbers
    bit for bit when steps are taken; a skipped step leaves every bit and the count as they
    were. Past the first weight table (1,024 updates) too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ema = ModelEma(model, decay=0.9999)
    reference = timm.utils.ModelEmaV3(model, decay=0.9999, use_warmup=True, warmup_power=0.75)
    steps = [*range(1, 6), 1023, 1024, 1025, 3000]
    for n in steps:
        if n > 5:  # jump ahead: both count the same updates done
            ema.updates, taken = n - 1, n
        else:
            taken = n
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()
        model(torch.randn(8, 4))
        before = bits(ema.module)
        ema.on_step_end(StepInfo(n, n, SUMS, _skipped=torch.tensor(True)))
        assert all(torch.equal(a, b) for a, b in zip(before, bits(ema.module), strict=True))
        assert ema.updates == taken - 1
        ema.on_step_end(StepInfo(n, n, SUMS, _skipped=torch.tensor(False)))
        if n > 5:
            reference.module.load_state_dict(
                {k: v.view(t.dtype) for (k, t), v in
                 zip(ema.module.state_dict().items(), before, strict=True)}
            )  # fmt: skip
        reference.update(model, step=taken)
        assert ema.updates == taken
        assert all(
            torch.equal(a, b) for a, b in zip(bits(reference.module), bits(ema.module), strict=True)
        ), n


def test_an_update_without_a_grad_scaler_is_timms_own_call_bitwise():
    """No device skip flag (bfloat16, float32): the count is known on the host and the update
    is timm's multi-tensor lerp with a Python weight, bit for bit, past the first table too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ema = ModelEma(model, decay=0.999)
    reference = timm.utils.ModelEmaV3(model, decay=0.999, use_warmup=True, warmup_power=0.75)
    for n in [*range(1, 6), 1500, 1501]:
        if n > 5:
            ema.updates = n - 1
            reference.module.load_state_dict(ema.module.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()
        model(torch.randn(8, 4))
        ema.on_step_end(StepInfo(n, n, SUMS))
        reference.update(model, step=n)
        assert ema.updates == n
        assert all(
            torch.equal(a, b) for a, b in zip(bits(reference.module), bits(ema.module), strict=True)
        ), n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("skip_flag", [False, True])
def test_an_update_is_a_few_launches_not_one_per_tensor(skip_flag):
    """ResNet18's 102 floating-point state tensors: the lerp runs as multi-tensor kernels (a
    handful of launches), with and without the GradScaler's device skip flag."""
    from torch.profiler import ProfilerActivity, profile

    model = timm.create_model("resnet18", num_classes=10).cuda()
    ema = ModelEma(model, decay=0.999)
    skipped = torch.tensor(False, device="cuda") if skip_flag else None
    ema.update(skipped)  # the state lists and weights made once
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ema.update(skipped)
        torch.cuda.synchronize()
    lerps = [e for e in prof.events() if e.device_type.name == "CUDA" and "lerp" in e.name.lower()]
    assert 0 < len(lerps) <= 8, [e.name for e in lerps]
