"""TensorFlow / Keras 3 adapter: the only plait module that imports tensorflow.

Eager tensors and variables are read through numpy; inside ``tf.function`` a
host collective runs through ``tf.numpy_function``. Keras 3 variables (which are
not ``tf.Variable``) are unwrapped through their ``.value``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from plait.errors import ConfigError, MismatchError, PlaitTypeError

from .numpy import BYTE_BITS
from .topk import sample_size, seeded_topk

__all__ = ["OPS", "TFConfigError", "TFMismatchError", "TFOps", "bracketed", "collective_function",
           "executing_eagerly", "graph_position", "host_view", "tf_errors", "unwrap"]

_TO_NAME = {
    tf.float16: "float16", tf.bfloat16: "bfloat16", tf.float32: "float32",
    tf.float64: "float64", tf.int8: "int8", tf.uint8: "uint8", tf.int16: "int16",
    tf.uint16: "uint16", tf.int32: "int32", tf.int64: "int64", tf.bool: "bool",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


def tf_dtype(name: str) -> tf.DType:
    """Map a canonical dtype name to ``tf.DType``."""
    return _FROM_NAME[name]


_HOST_OPS: dict[str, Callable[..., Any]] = {"sum": tf.add, "average": tf.add, "min": tf.minimum,
                                            "max": tf.maximum, "product": tf.multiply}
#: :meth:`TFOps.zero_at` masks when more than one element in this many is zeroed.
_MASK_FROM = 256
#: :meth:`TFOps.scatter` merges positions on the host from this many output elements.
_MERGE_FROM = 1 << 16


def _merged(indices: Any, values: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Eager ``(indices, values)`` as distinct increasing positions with the values at
    equal positions summed in their order (as ``tf.scatter_nd`` adds them); None for
    values that are not float32/float64."""
    if values.dtype not in (tf.float32, tf.float64) or "GPU" in values.device:
        return None
    idx = host_view(tf.cast(indices, tf.int64))
    vals = host_view(values)
    if idx.size > 1 and not bool((idx[1:] > idx[:-1]).all()):
        order = np.argsort(idx, kind="stable")  # a few sorted runs (one per rank): a merge
        idx, vals = idx[order], vals[order]
        starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
        if starts.size < idx.size:
            idx, vals = idx[starts], np.add.reduceat(vals, starts)
    return idx, vals


def _mutable(x: Any) -> bool:
    """Whether ``x`` is a non-empty eager host tensor (not a variable) that :func:`host_view`
    can show (not bfloat16, not symbolic, not on a GPU)."""
    return (tf.executing_eagerly() and isinstance(x, tf.Tensor) and not tf.is_symbolic_tensor(x)
            and x.dtype in (tf.float16, tf.float32, tf.float64) and "GPU" not in x.device
            and bool(x.shape.num_elements()))


