"""``python -m fused_norm.build``: compile the C++ fast path ahead of use (fast_path.py).

python -m fused_norm.build            # where CUDA is available; about a minute
python -m fused_norm.build --force    # also without a GPU (to check that it compiles)
"""

import argparse
import sys

import torch

from . import fast_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build fused_norm's C++ fast path.")
    ap.add_argument("--force", action="store_true", help="compile even without a GPU")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() or args.force):
        print("fused_norm: the C++ fast path serves CUDA tensors only: not built here (no GPU); "
              "the Python path serves every call")  # fmt: skip
        return 0
    print(f"fused_norm: building the C++ fast path into {fast_path.library_path().parent} "
          "(about a minute)", flush=True)  # fmt: skip
    fast_path.build()
    print(f"fused_norm fast path: built; {fast_path.why()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
