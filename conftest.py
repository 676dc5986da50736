"""Loaded by every pytest run in this repository, `pytest --nbmake notebooks/NN_*.ipynb` on its own included:
the chapters' runs (nbmake, in this process) wait for kernel replies in polls of a second
(`scripts/kernel_polling.py`): one long poll sometimes misses the reply to a widget cell and sleeps out
nbmake's 5-minute cell timeout (jupyter/nbclient#312)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_POLLING = Path(__file__).resolve().parent / "scripts" / "kernel_polling.py"
if _POLLING.exists() and importlib.util.find_spec("jupyter_client") is not None:
    _spec = importlib.util.spec_from_file_location("kernel_polling", _POLLING)
    _spec.loader.exec_module(_polling := importlib.util.module_from_spec(_spec))
    _polling.poll_in_slices()
