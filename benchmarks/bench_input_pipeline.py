"""The input pipeline: an ImageNet-layout folder of JPEGs read with 0, 1 and 2 worker
processes (``--data-workers``) against the step's own time.

    .venv/bin/python benchmarks/bench_input_pipeline.py [--rounds 3] [--check]

A generated folder (3 classes of 320x256 JPEGs; nothing downloaded) is read by the job's
``imagefolder`` dataset (Pillow decodes, resizes to 256 and crops 224) through the job's
``ShardedBatches``, as the job's step reads it: per step after the first (which starts the
workers) the time the step waits for its batch
(the ``data`` phase), then a forward and backward of the small CNN on it (the compute). Per
worker count it reports the samples/s of the reader alone (no compute) and, with compute, the
``data`` phase as a fraction of the step. Targets: with 2 workers the ``data`` phase is at most
5 % of the step (the workers keep up), and with 0 workers the reader alone is what the step
waits for (reported, no target). JSON in benchmarks/results/bench_input_pipeline.json.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py, beside this script

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.data import ShardedBatches, imagefolder
from kfac_hpc.train.workloads import FactoryContext, build_model

IMAGES_PER_CLASS, CLASSES, BATCH, STEPS = 48, 3, 16, 8
WORKERS = (0, 1, 2)
DATA_SHARE = 0.05  # the data phase's share of the step when the workers keep up


def make_folder(root: Path) -> None:
    """``root/{train,val}/cK/*.jpg``: smooth random images (JPEG-sized like photos)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", IMAGES_PER_CLASS), ("val", 4)):
        for k in range(CLASSES):
            folder = root / split / f"c{k}"
            folder.mkdir(parents=True)
            for i in range(count):
                small = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
                image = Image.fromarray(small).resize((320, 256), Image.Resampling.BICUBIC)
                image.save(folder / f"{i}.jpg", quality=90)


def measure(root: Path, workers: int, compute: bool) -> dict[str, float]:
    """One pass of STEPS steps: the seconds waited for data, and of compute, per step."""
    config = TrainConfig(dataset="imagefolder", data_path=str(root), model="small_cnn")
    source = imagefolder(FactoryContext(config, {}, 0, 1, root))
    batches = ShardedBatches(source, BATCH, 0, 1, seed=0, augment=False, workers=workers)
    torch.manual_seed(0)
    model = build_model(config, source.shape, source.num_classes)
    waited = computed = 0.0
    for step in range(STEPS + 1):  # step 0 fills the pipeline (starts the workers): not timed
        start = time.perf_counter()
        x, y = batches.batch(0, step)
        middle = time.perf_counter()
        if compute:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if step > 0:
            waited += middle - start
            computed += time.perf_counter() - middle
    return {"data_s": waited / STEPS, "compute_s": computed / STEPS}


def main() -> int:
    args = harness.parser(__doc__, rounds=3).parse_args()
    bench = harness.Benchmark("bench_input_pipeline")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_folder(root)
        variants: dict[str, Any] = {}
        for workers in WORKERS:
            variants[f"read_{workers}"] = lambda _r, w=workers: measure(root, w, compute=False)
            variants[f"step_{workers}"] = lambda _r, w=workers: measure(root, w, compute=True)
        measured = harness.interleave(variants, args.rounds, warmup=1)
    results: dict[str, Any] = {"batch": BATCH, "steps": STEPS, "threads": 1}
    print(f"imagefolder, batch {BATCH}, {STEPS} steps per pass, {args.rounds} rounds, 1 thread")
    print("workers  reader samples/s          data phase / step (with compute)")
    for workers in WORKERS:
        rates = [BATCH / m["data_s"] for m in measured[f"read_{workers}"]]
        shares = [m["data_s"] / (m["data_s"] + m["compute_s"]) for m in measured[f"step_{workers}"]]
        rate, share = harness.Stats.of(rates), harness.Stats.of(shares)
        results[f"workers_{workers}"] = {
            "reader_samples_per_s": rate,
            "data_share": share,
            "step_s": harness.Stats.of(
                [m["data_s"] + m["compute_s"] for m in measured[f"step_{workers}"]]
            ),
        }
        print(f"{workers:>7}  {rate:.1f}  {share:.3f}")
    bench.target(
        "data phase / step, 2 workers",
        results["workers_2"]["data_share"].median,
        DATA_SHARE,
        "<=",
        note="the workers keep up: the step waits for no decoding",
    )
    return bench.finish(results, check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())
