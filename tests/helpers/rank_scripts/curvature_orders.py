"""Started as 2 real ranks by tests/train/test_curvature_orders.py: training rank 0 sends no
order for longer than the process group's timeout while rank 1 (a curvature rank) waits in
``receive_order``.

``alive``: rank 0 calls ``OrderSender.tick`` every 20 ms of a quiet spell of QUIET_S seconds
(2.5 timeouts), then sends ``FINISH``; rank 1 receives until ``FINISH`` and reports the orders
it got. ``silent``: the same spell without ticks and without ``FINISH``; rank 1 reports whether
its receive failed (the control: without ``ALIVE`` the wait ends with the timeout). Nothing is
timed: each rank prints one record.
"""

from __future__ import annotations

import sys
import time

from kfac_hpc.runtime import init_distributed
from kfac_hpc.train.curvature_ranks import Order, OrderSender, receive_order
from tests.helpers.rank_checks import emit, leave_job, main_or_leave

TIMEOUT_S = 6.0  # the process group's, so every wait for an order is bounded by it
QUIET_S = 2.5 * TIMEOUT_S


def main() -> None:
    mode = sys.argv[1]
    ctx = init_distributed("gloo", timeout_s=TIMEOUT_S)
    record: dict[str, object] = {"rank": ctx.rank, "world_size": ctx.world_size, "mode": mode}
    if ctx.rank == 0:
        sender = OrderSender(1, 1, TIMEOUT_S)
        end = time.monotonic() + QUIET_S
        while time.monotonic() < end:
            if mode == "alive":
                sender.tick(step=7)
            time.sleep(0.02)
        if mode == "alive":
            sender.send(Order.FINISH, 7)
            for work, _ in sender.works:
                work.wait()
    else:
        kinds: list[str] = []
        try:
            while not kinds or kinds[-1] != Order.FINISH.name:
                kinds.append(receive_order()[0].name)
            record["failed"] = None
        except RuntimeError as exc:
            record["failed"] = str(exc).splitlines()[0][:200]
        record["orders"] = kinds
    emit(record)
    leave_job(0)  # no shutdown: in `silent` rank 1 left the group when its wait failed


if __name__ == "__main__":
    main_or_leave(main)
