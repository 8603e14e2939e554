"""One thread: the FOSI tests run tiny models on a shared machine."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