class _DLPack:
    """An eager tensor offered to ``np.from_dlpack`` (``EagerTensor.numpy()`` copies)."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def __dlpack__(self, **_: Any) -> Any:
        return tf.experimental.dlpack.to_dlpack(self._tensor)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def _writable(tensor: Any) -> np.ndarray:
    """:func:`host_view`, writable: only for a tensor its caller made and nobody else sees
    (TensorFlow takes its tensors to be immutable)."""
    view = host_view(tensor)
    raw = (ctypes.c_char * view.nbytes).from_address(view.ctypes.data)
    return np.ctypeslib.as_array(raw).view(view.dtype).reshape(view.shape)


def host_view(tensor: Any) -> np.ndarray:
    """A read-only numpy view of an eager host tensor's memory, without a copy (10.5M
    float32: ``.numpy()`` copies in 6 ms here).

    Args:
        tensor: an eager TensorFlow tensor on the CPU (not bfloat16).

    Returns:
        The view; it keeps the tensor's buffer alive.
    """
    return np.from_dlpack(_DLPack(tensor))


def unwrap(x: Any) -> Any:
    """Return the TensorFlow value behind a Keras 3 variable (or ``x`` itself)."""
    if type(x).__module__.startswith("keras") and hasattr(x, "value"):
        return x.value
    return x


class TFOps:
    """:class:`~plait.protocols.TensorOps` for TensorFlow tensors and (Keras) variables."""

    framework = "tensorflow"

    def owns(self, x: Any) -> bool:
        return isinstance(unwrap(x), (tf.Tensor, tf.Variable))

    def dtype_name(self, x: Any) -> str:
        dt = tf.as_dtype(unwrap(x).dtype).base_dtype  # a TF1 RefVariable's is float32_ref
        try:
            return _TO_NAME[dt]
        except KeyError:
            raise PlaitTypeError(
                f"unsupported TensorFlow dtype {dt.name}: expected one of {sorted(_FROM_NAME)}"
            ) from None

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(int(d) if d is not None else -1 for d in unwrap(x).shape)

    def is_symbolic(self, x: Any) -> bool:
        """True inside a graph being built, also for an eager tensor captured there (a
        collective on it must run with the graph, not once while tracing)."""
        if not tf.executing_eagerly():
            return True
        return bool(tf.is_symbolic_tensor(unwrap(x)))

    def to_numpy(self, x: Any) -> np.ndarray:
        a = np.ascontiguousarray(unwrap(x).numpy())
        return a.view(np.uint16) if a.dtype.name == "bfloat16" else a

    def from_numpy(self, a: np.ndarray, like: Any) -> tf.Tensor:
        dt = tf.as_dtype(unwrap(like).dtype)
        if dt == tf.bfloat16 and a.dtype == np.uint16:
            import ml_dtypes

            a = a.view(ml_dtypes.bfloat16)
        return tf.convert_to_tensor(a, dtype=dt)

    def host_call(
        self, fn: Callable[..., Any], inputs: Sequence[Any], like: Any, same_shape: bool = True
    ) -> tf.Tensor:
        """Run ``fn`` on the numpy values of ``inputs`` as a host op of the graph being built.

        When ``fn`` has a ``bind`` method (an :class:`~plait.collectives.graph_order.OrderedCall`),
        it gets the op's key: the op's position among the collective host ops of the
        outermost graph being built, and that graph's name (see :func:`graph_position`),
        and whether the graph runs such ops in the order they were built.
        In a TF1 ``tf.Graph`` such ops also run in the order they were built (each has a
        control dependency on the previous one): a session runs independent ops in several
        threads, and host ops that block in different collectives on different ranks would
        hold every thread. A graph has a chain per communicator and group of inputs that a
        ``session.run`` feeds (see :func:`_chain`): a dependency on an op fed by other
        inputs would make a ``session.run`` of this op need their feeds (Horovod's
        ``tensorflow_word2vec.py`` builds its variables' broadcast after a training op fed
        by placeholders, and runs it alone) or run their collectives too (a broadcast built
        before the training op, once per step). In a ``tf.function`` each such op also takes a token output by
        the previous one (a data edge): the automatic control dependencies between stateful
        ops alone did not hold, as Grappler's dependency optimizer removed one that looked
        redundant (a path through a ``tf.custom_gradient``'s ``IdentityN``) before another
        pass cut that path, and the ranks' backward collectives then overlapped forward ones.
        """
        like = unwrap(like)
        bind = getattr(fn, "bind", None)
        position = graph_position() if bind is not None else None
        graph = tf.compat.v1.get_default_graph()
        chained = position is not None and not getattr(graph, "building_function", False)
        values = [unwrap(i) for i in inputs]
        chain = _chain(graph, values, getattr(fn, "group", None)) if chained else None
        previous = chain[2] if chain is not None else None
        token = _LAST_TOKEN.get(graph) if position is not None and not chained else None

        def host(*args: Any) -> Any:  # a disagreement is TensorFlow's error, as in Horovod
            with tf_errors():
                return fn(*args[: len(values)])  # without the token

        with tf.control_dependencies([previous] if previous is not None else []):
            if chained:  # a TF1 graph: a disagreement raises FailedPreconditionError
                out, failed = tf.numpy_function(_reporting(host, like.dtype), values,
                                                Tout=[like.dtype, tf.int32], stateful=True)
            elif position is not None:  # a tf.function: pass a token on to the next host op
                out, _LAST_TOKEN[graph] = tf.numpy_function(
                    _tokened(host), values + ([token] if token is not None else []),
                    Tout=[like.dtype, tf.int32], stateful=True)
            else:
                out = tf.numpy_function(host, values, Tout=like.dtype, stateful=True)
        op = out.op
        if chain is not None:
            chain[2] = op
            out = tf.cond(tf.equal(failed, 0), lambda: tf.identity(out),
                          lambda: _failed_precondition(out))
        if bind is not None and position is not None:
            from plait.collectives.graph_order import graph_key

            # built in order: a TF1 graph's chain, or a tf.function's automatic control
            # dependencies (stateful ops run in program order); not a TF1 cond branch
            in_order = chained or position[2]
            bind(graph_key(*position[:2]), f"{position[0]}/{op.name}", in_order)
        if same_shape:
            out.set_shape(like.shape)
        else:
            out.set_shape([None] + list(like.shape[1:]))
        return out

    # -- math -----------------------------------------------------------------
    def cast(self, x: Any, dtype: str) -> tf.Tensor:
        return tf.cast(unwrap(x), _FROM_NAME[dtype])

    def reshape(self, x: Any, shape: Sequence[int]) -> tf.Tensor:
        return tf.reshape(unwrap(x), tuple(shape))

    def zeros(self, shape: Sequence[int], dtype: str, like: Any) -> tf.Tensor:
        return tf.zeros(tuple(shape), dtype=_FROM_NAME[dtype])

    def abs(self, x: Any) -> tf.Tensor:
        return tf.abs(unwrap(x))

    def sign(self, x: Any) -> tf.Tensor:
        return tf.sign(unwrap(x))

    def norm(self, x: Any) -> tf.Tensor:
        return tf.norm(tf.reshape(unwrap(x), [-1]))

    def topk(self, x: Any, k: int, magnitude: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
        flat = tf.reshape(unwrap(x), [-1])
        if _mutable(flat) and sample_size(int(flat.shape[0]), k) is not None:
            # an eager host tensor: the sampled selection in numpy (positions in order)
            found = seeded_topk(host_view(flat), k, magnitude)
            if found is not None:
                return tf.constant(found[0]), tf.constant(found[1])
        _, indices = tf.math.top_k(tf.abs(flat) if magnitude else flat, k=k, sorted=False)
        return tf.gather(flat, indices), tf.cast(indices, tf.int64)

    def gather(self, x: Any, indices: Any) -> tf.Tensor:
        return tf.gather(tf.reshape(unwrap(x), [-1]), indices)

    def scatter(self, indices: Any, values: Any, size: int) -> tf.Tensor:
        values = tf.convert_to_tensor(values)
        merged = _merged(indices, values) if size >= _MERGE_FROM and tf.executing_eagerly() else None
        if merged is None:
            idx = tf.reshape(tf.cast(indices, tf.int64), [-1, 1])
            return tf.scatter_nd(idx, values, tf.constant([size], dtype=tf.int64))
        # distinct positions: SparseToDense writes them (1.7 ms for 105K of 10.5M float32
        # here, where scatter_nd's locked adds took 18 ms), into one new tensor
        return tf.raw_ops.SparseToDense(
            sparse_indices=tf.reshape(tf.constant(merged[0]), [-1, 1]), output_shape=[size],
            sparse_values=tf.constant(merged[1]), default_value=tf.zeros((), values.dtype),
            validate_indices=False)

    def add_into(self, acc: Any, x: Any, a: float = 1.0, b: float = 1.0, own: bool = False) -> tf.Tensor:
        acc, x = unwrap(acc), unwrap(x)
        if own and _mutable(acc) and _mutable(x) and acc.dtype in (tf.float32, tf.float64) \
                and x.dtype == acc.dtype and acc.shape == x.shape:
            # through host views: no new tensor (10.5M float32: 3 ms, 6-10 in a training step)
            view, other = _writable(acc), host_view(x)
            if not np.may_share_memory(view, other):
                if a != 1.0:
                    np.multiply(view, a, out=view)
                if b == -1.0:
                    np.subtract(view, other, out=view)
                else:
                    np.add(view, other if b == 1.0 else other * b, out=view)
                return acc
        scaled = acc if a == 1.0 else acc * a
        if b == -1.0:  # one op, not two: x * -1 is exact, so this is the same sum
            return scaled - x
        return scaled + (x if b == 1.0 else x * b)

    def zero_at(self, x: Any, indices: Any, inplace: bool = False) -> tf.Tensor:
        flat = tf.reshape(unwrap(x), [-1])
        if inplace and _mutable(flat):
            # the caller's own new tensor that nobody else sees (an error-feedback memory's
            # compensated gradient): zeroed through a host view, 0.5 ms instead of a new
            # tensor's 11 ms for 105K of 10.5M float32 here
            _writable(flat)[host_view(tf.cast(indices, tf.int64))] = 0
            return flat
        idx = tf.reshape(tf.cast(indices, tf.int64), [-1, 1])
        if _MASK_FROM * int(idx.shape[0] or 0) > int(flat.shape[0] or 0) > 0:
            # many positions: a mask and a select (8.8 ms for 105K of 10.5M float32 here)
            # beat tensor_scatter_nd_update's one update at a time (18 ms)
            mask = tf.raw_ops.SparseToDense(sparse_indices=idx, output_shape=tf.shape(flat, tf.int64),
                                            sparse_values=True, default_value=False,
                                            validate_indices=False)
            return tf.where(mask, tf.zeros((), flat.dtype), flat)
        return tf.tensor_scatter_nd_update(flat, idx, tf.zeros(tf.shape(idx)[:1], flat.dtype))

    def host_reduce(self, op: str, dtype: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
        """``fn(out, a, b)``: ``out = a (op) b`` on numpy host buffers of float16 with
        TensorFlow's vectorised kernels, for the MPI backend's ring (numpy's float16
        arithmetic converts element by element: 2M elements 16 ms, here 1.4 ms, bitwise
        the same); None for other dtypes, where numpy is as fast.

        Args:
            op: "sum" (also for "average"), "min", "max" or "product".
            dtype: the buffers' plait dtype name.
        """
        fn = _HOST_OPS.get(op)
        if fn is None or dtype != "float16":
            return None

        def reduce(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
            out[...] = host_view(fn(tf.constant(a), tf.constant(b)))
        return reduce

    def host_divide(self, dtype: str) -> Callable[[np.ndarray, int], None] | None:
        """``fn(out, n)``: ``out /= n`` in place on a numpy host buffer of float16 (see
        :meth:`host_reduce`); None for other dtypes."""
        if dtype != "float16":
            return None

        def divide(out: np.ndarray, n: int) -> None:
            out[...] = host_view(tf.constant(out) / tf.constant(n, tf.float16))
        return divide

    def matmul(self, a: Any, b: Any) -> tf.Tensor:
        return tf.matmul(unwrap(a), unwrap(b))

    def qr(self, x: Any) -> tf.Tensor:
        q, _ = tf.linalg.qr(unwrap(x))
        return q

    def concat(self, xs: Sequence[Any], axis: int = 0) -> tf.Tensor:
        return tf.concat([unwrap(x) for x in xs], axis=axis)

    def split(self, x: Any, sizes: Sequence[int], axis: int = 0) -> list[tf.Tensor]:
        return list(tf.split(unwrap(x), list(sizes), axis=axis))

    def uniform(self, shape: Sequence[int], seed: int, like: Any) -> tf.Tensor:
        pair = tf.constant([int(seed) & 0x7FFFFFFF, (int(seed) >> 31) & 0x7FFFFFFF], dtype=tf.int64)
        return tf.random.stateless_uniform(tuple(shape), seed=pair, dtype=tf.float32)

    def random_round(self, x: Any, scale: Any, seed: int, code: str) -> tf.Tensor:
        flat = tf.reshape(unwrap(x), [-1])
        u = tf.cast(self.uniform(self.shape(flat), seed, flat), flat.dtype)
        s = tf.cast(tf.reshape(unwrap(scale), []), flat.dtype)
        return tf.cast(tf.floor(tf.abs(flat) * s + u) * tf.sign(flat), _FROM_NAME[code])

    def floor(self, x: Any) -> tf.Tensor:
        return tf.floor(unwrap(x))

    def sum(self, x: Any) -> tf.Tensor:
        return tf.reduce_sum(unwrap(x))

    def amax(self, x: Any) -> tf.Tensor:
        return tf.reduce_max(unwrap(x))

    def clamp_min(self, x: Any, value: float) -> tf.Tensor:
        x = unwrap(x)
        return tf.maximum(x, tf.constant(value, dtype=x.dtype))

    def transpose(self, x: Any) -> tf.Tensor:
        return tf.transpose(unwrap(x))

    def nonzero(self, x: Any) -> tf.Tensor:
        return tf.reshape(tf.where(tf.reshape(unwrap(x), [-1])), [-1])

    def packbits(self, bits: Any) -> tf.Tensor:
        flat = tf.cast(tf.reshape(unwrap(bits), [-1]), tf.uint8)
        wide = tf.reshape(tf.pad(flat, [[0, (-int(flat.shape[0])) % 8]]), [-1, 8])
        out = tf.bitwise.left_shift(wide[:, 0], 7)
        for i in range(1, 8):
            out = tf.bitwise.bitwise_or(out, tf.bitwise.left_shift(wide[:, i], 7 - i))
        return out

    def unpackbits(self, packed: Any, count: int) -> tf.Tensor:
        shifts = tf.constant([7, 6, 5, 4, 3, 2, 1, 0], dtype=tf.uint8)
        bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.reshape(unwrap(packed), [-1, 1]), shifts), 1)
        return tf.cast(tf.reshape(bits, [-1])[:count], tf.bool)

    def decode_bits(self, packed: Any, count: int, one: Any, zero: Any, dtype: str) -> tf.Tensor:
        table = tf.where(BYTE_BITS, tf.cast(unwrap(one), dtype), tf.cast(unwrap(zero), dtype))
        return tf.reshape(tf.gather(table, tf.cast(tf.reshape(unwrap(packed), [-1]), tf.int32)), [-1])[:count]


_POSITIONS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: per TF1 graph, its chains of host ops: [communicator, fed inputs they depend on, last op]
_LAST_OP: weakref.WeakKeyDictionary[Any, list[list[Any]]] = weakref.WeakKeyDictionary()
_LAST_TOKEN: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: op types whose values a ``session.run`` feeds, or takes from a stream (each run advances it)
_FED = ("Placeholder", "PlaceholderWithDefault", "IteratorGetNext", "IteratorGetNextSync",
        "QueueDequeueV2", "QueueDequeueManyV2", "QueueDequeueUpToV2", "QueueDequeue",
        "QueueDequeueMany", "QueueDequeueUpTo", "ReaderReadV2", "ReaderRead")


def _chain(graph: Any, inputs: Sequence[Any], group: object) -> list[Any]:
    """The chain of host ops of the TF1 ``graph`` that a host op on ``inputs`` joins: of
    the chains of its communicator ``group`` (a chain across communicators would run one
    group's collective on the ranks of another), the latest that depends on one of the fed
    inputs it depends on (:func:`_fed_by`; one training step's ops share its placeholders
    or iterator), or with none, the chain of ops that depend on none (a variables'
    broadcast); a new chain otherwise. The inputs it depends on join the chain's.

    Args:
        graph: the TF1 graph being built.
        inputs: the host op's symbolic inputs.
        group: its communicator.

    Returns:
        ``[group, fed inputs, last op or None]``, the last op set by the caller.
    """
    fed = _fed_by(inputs)
    chains = _LAST_OP.setdefault(graph, [])
    for chain in reversed(chains):
        if chain[0] is group and ((chain[1] & fed) or (not chain[1] and not fed)):
            chain[1] = chain[1] | fed
            return chain
    chains.append([group, fed, None])
    return chains[-1]


def _fed_by(tensors: Sequence[Any]) -> frozenset[str]:
    """The names of the ops of a TF1 graph that ``tensors`` depend on (through inputs or
    control dependencies) and that a ``session.run`` feeds or reads from a stream:
    placeholders, iterators' ``get_next``, queues' dequeues, readers (:data:`_FED`).

    Args:
        tensors: symbolic tensors of the graph being built.

    Returns:
        Their op names (empty for tensors computed from variables and constants only).
    """
    found: set[str] = set()
    seen: set[str] = set()
    stack = [t.op for t in tensors if hasattr(t, "op")]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _FED:
            found.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return frozenset(found)


def _tokened(host: Callable[..., Any]) -> Callable[..., Any]:
    """``host`` returning ``(result, token)``: the token, an int32 scalar, is an input of
    the next host op of the same ``tf.function`` (see :meth:`TFOps.host_call`)."""

    def run(*args: Any) -> Any:
        return host(*args), np.int32(0)

    return run


class _Remade:
    """Pickles a plait TensorFlow error as TensorFlow's own code remakes one:
    ``(node_def, op, message, error_code)`` (its inherited ``__reduce__`` reads the names of
    ``__init__``'s arguments)."""

    node_def: Any
    op: Any
    message: str
    error_code: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.__class__, (self.node_def, self.op, self.message, self.error_code)


class TFMismatchError(_Remade, MismatchError, tf.errors.FailedPreconditionError):
    """A :class:`~plait.errors.MismatchError` that is also TensorFlow's
    ``FailedPreconditionError``, the error Horovod's TensorFlow ops raise when ranks
    disagree (so ``except tf.errors.FailedPreconditionError`` written for Horovod works)."""

    def __init__(self, *args: Any) -> None:
        tf.errors.FailedPreconditionError.__init__(self, *_op_error_args(args))


class TFConfigError(_Remade, ConfigError, tf.errors.InvalidArgumentError):
    """A :class:`~plait.errors.ConfigError` that is also TensorFlow's
    ``InvalidArgumentError``, the error Horovod's TensorFlow ops raise for bad
    arguments (e.g. ``alltoall`` splits that do not fit the tensor)."""

    def __init__(self, *args: Any) -> None:
        tf.errors.InvalidArgumentError.__init__(self, *_op_error_args(args))


def _op_error_args(args: tuple[Any, ...]) -> tuple[Any, Any, str]:
    """``(node_def, op, message)`` for a TensorFlow error made as ``(message)`` by plait, or
    as ``(node_def, op, message, error_code)`` by TensorFlow's own code: Keras re-raises
    an op error with its frames filtered that way, and unpickling remakes one so."""
    if len(args) == 1:
        return None, None, args[0]
    if len(args) in (3, 4):
        return args[0], args[1], args[2]
    raise TypeError(f"a TensorFlow error takes (message) or (node_def, op, message[, error_code]), "
                    f"got {len(args)} arguments")


@contextlib.contextmanager
def tf_errors() -> Iterator[None]:
    """Raise a :class:`TFMismatchError` for a :class:`~plait.errors.MismatchError`, and a
    :class:`TFConfigError` for a :class:`~plait.errors.ConfigError`."""
    try:
        yield
    except (TFMismatchError, TFConfigError):
        raise
    except MismatchError as exc:
        raise TFMismatchError(str(exc)) from exc
    except ConfigError as exc:
        raise TFConfigError(str(exc)) from exc


#: Read when ranks disagree inside a TF1 graph: this variable never exists, and TensorFlow
#: raises FailedPreconditionError naming it (the full report goes to stderr first).
_DISAGREE = "plait_ranks_called_different_collectives__each_rank_printed_its_call_on_stderr"


def _reporting(host: Callable[..., Any], dtype: Any) -> Callable[..., Any]:
    """``host`` returning ``(result, 0)``, or, when the ranks disagree, ``(zeros, 1)``
    after printing the disagreement (a Python error inside a graph is only ever
    TensorFlow's UnknownError; Horovod's ops raise FailedPreconditionError)."""

    def run(*args: Any) -> Any:
        try:
            return host(*args), np.int32(0)
        except TFMismatchError as exc:
            print(f"plait: {exc}", file=sys.stderr, flush=True)
            shape = np.shape(args[0]) if args else ()
            return np.zeros(shape, dtype=dtype.as_numpy_dtype), np.int32(1)

    return run


def _failed_precondition(out: tf.Tensor) -> tf.Tensor:
    """``out``, after reading a variable that does not exist: FailedPreconditionError."""
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=_DISAGREE)
    read = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)
    return tf.where(tf.equal(read, 0), out, out)  # a data dependency: it runs


def is_legacy_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TF1 ``tf.compat.v1.train.Optimizer``."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


def executing_eagerly() -> bool:
    """Whether TensorFlow executes eagerly here (False while a graph is built)."""
    return bool(tf.executing_eagerly())


def graph_position() -> tuple[str, int, bool] | None:
    """Name of the outermost graph being built, the number of collective host ops
    built in it so far (then counts this one), and whether that graph is a
    ``tf.function``; None when executing eagerly.

    Equal on every rank that builds the same graphs: names of ``tf.function`` graphs
    are their Python function's name (nested ``tf.cond``/``while`` graphs count in their
    outermost graph, whose name does not depend on process-wide counters); a TF1
    ``tf.Graph`` is ``"graph"``.
    """
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "building_function", False):  # a FuncGraph: look for its outermost
        outer = getattr(graph, "outer_graph", None)
        if outer is None or not getattr(outer, "building_function", False):
            break
        graph = outer
    index = _POSITIONS.get(graph, 0)
    _POSITIONS[graph] = index + 1
    function = bool(getattr(graph, "building_function", False))
    return str(getattr(graph, "name", None) or "graph"), index, function


