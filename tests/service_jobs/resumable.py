"""Service test job: the first attempt saves a checkpoint and fails; a relaunch resumes from it.

The checkpoint lives in PLAIT_OUTPUT_DIR, which the service keeps across attempts; PLAIT_RESTART counts them.
"""

import json
import os
import sys

from plait.progress import report

path = os.path.join(os.environ["PLAIT_OUTPUT_DIR"], "checkpoint.json")
attempt = int(os.environ["PLAIT_RESTART"])
if attempt == 0:
    with open(path, "w") as f:
        json.dump({"step": 5}, f)
    report(step=5)
    sys.exit("attempt 0 fails after its checkpoint at step 5")
with open(path) as f:
    step = json.load(f)["step"]
report(step=step + 5)
print(f"attempt {attempt} resumed at step {step}", flush=True)
