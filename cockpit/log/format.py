"""How values are kept in a history and written to, and read from, JSON logs.

The history (:mod:`cockpit.history`) and the streamed log (:mod:`cockpit.log.stream`)
share everything here; neither imports the other's internals. Nothing here imports
torch or BackPACK: tensors are recognised by their methods (``detach``, ``numel``),
so logs can be read, converted and plotted on a machine without either.

Values:

* :func:`compact` stores a value in the history: plain Python, except numeric arrays
  with at least :data:`COMPACT_MIN_SIZE` entries, which stay read-only numpy arrays
  (8 bytes per number); :func:`expand` turns them back into lists.
* :func:`encode` / :func:`decode` make plain values standard JSON: NaN and the
  infinities become ``{"__float__": "nan" | "inf" | "-inf"}``. :func:`decode` also
  unpacks the ``__ndarray__`` objects that cockpit-for-pytorch 1.0.2 wrote.
* :func:`pack` is :func:`encode` for stored values that writes large arrays in
  fewer bytes (what logs hold by default; :func:`decode` unpacks them): evenly
  spaced floats (histogram edges) as ``{"__linspace__": [first, last, count]}``,
  integer arrays that are mostly zero (histogram counts) as
  ``{"__sparse__": {"shape": [...], "skip": [...], "values": [...]}}``.
* :func:`to_output` gives the shape of 1.0.2's output dict (histograms as numpy
  arrays), and :func:`encode_legacy` writes numpy arrays as json_tricks does, so
  1.0.2's plotter reads our logs.

Files (finding a log, parsing a JSON log whole or step by step) are in
:mod:`cockpit.log.json_file`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from cockpit.log.keys import ESTIMATE_SUFFIX  # noqa: F401  (read from here too)

#: Key of the object that stands for a non-finite float in standard JSON.
FLOAT_TAG = "__float__"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

#: Numeric arrays with at least this many entries are stored compactly.
COMPACT_MIN_SIZE = 16


#: Key of json_tricks' tagged numpy arrays (cockpit-for-pytorch 1.0.2 logs).
NDARRAY_TAG = "__ndarray__"

#: Histogram results: a mapping with both keys holds counts and bin edges.
HISTOGRAM_KEYS = ("hist", "edges")

#: Key of a packed array of evenly spaced floats: ``numpy.linspace(first, last, n)``.
LINSPACE_TAG = "__linspace__"

#: Key of a packed integer array that is mostly zero (see :func:`pack`).
SPARSE_TAG = "__sparse__"

#: An integer array is packed sparsely if at most this share of its entries is not 0.
SPARSE_MAX_DENSITY = 1.0 / 3.0


# --- values in memory -----------------------------------------------------------------
def _is_tensor(value: Any) -> bool:
    """Whether ``value`` behaves like a ``torch.Tensor`` (without importing torch)."""
    return hasattr(value, "detach") and hasattr(value, "numel")


def to_builtin(value: Any) -> Any:
    """Convert tensors, arrays and numpy scalars (recursively) to plain Python values.

    Args:
        value: A number, tensor, array, or a (nested) list/tuple/dict of them.

    Returns:
        The same data made of ``float``, ``int``, ``bool``, ``str``, ``None``,
        ``list`` and ``dict`` only.

    Raises:
        TypeError: For a value that has no JSON representation.
    """
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if _is_tensor(value):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v) for v in value]
    raise TypeError(
        f"Cannot store a value of type {type(value).__name__} in the history; "
        "return numbers, tensors, arrays, or lists/dicts of them."
    )


def _frozen(array: np.ndarray) -> Any:
    """Keep a large numeric array as a read-only C-ordered copy, a small one as list."""
    if array.ndim == 0:
        return array.item()
    if array.size < COMPACT_MIN_SIZE or array.dtype.kind not in "biuf":
        return array.tolist()
    array = np.array(array, copy=True, order="C")
    array.flags.writeable = False
    return array


def _leaf_kind(items: list | tuple) -> tuple[type | None, int]:
    """Return the common type of the leaves of a nested list (float, int or None).

    ``None`` means the leaves mix types or are not all numbers. Also returns the
    number of leaves seen.
    """
    kind: type | None = None
    count = 0
    stack = [items]
    while stack:
        level = stack.pop()
        kinds = set(map(type, level))
        if kinds <= {float} or kinds <= {int}:  # numbers of one type: at once
            if kinds:
                leaf = kinds.pop()
                if kind is None:
                    kind = leaf
                elif kind is not leaf:
                    return None, count
            count += len(level)
            continue
        for item in level:
            if isinstance(item, (list, tuple)):
                stack.append(item)
                continue
            leaf = type(item)
            if leaf is not float and leaf is not int:
                return None, count
            if kind is None:
                kind = leaf
            elif kind is not leaf:
                return None, count
            count += 1
    return kind, count


def _tensor_to_numpy(tensor: Any) -> Any:
    """A detached tensor as a numpy array, or as a list where numpy cannot hold it."""
    if tensor.dim() == 0 or tensor.numel() < COMPACT_MIN_SIZE:
        return tensor.cpu().tolist()
    if tensor.dtype.is_complex:
        return tensor.cpu().tolist()
    if tensor.dtype.is_floating_point and tensor.element_size() < 4:
        tensor = tensor.float()  # bfloat16 has no numpy dtype; float32 is exact
    return tensor.cpu().numpy()


def compact(value: Any) -> Any:
    """Like :func:`to_builtin`, but keep large numeric arrays as numpy arrays.

    Args:
        value: A number, tensor, array, or a (nested) list/tuple/dict of them.

    Returns:
        Plain Python values, except that numeric arrays, tensors and nested lists of
        numbers of one type (all ``float`` or all ``int``) with at least
        :data:`COMPACT_MIN_SIZE` entries become read-only numpy arrays.

    Raises:
        TypeError: For a value that has no JSON representation.
    """
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if _is_tensor(value):
        converted = _tensor_to_numpy(value.detach())
        return _frozen(converted) if isinstance(converted, np.ndarray) else converted
    if isinstance(value, np.ndarray):
        return _frozen(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kind, count = _leaf_kind(value)
        if kind is not None and count >= COMPACT_MIN_SIZE:
            try:
                array = np.array(value, dtype=np.float64 if kind is float else np.int64)
            except (ValueError, OverflowError):  # ragged, or ints beyond int64
                array = None
            if array is not None:
                array.flags.writeable = False
                return array
        return [compact(v) for v in value]
    return to_builtin(value)  # raises the TypeError for unsupported values


def expand(value: Any) -> Any:
    """Undo :func:`compact`: numpy arrays become (nested) lists again (a copy)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


