"""``python -m fused_norm.build``: compile the C++ fast path ahead of use (fast_path.py)."""

import sys

from .fast_path import main

if __name__ == "__main__":
    sys.exit(main(["--build", *sys.argv[1:]]))
