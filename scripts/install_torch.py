"""Install a CPU build of torch into this Python (the set-up's first step; standard library only).

    python scripts/install_torch.py torch==2.13.0 [--cpu-index URL] [--dry-run]

First asks pip which wheel it would install for the requirement, as configured (index, find-links,
constraints), without installing anything. If that wheel is a CPU build (a `+cpu` local version,
or a wheel that requires no `nvidia-*`/`cuda-*` packages, as on macOS and Windows), it installs
that one. Otherwise (plain PyPI on Linux resolves torch to a CUDA build of about 0.5 GB that pulls
several GB of `nvidia-*` packages) it installs from PyTorch's CPU wheel index instead, which is
PyTorch's own instruction for CPU-only installs. `--cpu-index ""` turns the fallback off: pip's
own choice is then installed. `--dry-run` prints the decision and installs nothing.
"""
import argparse
import json
import re
import subprocess
import sys

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
CUDA_REQUIREMENT = re.compile(r"^\s*(nvidia-|cuda-)", re.IGNORECASE)


def resolve(spec: str) -> dict | None:
    """pip's report entry for the wheel it would install for `spec`, or None if pip can't tell."""
    cmd = PIP + ["install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--report", "-", spec]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr)
        print("install_torch: pip could not report its choice (see above; the report needs pip 22.2 or "
              "later); installing pip's own choice", file=sys.stderr)
        return None
    try:
        return json.loads(run.stdout)["install"][0]
    except (ValueError, KeyError, IndexError):
        return None


def needs_cpu_index(entry: dict) -> tuple[bool, str]:
    """Whether pip's chosen wheel is a CUDA build, and a line saying which wheel it is."""
    meta = entry.get("metadata", {})
    version = meta.get("version", "?")
    where = entry.get("download_info", {}).get("url", "?")
    cuda = [r for r in meta.get("requires_dist") or [] if CUDA_REQUIREMENT.match(r)]
    what = f"torch {version} from {where}"
    if version.endswith("+cpu") or not cuda:
        return False, what
    return True, f"{what} needs {', '.join(r.split(';')[0].strip() for r in cuda[:3])}, ..."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?", default="torch==2.13.0")
    ap.add_argument("--cpu-index", default="https://download.pytorch.org/whl/cpu",
                    help="index to install from when pip's own choice is a CUDA build ('' = never)")
    ap.add_argument("--dry-run", action="store_true", help="print the decision, install nothing")
    args = ap.parse_args()

    install = PIP + ["install", args.spec]
    entry = resolve(args.spec) if args.cpu_index else None
    if entry is not None:
        cuda, what = needs_cpu_index(entry)
        if cuda:
            print(f"install_torch: pip would install {what}; using the CPU build from {args.cpu_index}")
            install = PIP + ["install", "--index-url", args.cpu_index, args.spec]
        else:
            print(f"install_torch: {what} is a CPU build")
    print("pip " + " ".join(install[len(PIP):]))
    if args.dry_run:
        return 0
    rc = subprocess.call(install)
    if rc and "--index-url" in install:
        print(f"install_torch: could not install from {args.cpu_index}. Install the torch you want into this "
              "environment first (an installed torch is kept), or pass --cpu-index '' (make: TORCH_CPU_INDEX=) "
              "to install pip's own choice.", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