def _as_array(value: Any) -> Any:
    """A fresh, writable numpy array holding ``value`` (an array or nested list).

    A value that is no array (ragged lists, ``None``) is returned as plain Python.
    """
    try:
        array = np.array(value, copy=True)
    except (ValueError, TypeError):
        return expand(value)
    return array if array.dtype.kind in "biuf" else expand(value)


def _edges_output(edges: Any) -> Any:
    """Bin edges as 1.0.2 returns them: one array, or a tuple of one array per axis."""
    if isinstance(edges, np.ndarray):
        if edges.ndim >= 2:  # equal-length edges of several axes, stored as one block
            return tuple(_as_array(row) for row in edges)
        return _as_array(edges)
    if (
        isinstance(edges, list)
        and edges
        and all(isinstance(axis, (list, np.ndarray)) for axis in edges)
    ):
        return tuple(_as_array(axis) for axis in edges)
    return _as_array(edges)


def to_output(value: Any) -> Any:
    """Return a stored value as cockpit-for-pytorch 1.0.2 returned it.

    Histogram results (any mapping with ``hist`` and ``edges``, also the per-layer
    ``param_k`` mappings of ``GradHist2d``) hold numpy arrays: ``hist`` one array,
    ``edges`` one array (1-D) or a tuple of one array per axis (2-D). Everything else
    is plain Python, as :func:`expand` returns it.

    Args:
        value: A value as :func:`compact` stored it.

    Returns:
        A fresh copy; changing it does not change the history.
    """
    if isinstance(value, dict):
        if all(key in value for key in HISTOGRAM_KEYS):
            out = {}
            for key, item in value.items():
                if key == "hist":
                    out[key] = _as_array(item)
                elif key == "edges":
                    out[key] = _edges_output(item)
                else:
                    out[key] = to_output(item)
            return out
        return {k: to_output(v) for k, v in value.items()}
    return expand(value)


