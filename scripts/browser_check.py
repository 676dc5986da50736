"""Browser smoke test of a chapter's widgets in JupyterLab: what a reader sees, checked in a real browser.

Run it by hand before committing a change to a chapter's widgets; it is not part of pytest or CI.
Set-up, once (Debian or Ubuntu; selenium in its own environment, JupyterLab from the project's .venv):

    sudo apt-get install -y chromium chromium-driver
    python3 -m venv .venv-browser && .venv-browser/bin/pip install selenium

Then:

    .venv-browser/bin/python scripts/browser_check.py [--chapter 01] [--out /tmp/browser_check_01.png]

It starts JupyterLab (`.venv/bin/python -m jupyterlab`) on 127.0.0.1 with a token and its own settings
(autosave off, so the chapter on disk is never rewritten), opens the chapter in headless Chromium and
checks, in this order:

1. opened without running: every widget output is drawn from the state saved in the notebook (not as
   `VBox(children=...)` text), and the tab is not marked modified. JupyterLab draws saved widgets only in
   a trusted notebook, so the check first trusts the chapter in a throwaway trust database, as a reader
   does with `jupyter trust notebooks/NN_*.ipynb` (`--untrusted` skips that, to see the untrusted view);
2. Run All (JupyterLab's `notebook:run-all-cells` command): every code cell runs, none fails;
3. the chapter's first control (a text box, slider, dropdown, checkbox or button; `--control N` for
   another) is operated, and what its widget shows besides the control must change (chapter 01: the
   tokens of the typed text are drawn). A chapter with no control skips this step;

and writes screenshots: `--out` after step 3, and `<out>_opened.png` after step 1. It exits non-zero
with a message saying which check failed, and always stops JupyterLab and its kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium, chromium-driver
# Headless and offline: without these Chromium tries to reach Google's services and, with no network, hangs.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]
TYPED_TEXT = "Paged attention keeps each sequence's KV cache in fixed-size blocks."
# JupyterLab settings for the check: no autosave (the chapter must stay as committed), every cell in the
# DOM (windowing would leave cells out of view unrendered), no news or update checks (no network).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class CheckFailed(Exception):
    pass


# -- JupyterLab ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_env(tmp: Path) -> dict:
    """Jupyter's settings, workspaces, runtime files and trust database under `tmp`: nothing of the user's
    is read or changed (the chapter is trusted in a throwaway database, as `jupyter trust` would)."""
    settings = tmp / "lab-settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / (plugin + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
                JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_DATA_DIR=str(tmp / "data"),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def trust(path: Path, env: dict) -> None:
    """Sign the chapter in `env`'s trust database. JupyterLab draws saved widget state only in a trusted
    notebook; in an untrusted one it shows each widget's text form, `VBox(children=...)` (Jupyter's
    notebook security: outputs saved by someone else are not trusted until `jupyter trust` or the
    command palette's "Trust Notebook" says so)."""
    r = subprocess.run([str(ROOT / ".venv" / "bin" / "jupyter-trust"), str(path)], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise CheckFailed(f"jupyter trust {path} failed:\n{r.stdout}{r.stderr}")


def start_lab(env: dict, port: int, token: str, log_path: Path) -> subprocess.Popen:
    """JupyterLab from the project's .venv on 127.0.0.1, serving the repository."""
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True",  # window.jupyterapp
           "--LabApp.news_url=None"] + (["--allow-root"] if os.geteuid() == 0 else [])  # e.g. in a container
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_lab(lab: subprocess.Popen, url: str, token: str, log_path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.poll() is not None:
            raise CheckFailed(f"JupyterLab exited ({lab.returncode}) on start:\n{log_path.read_text()[-3000:]}")
        try:
            req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise CheckFailed(f"JupyterLab did not answer at {url} within {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop_lab(lab: subprocess.Popen, url: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels); then SIGTERM, then SIGKILL, its process group."""
    if lab.poll() is None:
        try:
            req = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=10).close()
            lab.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if lab.poll() is not None:
            return
        os.killpg(lab.pid, sig)
        try:
            lab.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass


# -- the browser -----------------------------------------------------------------------------------

def start_browser(tmp: Path, chromium: str, chromedriver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp / 'chromium-profile'}"]:
        options.add_argument(flag)
    # an explicit driver: selenium's own driver manager would try to download one
    return webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)


