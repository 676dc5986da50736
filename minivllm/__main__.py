"""`python -m minivllm ...`: see minivllm/cli.py (exported from notebooks/02_model.ipynb)."""
import sys

from minivllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
