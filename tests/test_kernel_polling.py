"""`scripts/kernel_polling.py`, the workaround the chapters' runs use for jupyter/nbclient#312: a kernel
channel's `get_msg(timeout)` polls at most a second at a time, and still means what it meant (a message
when one comes, `queue.Empty` once the whole timeout has passed): on a stand-in channel whose polls are
counted, then on a real ipykernel."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty

import pytest
from script_loader import load_script


def load_polling():
    return load_script("kernel_polling", "kernel_polling_under_test")


def test_a_wait_is_cut_into_polls_of_at_most_a_second(monkeypatch):
    polling = load_polling()
    monkeypatch.setattr(polling, "POLL_S", 0.05)
    polls, arrives_at = [], None

    async def poll(channel, timeout):  # a channel's get_msg: a message once it has arrived, else Empty
        polls.append(timeout)
        await asyncio.sleep(timeout)
        if arrives_at is not None and time.monotonic() >= arrives_at:
            return "the reply"
        raise Empty

    get_msg = polling.in_slices(poll)
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(get_msg(None, timeout=0.125))
    assert time.monotonic() - start >= 0.125 - 0.01  # the whole timeout, not only the first poll
    assert len(polls) == 3 and max(polls) <= 0.05 and polls[-1] == pytest.approx(0.025, abs=0.01), polls

    polls.clear()
    arrives_at = time.monotonic() + 0.12
    assert asyncio.run(get_msg(None, timeout=None)) == "the reply"  # no limit: polls until it comes
    assert len(polls) >= 3 and max(polls) == 0.05


def test_a_real_kernel_channel_still_answers_and_times_out():
    pytest.importorskip("ipykernel")
    channels = pytest.importorskip("jupyter_client.channels")
    from jupyter_client import AsyncKernelManager

    polling = load_polling()
    polling.poll_in_slices()
    polling.poll_in_slices()  # a second call changes nothing
    assert channels.AsyncZMQSocketChannel.get_msg.polls_in_slices

    async def main():
        km = AsyncKernelManager(kernel_name="python3")
        await km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
            start = time.monotonic()
            with pytest.raises(Empty):
                await kc.shell_channel.get_msg(timeout=2.5)
            assert time.monotonic() - start >= 2.5 - 0.05
            msg_id = kc.execute("1 + 1")
            reply = await kc.shell_channel.get_msg(timeout=None)
            assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_a_pytest_run_of_one_chapter_alone_polls_in_slices(tmp_path):
    """`pytest --nbmake notebooks/NN_*.ipynb`, with no test of tests/ collected, gets the polling too: the
    repository's root conftest.py applies it (tests/conftest.py is not loaded for a notebook path)."""
    pytest.importorskip("nbmake")
    pytest.importorskip("jupyter_client.channels")
    root = Path(__file__).resolve().parents[1]
    chapter = sorted((root / "notebooks").glob("01_*.ipynb"))[0]
    seen = tmp_path / "seen.txt"
    (tmp_path / "report_polling.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    from jupyter_client.channels import AsyncZMQSocketChannel\n"
        f"    open({str(seen)!r}, 'w').write(str(getattr(AsyncZMQSocketChannel.get_msg, 'polls_in_slices', False)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "report_polling", str(chapter.relative_to(root))],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert seen.read_text() == "True"