def graph_anchor() -> tf.Variable | None:
    """A scalar variable on the CPU for :func:`bracketed`'s ``anchor``. Make it eagerly,
    before tracing (a ``tf.function`` refuses variables made in a later trace).

    Returns:
        The variable, or None where TensorFlow does not run eagerly.
    """
    with tf.init_scope():
        if not tf.executing_eagerly():
            return None
        with tf.device("/CPU:0"):
            return tf.Variable(0, trainable=False, name="plait_anchor")


def bracketed(build: Callable[[Any], Any], inputs: Any, before: Callable[[], None],
              after: Callable[[], None], anchor: tf.Variable | None = None) -> Any:
    """Build ops on ``inputs`` into the graph being built, between two host calls: each time
    the graph runs, ``before()`` runs once the first tensor of ``inputs`` is computed and
    before any op ``build`` made starts, and ``after()`` once all their outputs are
    computed (not when one of them failed).

    Inside a ``tf.function``, ``before`` is a stateless host op that waits for the first
    input (one element of it) and whose output (that input's shape) reshapes the input
    that ``build`` gets (no copy): so the ops wait for it, and it is not one of the
    stateful ops a ``tf.function`` runs in program order.
    Were it stateful, each op's ``before`` would wait for the previous op's ``after``, that
    is for the previous op to end: 40 Horovod allreduces in a ``tf.function`` took 2.2 ms
    each on the Horovod backend (one coordinator cycle each) against 54 us in Horovod. It
    also reads ``anchor``, so that Grappler cannot fold it into a constant when the inputs
    are constants (it would run once, while the graph is optimised); without an anchor it
    is stateful. ``after`` is stateful, so it runs (and with it the ops) even when nothing
    uses their outputs. (A TensorFlow 1 graph has no such ordering: there ``before`` is
    stateful.)

    Inside a ``tf.function`` the outputs do not wait for ``after()``: the function runs
    every stateful op before it returns (and a loop's next iteration waits for this
    one's), so ``after()`` still runs, beside whatever consumes the outputs instead of
    before it (``dp_step.py``'s TensorFlow MLP on the Horovod backend: 0.7-1.1 ms less of a
    24-25 ms step in 5 of 6 jobs). In a TensorFlow 1 graph only what is fetched runs, so
    there the outputs wait for it.

    Args:
        build: makes the ops from (the rewired) ``inputs``; returns their outputs (a
            tensor or a nest of them).
        inputs: a tensor, or a list of tensors (the first one is rewired).
        before: the host call before them.
        after: the host call after them.
        anchor: from :func:`graph_anchor`.

    Returns:
        ``build()``'s outputs (in a TensorFlow 1 graph, each computed once ``after()``
        returned).
    """
    def arm(_probe: np.ndarray, shape: np.ndarray, *_: np.ndarray) -> np.ndarray:
        before()
        return shape

    def disarm() -> np.ndarray:
        after()
        return np.zeros((), np.int32)

    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]
    free = anchor is not None and tf.inside_function()
    extra = [anchor.read_value()] if free and anchor is not None else []
    # the host call gets one element of the first input (it waits for it; a GPU tensor is
    # not copied to the host whole) and its shape
    probe = tf.reshape(flat[0], [-1])[:1]
    shape = tf.numpy_function(arm, [probe, tf.shape(flat[0], out_type=tf.int64), *extra],
                              Tout=tf.int64, stateful=not free)
    lead = tf.reshape(flat[0], shape)
    lead.set_shape(flat[0].shape)
    out = build(tf.nest.pack_sequence_as(inputs, [lead, *flat[1:]]))
    with tf.control_dependencies(tf.nest.flatten(out, expand_composites=True)):
        end = tf.numpy_function(disarm, [], Tout=tf.int32, stateful=True)
    if tf.inside_function():
        return out
    with tf.control_dependencies([end]):
        return tf.nest.map_structure(tf.identity, out, expand_composites=True)