def js(driver, script: str, *args):
    """Run `script` (a function body; `panel` is the open notebook's NotebookPanel) in the page."""
    return driver.execute_script("const panel = window.jupyterapp.shell.currentWidget;\n" + script, *args)


def wait_until(what: str, fn, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(interval)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def open_chapter(driver, url: str, token: str, rel_path: str, timeout: float) -> None:
    driver.get(f"{url}/lab/tree/{rel_path}?reset&token={token}")  # ?reset: no workspace restored
    wait_until("JupyterLab to open the chapter", lambda: driver.execute_script(
        "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        "return !!(w && w.context && w.context.path === arguments[0] && w.context.isReady);", rel_path), timeout)
    wait_until("the kernel to be idle", lambda: kernel_idle(driver), timeout)


def kernel_idle(driver) -> bool:
    return js(driver, "const k = panel.sessionContext.session && panel.sessionContext.session.kernel;"
                      "return !!k && k.status === 'idle';")


# What each cell that holds widget outputs shows: how many outputs of its model are widget views, how
# many of its top-level output nodes draw a widget, and its text (for the message when they differ).
WIDGET_CELLS_JS = """
const rows = [];
panel.content.widgets.forEach((cell, index) => {
  if (cell.model.type !== 'code') return;
  const views = cell.model.outputs.toJSON().filter(o => o.data && o.data[arguments[0]]).length;
  if (!views) return;
  const nodes = [...cell.outputArea.node.querySelectorAll(':scope > .jp-OutputArea-child > .jp-OutputArea-output')];
  const drawn = nodes.filter(n => n.querySelector('.jupyter-widgets') && !/Error displaying widget/.test(n.innerText));
  rows.push({index, views, drawn: drawn.length, text: cell.outputArea.node.innerText.slice(0, 300)});
});
return rows;
"""


def check_saved_widgets(driver, timeout: float) -> list[dict]:
    """Step 1: the widgets are drawn from the saved state, and the chapter is not marked modified."""
    def all_drawn():
        rows = js(driver, WIDGET_CELLS_JS, WIDGET_VIEW)
        return rows if all(r["drawn"] >= r["views"] for r in rows) else None

    try:
        rows = wait_until("the saved widgets to be drawn", all_drawn, timeout)
    except CheckFailed:
        bad = [r for r in js(driver, WIDGET_CELLS_JS, WIDGET_VIEW) if r["drawn"] < r["views"]]
        raise CheckFailed("opened without running, widget outputs are not drawn from the saved state "
                          "(re-run scripts/run_notebooks.py on the chapter?):\n" +
                          "\n".join(f"  cell {r['index']}: {r['drawn']}/{r['views']} drawn, shows: {r['text']!r}"
                                    for r in bad)) from None
    time.sleep(3)  # JupyterLab rewrites a kernelspec or language_info it disagrees with right after connecting
    dirty = js(driver, "return [panel.context.model.dirty, "
                       "!!document.querySelector('#jp-main-dock-panel .lm-TabBar-tab.jp-mod-dirty')];")
    if any(dirty):
        raise CheckFailed("opened without running, the chapter is marked modified (model dirty, tab dirty: "
                          f"{dirty}); is its metadata.kernelspec the one scripts/run_notebooks.py writes?")
    return rows


def run_all(driver, timeout: float) -> None:
    """Step 2: Run All, then wait until every code cell has run and the kernel is idle."""
    js(driver, "window.jupyterapp.commands.execute('notebook:run-all-cells');")
    progress = """
    const cells = panel.content.widgets.filter(c => c.model.type === 'code');
    const prompts = cells.map(c => c.node.querySelector('.jp-InputPrompt').innerText.trim());
    const errors = cells.map((c, i) => c.model.outputs.toJSON().some(o => o.output_type === 'error') ? i : -1)
                        .filter(i => i >= 0);
    return {prompts, errors};
    """
    time.sleep(2)
    def finished():
        state = js(driver, progress)
        busy = any("*" in p for p in state["prompts"])
        return state if state["errors"] or (not busy and kernel_idle(driver)) else None

    state = wait_until("Run All to finish", finished, timeout, interval=2)
    if state["errors"]:
        raise CheckFailed(f"Run All: code cells {state['errors']} (counting code cells from 0) raised an error")
    not_run = [i for i, p in enumerate(state["prompts"]) if not any(ch.isdigit() for ch in p)]
    if not_run:
        raise CheckFailed(f"Run All: code cells {not_run} did not run (prompts {state['prompts']})")


# The controls a reader can operate (ipywidgets 8: sliders are noUiSlider handles), in document order.
CONTROLS = ('.jupyter-widgets input[type="text"], .jupyter-widgets textarea, .jupyter-widgets .noUi-handle, '
            '.jupyter-widgets select, .jupyter-widgets input[type="checkbox"], button.jupyter-button')
# The chapter's control number arguments[1] (from 0), marked; and the top-level output holding it.
FIND_CONTROL_JS = """
const control = panel.content.node.querySelectorAll(arguments[0])[arguments[1]];
if (!control) return null;
(control.closest('.widget-inline-hbox, .widget-button') || control).setAttribute('data-browser-check', 'control');
return [control, control.closest('.jp-OutputArea-output')];
"""
# What the widget shows besides the control itself (whose own readout changes with it): its Output
# areas, HTML panes, plots, sibling widgets.
SHOWN_JS = """
const copy = arguments[0].cloneNode(true);
copy.querySelectorAll('[data-browser-check="control"]').forEach(e => e.remove());
return copy.innerHTML;
"""


def operate_widget(driver, text: str, index: int, timeout: float) -> str | None:
    """Step 3: operate the chapter's control number `index` (text box: type `text`; slider: three steps
    right; dropdown: the next option; checkbox, button: click); what its widget shows must then change.
    None if the chapter has no such control."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    found = js(driver, FIND_CONTROL_JS, CONTROLS, index)
    if not found:
        return None
    control, top = found
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", control)
    shown = lambda: driver.execute_script(SHOWN_JS, top)  # noqa: E731
    before = shown()
    tag, kind, classes = control.tag_name, control.get_attribute("type"), control.get_attribute("class") or ""
    if tag == "select":
        menu = Select(control)
        menu.select_by_index((int(menu.first_selected_option.get_attribute("index")) + 1) % len(menu.options))
        action = f"dropdown set to {menu.first_selected_option.text!r}"
    elif "noUi-handle" in classes:
        control.click()
        for _ in range(3):
            control.send_keys(Keys.ARROW_RIGHT)
        action = "slider moved three steps right"
    elif tag == "button" or kind == "checkbox":
        control.click()
        action = f"clicked {control.text or control.get_attribute('title') or tag!r}"
    else:
        control.click()
        control.send_keys(Keys.CONTROL, "a")
        control.send_keys(text)
        action = f"typed {text!r}"
    wait_until(f"the widget's output to change ({action})", lambda: shown() != before, timeout)
    last = [None]

    def settled():  # unchanged since the last look (each keystroke may redraw) and the kernel idle
        now = shown()
        done, last[0] = now == last[0] and kernel_idle(driver), now
        return done

    wait_until("the widget's output to settle", settled, timeout, interval=1.5)
    if "Traceback" in top.text:
        raise CheckFailed(f"after {action}, the widget shows an error:\n{top.text[-1500:]}")
    return action


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", nargs="?", default=None, help="chapter number (default 01) or notebook path")
    parser.add_argument("--chapter", dest="chapter_opt", metavar="NN", default=None, help="the same, as an option")
    parser.add_argument("--out", default=None, help="screenshot path (default /tmp/browser_check_NN.png)")
    parser.add_argument("--text", default=TYPED_TEXT, help="what to type into a text box")
    parser.add_argument("--control", type=int, default=0,
                        help="which control to operate, counted from 0 in the chapter's order (default 0)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for Run All (default 900)")
    parser.add_argument("--untrusted", action="store_true",
                        help="do not trust the chapter first (step 1 then fails: widgets show as text)")
    parser.add_argument("--chromium", default=CHROMIUM)
    parser.add_argument("--chromedriver", default=CHROMEDRIVER)
    args = parser.parse_args()
    chapter = args.chapter_opt or args.chapter or "01"
    if chapter.endswith(".ipynb"):
        path = (Path.cwd() / chapter).resolve()
    else:
        matches = sorted((ROOT / "notebooks").glob(f"{int(chapter):02d}_*.ipynb"))
        if not matches:
            print(f"browser_check: no chapter {chapter} in notebooks/", file=sys.stderr)
            return 2
        path = matches[0]
    number = path.name[:2]
    out = Path(args.out or f"/tmp/browser_check_{number}.png")
    opened_out = out.with_name(out.stem + "_opened" + out.suffix)
    for tool in (args.chromium, args.chromedriver, ROOT / ".venv" / "bin" / "python"):
        if not Path(tool).exists():
            print(f"browser_check: {tool} not found (see the set-up in this script's docstring)", file=sys.stderr)
            return 2
    rel_path = path.relative_to(ROOT).as_posix()
    original = path.read_bytes()
    port, token = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="browser-check-") as tmp_name:
        tmp = Path(tmp_name)
        log_path = tmp / "jupyterlab.log"
        env, lab, driver = lab_env(tmp), None, None
        try:
            if not args.untrusted:
                trust(path, env)
            lab = start_lab(env, port, token, log_path)
            wait_for_lab(lab, url, token, log_path)
            driver = start_browser(tmp, args.chromium, args.chromedriver)
            print(f"{rel_path}: JupyterLab at {url}, opening the chapter")
            open_chapter(driver, url, token, rel_path, timeout=180)
            rows = check_saved_widgets(driver, timeout=60)
            if rows:
                js(driver, "panel.content.widgets[arguments[0]].outputArea.node.scrollIntoView({block: 'center'});",
                   rows[0]["index"])
            driver.save_screenshot(str(opened_out))
            print(f"1. opened without running: {sum(r['views'] for r in rows)} widget outputs in {len(rows)} cells "
                  f"drawn from the saved state; not marked modified (screenshot {opened_out})")
            t0 = time.monotonic()
            run_all(driver, args.timeout)
            print(f"2. Run All: every code cell ran, no errors ({time.monotonic() - t0:.0f} s)")
            action = operate_widget(driver, args.text, args.control, timeout=120)
            driver.save_screenshot(str(out))
            if action is None:
                print(f"3. no control (text box, slider, dropdown, checkbox, button) number {args.control} in the "
                      f"chapter: nothing operated (screenshot {out})")
            else:
                print(f"3. {action}: what the widget shows changed (screenshot {out})")
        except CheckFailed as e:
            if driver is not None:
                driver.save_screenshot(str(out))
            print(f"browser_check FAILED on {rel_path}: {e}\n(screenshot of the page: {out})", file=sys.stderr)
            return 1
        finally:
            if driver is not None:
                driver.quit()
            if lab is not None:
                stop_lab(lab, url, token)
            if path.read_bytes() != original:  # autosave is off: this would be a bug of this script
                path.write_bytes(original)
                print(f"browser_check: JupyterLab rewrote {rel_path}; restored as it was", file=sys.stderr)
    print(f"browser_check: {rel_path} OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
