"""`scripts/kernel_polling.py`, the workaround the chapters' runs use for jupyter/nbclient#312: a kernel
channel's `get_msg(timeout)` polls a second at a time, and still means what it meant (a message when one
comes, `queue.Empty` once the whole timeout has passed). Tested on a real ipykernel."""
from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from queue import Empty

import pytest

pytest.importorskip("ipykernel")
channels = pytest.importorskip("jupyter_client.channels")


def load_polling():
    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_polling.py"
    spec = importlib.util.spec_from_file_location("kernel_polling_under_test", path)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def test_get_msg_polls_in_slices_and_keeps_its_meaning():
    from jupyter_client import AsyncKernelManager

    polling = load_polling()
    polling.poll_in_slices()
    polling.poll_in_slices()  # a second call changes nothing
    patched = channels.AsyncZMQSocketChannel.get_msg
    assert patched.polls_in_slices and patched.__closure__ is not None

    async def main():
        km = AsyncKernelManager(kernel_name="python3")
        await km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
            timeout = 2.5 * polling.POLL_S  # three polls
            start = time.monotonic()
            with pytest.raises(Empty):
                await kc.shell_channel.get_msg(timeout=timeout)
            assert time.monotonic() - start >= timeout - 0.05  # the whole timeout, not only the first poll
            msg_id = kc.execute("1 + 1")
            reply = await kc.shell_channel.get_msg(timeout=None)
            assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(main())
