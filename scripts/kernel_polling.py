"""A workaround for jupyter/nbclient#312, used by `scripts/run_notebooks.py` and by every pytest run of
the chapters (nbmake; the repository's root conftest.py applies it): a kernel client waits for messages
in polls of at most `POLL_S` seconds.

One long poll on a kernel's channel sometimes misses the reply to a cell that shows widgets: nbclient
then sleeps out the whole cell timeout (15 minutes in `run_notebooks.py`, 5 under nbmake) before it
finds the reply waiting, and the chapter looks stuck meanwhile. A new poll finds a waiting message at
once, so polling again every second bounds the cost of a missed one.
"""
from __future__ import annotations

import time
from queue import Empty

POLL_S = 1.0  # the longest one poll may sleep before it looks again


def in_slices(get_msg):
    """`get_msg(channel, timeout)` (an asynchronous channel's method) as polls of at most `POLL_S`: the same
    meaning (a message when one comes, `queue.Empty` once `timeout` has passed; None: no limit)."""

    async def get_msg_in_slices(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(self, timeout=POLL_S if left is None else min(POLL_S, left))
            except Empty:
                if left is not None and left <= POLL_S:  # that was the last poll the timeout allows
                    raise

    get_msg_in_slices.polls_in_slices = True
    return get_msg_in_slices


def poll_in_slices() -> None:
    """Make every asynchronous kernel channel's `get_msg` poll in slices (`in_slices`). Idempotent; a
    jupyter_client without asynchronous channels (before 7.0) is left as it is."""
    try:
        from jupyter_client.channels import AsyncZMQSocketChannel
    except ImportError:
        return
    if not getattr(AsyncZMQSocketChannel.get_msg, "polls_in_slices", False):
        AsyncZMQSocketChannel.get_msg = in_slices(AsyncZMQSocketChannel.get_msg)
