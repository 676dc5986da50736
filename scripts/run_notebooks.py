"""Execute chapter notebooks in place (outputs and figures saved), one after another.

    python scripts/run_notebooks.py notebooks/01_sequences.ipynb [...]

Readers who open a chapter on GitHub or in Jupyter see what it printed and drew; the test suite
executes the same notebooks again with nbmake (outputs there are not saved).
"""
import sys
import time

import nbformat
import zmq
from nbclient import NotebookClient
from traitlets.config import Config

# Encrypt the kernel's local TCP connection (CurveZMQ keys made by the kernel manager) where pyzmq
# and jupyter_client can; otherwise ipykernel warns, once per notebook, that it runs unencrypted.
# A jupyter_client without this setting ignores it.
config = Config()
if zmq.has("curve"):
    config.KernelManager.transport_encryption = "auto"

for path in sys.argv[1:]:
    t0 = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", config=config,
                   resources={"metadata": {"path": "notebooks"}}).execute()
    nbformat.write(nb, path)
    print(f"{path}: {time.perf_counter() - t0:.1f} s")