def collective_function(
    forward: Callable[[tf.Tensor], tf.Tensor],
    backward: Callable[[tf.Tensor], tf.Tensor],
) -> Callable[[tf.Tensor], tf.Tensor]:
    """Make a differentiable function whose forward and backward are two collectives.

    Args:
        forward: applied to the input in the forward pass.
        backward: applied to the upstream gradient in the backward pass.

    Returns:
        A function of one tensor, usable under ``tf.GradientTape``.
    """

    @tf.custom_gradient
    def apply(x: tf.Tensor) -> Any:
        return forward(x), backward

    def call(x: tf.Tensor) -> tf.Tensor:
        out: tf.Tensor = apply(x)
        return out

    return call


def _keep_plait_out_of_autograph() -> None:
    """Add plait to autograph's "do not convert" modules (as TensorFlow, Keras and numpy
    are): plait's code is graph-safe Python (``tf.cond`` where it branches on
    tensors), and autograph converting it from a user's ``tf.function`` costs time at
    tracing and, worse, in every step: a host function built by converted code runs
    autograph's ``converted_call`` each time it is called."""
    try:
        from tensorflow.python.autograph.core import config as autograph_config
    except ImportError:  # pragma: no cover - another TensorFlow layout
        return
    rules = getattr(autograph_config, "CONVERSION_RULES", None)
    rule_type = getattr(autograph_config, "DoNotConvert", None)
    if rules is None or rule_type is None:  # pragma: no cover
        return
    if not any(getattr(r, "_prefix", None) == "plait" for r in rules):
        autograph_config.CONVERSION_RULES = (rule_type("plait"), *rules)


_keep_plait_out_of_autograph()
OPS = TFOps()
