"""Service test job: PARALLEL_INSTANCES=1 is a plain run: no group variables, but the job's own ones."""

import json
import os
import sys

from plait.progress import report

group = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TF_CONFIG", "PLAIT_SVC_RANK") if k in os.environ]
if [k for k in group if k != "PLAIT_SVC_RANK"]:
    sys.exit(f"a plain run got group variables {group}")
params = json.loads(os.environ["PLAIT_PARAMETERS"])
if params.get("lr") != "0.1" or os.environ["PLAIT_DATASET"] != "digits":
    sys.exit(f"parameters {params}, dataset {os.environ['PLAIT_DATASET']!r}")
report(step=10, epoch=2, loss=0.05, accuracy=0.97)
print("plain run ok", sys.argv[1:], flush=True)
