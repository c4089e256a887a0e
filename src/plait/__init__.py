"""plait: distributed training for PyTorch and TensorFlow/Keras over Horovod or MPI.

``import plait`` imports no framework, no mpi4py and no horovod; they are
imported when a communicator or adapter needs them. ``plait.compression``
(compressors and error-feedback memories) is reachable after ``import plait``, and
:func:`plait.run` runs a function on every rank of a new job (Horovod's ``horovod.run``).
"""

from . import compression
from .checkpoint import Checkpoint, CheckpointError
from .config import BACKENDS, Config
from .errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    ConfigError,
    MismatchError,
    PlaitError,
    PlaitTypeError,
)
from .launch.call import run
from .parallel.mesh import Mesh
from .parallel.pipeline import Pipeline
from .parallel.tensor import ChannelSplit, Colwise, Rowwise, TensorParallel, VocabParallel
from .protocols import Communicator, Handle, TensorOps
from .runtime import init, is_initialized, shutdown, world
from .strategy import DataParallel

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "ChannelSplit",
    "Checkpoint",
    "CheckpointError",
    "Colwise",
    "CollectiveTimeoutError",
    "Communicator",
    "Config",
    "DataParallel",
    "ConfigError",
    "Handle",
    "Mesh",
    "MismatchError",
    "Pipeline",
    "PlaitError",
    "PlaitTypeError",
    "Rowwise",
    "TensorOps",
    "TensorParallel",
    "VocabParallel",
    "__version__",
    "compression",
    "init",
    "is_initialized",
    "run",
    "shutdown",
    "world",
]
