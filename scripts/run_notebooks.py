"""Execute chapter notebooks in place (outputs and figures saved), one after another.

    python scripts/run_notebooks.py notebooks/01_sequences.ipynb [...]

Readers who open a chapter on GitHub or in Jupyter see what it printed and drew; the test suite
executes the same notebooks again with nbmake (outputs there are not saved). The widgets' state is
saved too (so JupyterLab and static viewers draw the controls, not `VBox(children=...)`), and the
kernelspec is the one JupyterLab writes, so a freshly opened chapter is not marked modified. A tqdm bar
counts each chapter's code cells and names the one running, so a slow or stuck cell shows which it is.
"""
import argparse
import time

import nbformat
import zmq
from nbclient import NotebookClient
from tqdm import tqdm
from traitlets.config import Config

from kernel_polling import poll_in_slices

# What JupyterLab writes for ipykernel's python3 kernel; any other display_name it rewrites on
# opening, and the chapter shows as modified before the reader has touched it.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# Encrypt the kernel's local TCP connection (CurveZMQ keys made by the kernel manager) where pyzmq
# and jupyter_client can; otherwise ipykernel warns, once per notebook, that it runs unencrypted.
# A jupyter_client without this setting ignores it.
config = Config()
if zmq.has("curve"):
    config.KernelManager.transport_encryption = "auto"

poll_in_slices()  # a cell that shows widgets no longer waits out the cell timeout (see kernel_polling)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("notebooks", nargs="+", help="the chapters to execute, in this order")
for path in parser.parse_args().notebooks:
    t0 = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)  # the state of this run only, not a stale one from the last
    with tqdm(total=sum(c.cell_type == "code" for c in nb.cells), desc=path, unit="cell") as bar:
        def started(cell, cell_index, **_):  # nbclient's hooks, called with keywords
            bar.set_postfix_str(f"cell {cell_index} ({cell.get('id', '?')})")

        def executed(cell, cell_index, **_):
            bar.update(1)

        NotebookClient(nb, timeout=900, kernel_name=KERNELSPEC["name"], config=config, store_widget_state=True,
                       resources={"metadata": {"path": "notebooks"}}, on_cell_start=started,
                       on_cell_executed=executed).execute()
    nb.metadata.kernelspec = dict(KERNELSPEC)
    nbformat.write(nb, path)
    print(f"{path}: {time.perf_counter() - t0:.1f} s")