# --- values in JSON -------------------------------------------------------------------
def encode(value: Any) -> Any:
    """Replace non-finite floats by tagged objects (standard JSON has no NaN).

    Args:
        value: Plain Python data (as :func:`expand` returns it).

    Returns:
        The same data, each NaN or infinity replaced by ``{"__float__": tag}``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        tag = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return {FLOAT_TAG: tag}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    return value


def _linspace(array: np.ndarray) -> dict[str, list] | None:
    """``array`` as a :data:`LINSPACE_TAG` object, if that gives it back exactly."""
    first, last, count = float(array[0]), float(array[-1]), int(array.size)
    if not (math.isfinite(first) and math.isfinite(last)):
        return None
    if not np.array_equal(np.linspace(first, last, count), array):
        return None
    return {LINSPACE_TAG: [first, last, count]}


def _sparse(array: np.ndarray) -> dict[str, dict] | None:
    """An integer array with few non-zero entries as a :data:`SPARSE_TAG` object."""
    flat = array.ravel()
    where = np.flatnonzero(flat)
    if where.size > SPARSE_MAX_DENSITY * flat.size:
        return None
    skip = np.diff(where, prepend=-1) - 1  # zeros before each non-zero entry
    return {
        SPARSE_TAG: {
            "shape": list(array.shape),
            "skip": skip.tolist(),
            "values": flat[where].tolist(),
        }
    }


def _pack_array(array: np.ndarray) -> Any:
    if array.size >= COMPACT_MIN_SIZE:
        if array.dtype.kind in "iu":
            packed = _sparse(array)
            if packed is not None:
                return packed
        elif array.dtype.kind == "f":
            if array.ndim == 1:
                packed = _linspace(array)
                if packed is not None:
                    return packed
            else:  # e.g. the edges of both axes of a 2-D histogram, as one block
                return [_pack_array(row) for row in array]
    return encode(array.tolist())


def pack(value: Any) -> Any:
    """Like :func:`encode`, for values as :func:`compact` stores them, in fewer bytes.

    Numpy arrays with at least :data:`COMPACT_MIN_SIZE` entries are written as

    * ``{"__linspace__": [first, last, n]}`` if they are 1-D floats equal to
      ``numpy.linspace(first, last, n)`` (checked exactly; histogram edges are);
    * ``{"__sparse__": {"shape": s, "skip": k, "values": v}}`` if they hold
      integers of which at most :data:`SPARSE_MAX_DENSITY` are not zero (2-D
      histogram counts): ``v`` are the non-zero entries in C order and ``k[i]``
      the number of zeros right before ``v[i]``;
    * (nested) lists otherwise, as :func:`encode` writes them.

    :func:`decode` gives back exactly the values :func:`expand` returns. Each
    packed value stands alone (no reference to other records), so a streamed
    record stays self-contained.

    Args:
        value: A value as :func:`compact` returns it.

    Returns:
        Data for :func:`json.dumps` (standard JSON, no NaN tokens).
    """
    if isinstance(value, np.ndarray):
        return _pack_array(value)
    if isinstance(value, dict):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [pack(v) for v in value]
    return encode(value)


def _unpack_linspace(spec: Any) -> list[float]:
    first, last, count = spec
    return np.linspace(float(first), float(last), int(count)).tolist()


def _unpack_sparse(spec: Mapping[str, Any]) -> list[Any]:
    shape = [int(n) for n in spec["shape"]]
    values = spec["values"]
    kinds = {type(v) for v in values}
    if not kinds <= {int}:
        raise ValueError(f"{SPARSE_TAG} holds values that are not integers")
    skip = np.asarray(spec["skip"], dtype=np.int64)
    flat = np.zeros(math.prod(shape), dtype=np.int64)
    if skip.shape != (len(values),) or np.any(skip < 0):
        raise ValueError(f"{SPARSE_TAG} has a 'skip' list that does not fit 'values'")
    where = np.cumsum(skip + 1) - 1
    if where.size and where[-1] >= flat.size:
        raise ValueError(f"{SPARSE_TAG} has more entries than its shape {shape}")
    flat[where] = values
    return flat.reshape(shape).tolist()


def _unpack_ndarray(value: Mapping[str, Any]) -> list[Any]:
    """The (nested) list held by a json_tricks ``__ndarray__`` object."""
    data = value[NDARRAY_TAG]
    if isinstance(data, str):
        raise ValueError(
            "a numpy array in json_tricks' compact (base64) form, which cockpit "
            "does not read; fix: write the log with json_tricks' default options, "
            "as cockpit-for-pytorch 1.0.2 did"
        )
    array = np.asarray(data, dtype=value.get("dtype"))
    if "shape" in value:
        array = array.reshape(value["shape"])
    return array.tolist()


def decode(value: Any) -> Any:
    """Undo :func:`encode` / :func:`pack`; unpack json_tricks arrays into lists.

    Args:
        value: Data as read by :func:`json.load` from one of our logs or a 1.0.2 log.

    Returns:
        Plain Python data with NaN and infinities restored (a list with nothing
        to decode in it is returned as it is, not copied).

    Raises:
        ValueError: For an ``__ndarray__`` object that cannot be unpacked.
    """
    if isinstance(value, dict):
        if len(value) == 1:
            if FLOAT_TAG in value:
                return _NONFINITE[value[FLOAT_TAG]]
            if LINSPACE_TAG in value:
                return _unpack_linspace(value[LINSPACE_TAG])
            if SPARSE_TAG in value:
                return _unpack_sparse(value[SPARSE_TAG])
        if NDARRAY_TAG in value:
            return _unpack_ndarray(value)
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        if not any(isinstance(v, (dict, list)) for v in value):
            return value  # numbers and strings only: nothing to decode
        return [decode(v) for v in value]
    return value


def encode_legacy(value: Any) -> Any:
    """Write numpy arrays as json_tricks does (the format of 1.0.2 logs).

    An array becomes ``{"__ndarray__": nested list, "dtype": name, "shape": list}``
    with ``"Corder": true`` added for arrays of two or more dimensions, exactly the
    keys json_tricks writes for a C-ordered array. Tuples become lists; non-finite
    floats stay floats (``json.dumps`` writes them as ``NaN``/``Infinity``, which
    json_tricks and Python's ``json`` read).

    Args:
        value: Data as :func:`to_output` returns it.

    Returns:
        Data that :func:`json.dumps` writes in 1.0.2's format.
    """
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        tagged = {
            NDARRAY_TAG: array.tolist(),
            "dtype": str(array.dtype),
            "shape": list(array.shape),
        }
        if array.ndim > 1:
            tagged["Corder"] = True
        return tagged
    if isinstance(value, dict):
        return {str(k): encode_legacy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_legacy(v) for v in value]
    return value
