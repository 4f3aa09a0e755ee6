"""Test-wide settings: offline transformers, and one torch thread per pytest worker.

`make test` runs two xdist workers on the two cores; more threads per worker only oversubscribe
the machine (tiny ops then take milliseconds instead of microseconds).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch
except ImportError:  # the torch-free parts can still be tested
    torch = None

if torch is not None:
    torch.set_num_threads(1)
