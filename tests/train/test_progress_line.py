"""The job's progress line: each line's loss and samples/s come from the metrics windows that
closed since the line before, so no two lines repeat a window's figures."""

from __future__ import annotations

from dataclasses import dataclass

from kfac_hpc.train.progress import Progress


@dataclass
class _Job:
    rank: int = 0
    steps_per_epoch: int = 11  # digits at batch 128: windows (20 steps) span two epochs
    total_steps: int = 55


def _window(step: int, loss: float, rate: float, steps: int = 20) -> dict[str, float]:
    return {"step": step, "window_steps": steps, "loss": loss, "samples_per_s": rate,
            "step_s": 128 / rate}  # fmt: skip


def _lines(capsys, events) -> list[str]:
    progress = Progress(_Job(), enabled=True)
    for event in events:
        if event[0] == "window":
            progress.window(event[1], _window(*event[1:]))
        else:
            progress.epoch(event[1], 0.5, float(event[1]))
    return capsys.readouterr().out.splitlines()


def test_windows_longer_than_an_epoch_are_not_shown_twice(capsys):
    lines = _lines(
        capsys,
        [("epoch", 11), ("window", 20, 1.5, 1000.0), ("epoch", 22), ("epoch", 33),
         ("window", 40, 1.0, 2000.0), ("epoch", 44), ("epoch", 55)],
    )  # fmt: skip
    assert [line.split(" acc ")[0].split(" loss ")[1] for line in lines] == [
        "-",
        "1.5000",
        "-",
        "1.0000",
        "-",
    ]
    assert [line.split(" samples/s")[0].rsplit(" ", 1)[1] for line in lines] == [
        "-",
        "1000",
        "-",
        "2000",
        "-",
    ]


def test_several_windows_in_an_epoch_are_weighted_by_steps_and_seconds(capsys):
    # 10 steps at loss 2 and 1,000 samples/s, then 30 at loss 1 and 3,000 samples/s
    (line,) = _lines(
        capsys,
        [("window", 10, 2.0, 1000.0, 10), ("window", 40, 1.0, 3000.0, 30), ("epoch", 40)],
    )
    # loss (2 * 10 + 1 * 30) / 40 = 1.25; samples (1.28 s * 1,000 + 1.28 s * 3,000) / 2.56 s
    assert " loss 1.2500 " in line and " 2000 samples/s " in line, line


def test_other_ranks_print_nothing(capsys):
    progress = Progress(_Job(rank=1), enabled=True)
    progress.window(20, _window(20, 1.0, 1000.0))
    progress.epoch(22, 0.5, 1.0)
    assert capsys.readouterr().out == ""
