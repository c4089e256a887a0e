"""Service test job: check TF_CONFIG, form a MultiWorkerMirroredStrategy group and reduce across it."""

import json
import os
import socket
import sys

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
workers, index = config["cluster"]["worker"], config["task"]["index"]
if len(workers) != int(os.environ["PARALLEL_INSTANCES"]):
    sys.exit(f"TF_CONFIG has {len(workers)} workers, PARALLEL_INSTANCES={os.environ['PARALLEL_INSTANCES']}")
strategy = tf.distribute.MultiWorkerMirroredStrategy()
if strategy.num_replicas_in_sync != len(workers):
    sys.exit(f"{strategy.num_replicas_in_sync} replicas in sync, expected {len(workers)}")
value = strategy.run(lambda: tf.constant(float(index + 1)))
total = float(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None))
if total != len(workers) * (len(workers) + 1) / 2:
    sys.exit(f"reduce gave {total}")
from plait.progress import report  # noqa: E402

report(step=1, loss=0.1)
print(f"tf worker {index}/{len(workers)} sum={total:g} on {socket.gethostname()}", flush=True)
