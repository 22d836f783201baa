"""The real-framework matrix (issue 13): each framework's own loop, unchanged, under
``tp.profile`` (and under ``%%tp_profile`` in a real shell or kernel), checked against known
truth: sleeps of known length per phase, the framework's own logged loss and step counter,
its end state, and every hook gone afterwards.

Assertions state what tpkit *should* report. Those it gets wrong today are
``xfail(strict=True)`` with the reason: fixing tpkit turns them into XPASS, which fails, so
the marker comes off with the fix.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import truth` from every test file here

# The frameworks announce themselves loudly on import and per run; none of it is tested here.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", module=r"lightning\..*")
warnings.filterwarnings("ignore", module=r"transformers\..*")


@pytest.fixture(autouse=True)
def _torch_one_thread(one_thread):
    """Every test here compares times with known sleeps (see ``one_thread``)."""
    yield
