"""tensorgate: a production inference server for PyTorch-trained models."""

import time

__version__ = "0.1.0"

PROCESS_STARTED = time.perf_counter()
"""When the server's code began importing: start-up time is measured from here."""
