"""The `mla-diff` command of the wheel: the carried binary (mla_diff/bin/mla-diff, the program as the
repository builds it, with its allocator and `--gpus` workers) when present, else the same program
in this process through the native module."""

import os
import sys


def binary():
    """Path of the carried `mla-diff` binary, or None (a source checkout)."""
    p = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "mla-diff")
    return p if os.access(p, os.X_OK) else None


def main():
    exe = binary()
    if exe is not None:
        os.execv(exe, [exe] + sys.argv[1:])
    from mla_diff import _native

    sys.exit(_native.main(["mla-diff"] + sys.argv[1:]))
