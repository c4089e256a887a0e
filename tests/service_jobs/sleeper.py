"""Service test job: report progress, then sleep (to be cancelled, or to hold slots).

Args: SECONDS (default 600) and an optional marker word that shows in ``ps`` (argv).
"""

import sys
import time

from plait.progress import report

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 600.0
report(step=1, loss=1.0)
print("sleeping", seconds, flush=True)
time.sleep(seconds)
print("slept", flush=True)
