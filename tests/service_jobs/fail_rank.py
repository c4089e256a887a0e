"""Service test job (framework 'none'): rank 1 fails at once with status 3, rank 0 would sleep for ever."""

import os
import sys
import time

if os.environ["RANK"] == "1":
    print("rank 1 fails", flush=True)
    sys.exit(3)
time.sleep(600)
