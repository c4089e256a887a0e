"""Shared test setup. Kept free of framework imports: every rank of a job loads it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
