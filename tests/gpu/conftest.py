"""The GPU tests (tools/gpu-check.sh): they need CUDA and skip with the reason without it."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = (
    "no CUDA device (torch.cuda.is_available() is False): run bash tools/gpu-check.sh on a "
    "machine with an NVIDIA GPU and a CUDA build of torch"
)


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device("cuda", 0)
