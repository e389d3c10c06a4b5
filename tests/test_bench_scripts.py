"""bench/'s scripts run as a user runs them, in a new interpreter, on tiny settings: their own
logic (which rows run, the commands they start, the tables and JSON they write) is what a user
sees of it. No test imports a bench file."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli

BENCH = ROOT / "bench"
RECIPES = BENCH / "recipes" / "recipes.py"

# ----------------------------------------------------------------------------- chaos.py


@pytest.mark.slow
def test_a_short_chaos_soak_survives_each_fault_and_ends_bitwise(tmp_path: Path):
    """Four faults of a seeded schedule over a 5-epoch run beside an unfaulted one: seed 5 is a
    full disk, a stopped rank, a killed loader worker and a killed rank where the soak can make
    a tmpfs of its own (``unshare -rm``), else a killed worker and rank, a stopped rank and
    SIGTERM to the launcher with the same command again."""
    flags = ["--faults", 4, "--epochs", 5, "--seed", 5, "--workdir", tmp_path]
    result = run_cli([BENCH / "chaos.py", *flags], cwd=tmp_path, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("chaos soak, seed 5") or "no full disk in this soak" in out, out
    faults = [line for line in out.splitlines() if re.match(r"\s+\d+ \w+ \w+\s+step ", line)]
    assert len(faults) == 4 and all("survived" in line for line in faults), out
    assert re.search(r"4 faults injected, 4 survived, \d+ restarts", out), out
    assert "every epoch once: yes (5 epochs" in out
    assert "final weights and optimizer state vs the unfaulted run: bitwise equal" in out
    assert "replay: python bench/chaos.py --seed 5 --faults 4 --epochs 5" in out


# ----------------------------------------------------------------------------- throughput.py


@pytest.mark.slow
def test_throughput_runs_its_rows_and_writes_its_json(tmp_path: Path):
    """The trainer against its ceiling at world size 2, JPEG decode rates and the policies'
    times, on the CPU (a step variant would be one more torchrun job: left to its users)."""
    output = tmp_path / "throughput.json"
    flags = ["--image_size", "16", "--batch_size", "4", "--device", "cpu"]
    # timm's small ResNet: the report's rows are the same for any model.
    flags += ["--model", "test_resnet", "--warmup", "1", "--steps", "2"]
    # 2 processes only: the one-process row runs the same code without the all-reduce (and
    # each row costs a ceiling run and a trainer run).
    flags += ["--world_sizes", "2", "--startup_images", "0", "--output", output]
    flags += ["--decode", "--policy", "--audit", "--pairs", "1"]
    result = run_cli([BENCH / "throughput.py", *flags], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(output.read_text())
    assert report["settings"]["dataset"] == "patches"  # the quick default on the CPU
    off, row = report["results"]  # the data audit off, then at its default rate
    assert (off["variant"], row["variant"]) == ("audit off", "audit on")
    assert row["world_size"] == 2
    trainer, ceiling = row["trainer"], row["ceiling"]
    assert row["efficiency"] == pytest.approx(trainer["images_per_sec"] / ceiling["images_per_sec"])
    assert ceiling["images_per_sec"] > 0
    shares = trainer["step_shares"]
    assert {"data_wait", "forward_backward", "optimizer"} <= shares.keys()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert trainer["seconds_to_first_step"] > 0
    assert trainer["allreduce_wait_share"] is not None
    first = trainer["first_epoch"]  # the cache filling and the decode check beside it
    assert first["images_per_sec"] > 0 and sum(first["step_shares"].values()) == pytest.approx(1)

    # The summary: one line per world size and source, the figures of the JSON.
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["world", "source"])
    assert (
        lines[header].split()
        == (
            "world source variant img/s ceiling trainer/ceiling data wait first epoch of bf16 peak"
        ).split()
    )
    assert lines[header + 2].split() == [
        "2", row["source"], "audit", "on", f"{trainer['images_per_sec']:.1f}",
        f"{ceiling['images_per_sec']:.1f}", f"{row['efficiency']:.3f}",
        f"{shares['data_wait']:.1%}",
        f"{first['images_per_sec'] / ceiling['images_per_sec']:.3f}", "n/a",
    ]  # fmt: skip

    assert ceiling["optimizer_kernels"] == ["fused"]  # the trainer's AdamW (fused on this torch)
    assert ceiling["batch_size"] == 4 and "tflops" not in ceiling  # FLOP/s: on CUDA only
    assert ceiling["first_step_seconds"] > 0
    assert ceiling["images_per_sec"] == pytest.approx(2 * 4 / ceiling["step_seconds"])

    decode = report["decode"]
    assert decode["images"] > 0 and decode["mean_kib"] > 0
    names = list(decode["rates"])
    assert names[0] == "cpu, 1 process" and names[1].startswith("cpu, ") and len(names) == 2
    assert all(r["images_per_sec"] > 0 for r in decode["rates"].values())
    assert f"JPEG decode ({decode['images']} files" in result.stdout

    policy = report["policy"]
    assert (policy["device"], policy["image_size"], policy["batch_size"]) == ("cpu", 16, 4)
    for name in ("trivialaugment", "randaugment"):
        assert policy[name]["per_image_ms"] > 0 and policy[name]["grouped_ms"] > 0
    at = lines.index("--auto_augment on a batch of 4 at 16 px (cpu), ms per batch")
    assert lines[at + 1].split()[:3] == ["trivialaugment", "per", "image"]


# ----------------------------------------------------------------------------- host_cost.py


@pytest.mark.slow
def test_host_cost_prints_a_row_per_source_and_policy(tmp_path: Path):
    """Every source and policy gets its row of host milliseconds per step on meta tensors,
    next to the GPU budget."""
    flags = ["--batch_size", "8", "--image_size", "32", "--short_side", "40", "--repeats", "1"]
    result = run_cli([BENCH / "host_cost.py", *flags, "--launch_us", "8"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Host cost per step on meta tensors" in out and "batch 8 at 32 px" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["ram"], ["gpu"], ["nvjpeg"])
    ]
    assert [(r[0], r[1]) for r in rows] == [
        (source, policy)
        for source in ("ram", "gpu", "nvjpeg")
        for policy in ("none", "trivialaugment", "randaugment")
    ]
    for row in rows:
        draws, augment, ops, step, step_ops, estimate = map(float, row[2:8])
        assert draws > 0 and augment > 0 and ops > 10 and step > 0 and step_ops > 100
        launches = (ops + step_ops) * 8 / 1000
        assert estimate == pytest.approx(launches, abs=0.02)  # the draws: in the workers
        assert row[-1] == "ms)" and row[-3] == "of"  # "(N% of 19 ms)"


# ----------------------------------------------------------------------------- gpu_check.py


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_gpu_check_without_cuda_measures_nothing_and_exits_0(tmp_path: Path):
    output = tmp_path / "gpu_check.json"
    result = run_cli([BENCH / "gpu_check.py", "--output", output], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["gpu_check: no CUDA device visible; nothing was measured"]
    assert not output.exists()


def test_gpu_checks_verdicts_fail_every_planted_fault_and_pass_the_clean_set(tmp_path: Path):
    """``gpu_check.py --self_test`` on any machine (no torch): its verdict code fed planted
    rows gives exit 0 for a set that meets every target and 1 for each planted fault."""
    result = run_cli([BENCH / "gpu_check.py", "--self_test"], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [line for line in result.stdout.splitlines() if line.startswith("self-test: ")]
    codes = [line.split(": exit ")[1][0] for line in cases if ": exit " in line]
    assert codes == ["0", "1", "1", "1", "1", "1", "1"] and "(ok)" in cases[0]
    assert all(line.endswith("(ok)") for line in cases[:-1]), cases
    assert cases[-1] == "self-test: 7 of 7 cases right"


# ----------------------------------------------------------------------------- recipes.py


def recipes(*args: object, cwd: Path):
    return run_cli([RECIPES, *args], cwd=cwd, timeout=120)


def listed(*args: object, cwd: Path) -> list[str]:
    """The rows ``recipes.py ARGS --list`` names, in order."""
    result = recipes(*args, "--list", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return [line[:38].rstrip() for line in result.stdout.splitlines()]


def test_recipes_lists_the_rows_asked_for_in_that_order(tmp_path: Path):
    every = listed(cwd=tmp_path)
    assert every[0] == "defaults" and "fine-tune recipe" in every and "timm train.py plain" in every
    # With --only, the rows named, in that order, scratch and fine-tuning together.
    only = ["--only", "fine-tune recipe,defaults", "--pretrained_path", "x.pth"]
    assert listed(*only, cwd=tmp_path) == ["fine-tune recipe", "defaults"]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--only", "defaults,fine-tune recipe"], "fine-tuning rows need --pretrained_path"),
        (["--only", "timm train.py plain"], "timm rows need --timm_train"),
        (["--only", "nope", "--list"], "unknown configuration(s) ['nope']"),
    ],
)
def test_recipes_refuses_rows_it_cannot_run(tmp_path: Path, args, error):
    result = recipes(*args, cwd=tmp_path)
    assert result.returncode == 2 and error in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# timm's train.py stand-in: the validation lines timm logs at each epoch's last batch, raw and
# EMA, their running averages depending on --seed.
FAKE_TIMM = """\
import sys
seed = int(sys.argv[sys.argv.index("--seed") + 1])
for top1 in (40.0 + seed, 50.0 + 2 * seed):
    print("Test: [   1/2]  Time: 0.1  Acc@1:  10.000 ( 10.000)")  # not the last batch
    print(f"Test: [   2/2]  Time: 0.1  Acc@1:  {top1:.3f} ( {top1:.3f})")
    print(f"Test (EMA): [   2/2]  Time: 0.1  Acc@1:  {top1 - 1:.3f} ( {top1 - 1:.3f})")
