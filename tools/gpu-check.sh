#!/usr/bin/env bash
# The GPU checks, in under 5 minutes on one GPU: K-FAC on CUDA against CPU float64, a 1-rank
# NCCL training run with checkpoint and resume, CUDA-event phase timings, AMP (GradScaler and
# bfloat16), pinned input batches, and doctor's 1-rank NCCL allreduce. On a machine without
# CUDA every test skips and says why. Needs a CUDA build of torch in the venv (the dev venv's
# CPU wheel has no CUDA: install the matching torch from the PyTorch index on the GPU machine).
#
#   bash tools/gpu-check.sh            # extra arguments go to pytest
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
py="${PYTHON:-$top/.venv/bin/python}"
export PATH="$(dirname "$py"):$PATH"
"$py" - <<'PY'
import torch
if torch.cuda.is_available():
    print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
else:
    print(f"gpu-check: torch {torch.__version__} sees no CUDA device; the tests will skip")
PY
timeout 300 "$py" -m pytest tests/gpu -v -rs -p no:cacheprovider --timeout 240 "$@"
