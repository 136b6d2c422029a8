"""Shared test setup: numpy beside XLA must not spawn its own threads (tail spikes)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_models.py