"""


@pytest.mark.slow
def test_recipes_runs_each_seed_in_its_own_folder_and_tables_mean_and_spread(tmp_path: Path):
    """Every row once per seed, into WORK/<row>/seed_<N>, the checkpoint given in place of
    PRETRAINED; timm's rows read from its log; the table's mean±std over the seeds; a row that
    failed (here: no images, the launcher stops at once) is listed as such."""
    for split in ("train", "val"):
        (tmp_path / "data" / split).mkdir(parents=True)
    (tmp_path / "timm_train.py").write_text(FAKE_TIMM)
    work, pretrained = tmp_path / "w", tmp_path / "pre.pth"
    result = recipes(
        "--data", tmp_path / "data", "--work", work, "--seeds", "3,4",
        "--only", "fine-tune recipe,timm train.py plain", "--pretrained_path", pretrained,
        "--timm_train", tmp_path / "timm_train.py", "--output", tmp_path / "recipes.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [
        shlex.split(line.strip()[2:])
        for line in result.stdout.splitlines()
        if line.startswith("  $ ")
    ]
    launched = [c for c in commands if c[1].endswith("launch_ddp.py")]
    assert [c[c.index("--seed") + 1] for c in launched] == ["3", "4"]
    for command, seed in zip(launched, (3, 4), strict=True):
        assert "PRETRAINED" not in command
        assert command[command.index("--pretrained_path") + 1] == str(pretrained)
        folder = command[command.index("--checkpoint_dir") + 1]
        assert folder == str(work / "fine_tune_recipe" / f"seed_{seed}" / "checkpoints")
    timm = [c for c in commands if c[1].endswith("timm_train.py")]
    assert [c[c.index("--seed") + 1] for c in timm] == ["3", "4"]

    lines = result.stdout.splitlines()
    tuned = next(line for line in lines if line.startswith("fine-tune recipe "))
    assert tuned.split()[2:6] == ["-", "-", "-", "-"]
    assert sum("failed: exit code 2" in line for line in lines) == 4  # 2 progress, 2 table
    # Best and final of seeds 3 and 4: 56 and 58 (raw), 55 and 57 (EMA).
    row = next(line for line in lines if line.startswith("timm train.py plain "))
    assert row.split()[3:7] == ["57.0±1.4", "57.0±1.4", "56.0±1.4", "56.0±1.4"]
    rows = json.loads((tmp_path / "recipes.json").read_text())["rows"]
    assert [(r["name"], r["seed"], r["status"][:6]) for r in rows] == [
        ("fine-tune recipe", 3, "failed"),
        ("fine-tune recipe", 4, "failed"),
        ("timm train.py plain", 3, "ok"),
        ("timm train.py plain", 4, "ok"),
    ]
    assert rows[2]["val_acc_per_epoch"] == [0.43, 0.56]
