"""The optimizer tests run tiny models: one thread avoids oversubscribing a shared machine,
where torch's spinning worker threads make small ops many times slower."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
