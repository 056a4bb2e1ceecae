"""mla-diff runner protocol, version 1, for the runners here: the runner SDK `mla_diff.runner`
(python/mla_diff/runner.py; docs/runners.md), importable from a plain checkout.

`python3 runners/X.py` needs no installed package: this module puts the checkout's python/ first on
sys.path (before an installed mla_diff, so the runners always speak this checkout's protocol) and
re-exports the SDK: `protocol.serve(...)`, `protocol.Unsupported`, the codecs, `protocol.main(Cls)`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from mla_diff.runner import *  # noqa: E402,F401,F403
from mla_diff.runner import PROTOCOL, METADATA  # noqa: E402,F401
