"""Arrays on the wire: raw little-endian bytes with dtype and shape.

An :class:`Array` is encoded as a MessagePack array ``[dtype, shape, data]``
where ``data`` is a ``bin`` holding the C-ordered little-endian element bytes.
Decoding does not copy: ``data`` is a view into the received frame, and
:meth:`Array.numpy` is a read-only view of it.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from protocol.errors import ErrorCode, ProtocolError

#: dtype name -> little-endian numpy dtype. Nothing else is accepted.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "uint8", "int32", "int64", "float32", "float64")
}


# gc=False: no cycles through it (see protocol.messages.Message)
class Array(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True,
            gc=False):
    """A typed n-dimensional array carried as raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Array:
        name = array.dtype.name
        if name not in ALLOWED_DTYPES:
            raise ValueError(f"dtype {name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
        contiguous = np.ascontiguousarray(array, dtype=ALLOWED_DTYPES[name])
        return cls(name, tuple(contiguous.shape), memoryview(contiguous).cast("B"))

    def check(self, field: str) -> None:
        """Raise :class:`ProtocolError` unless dtype, shape and length agree."""
        dtype = ALLOWED_DTYPES.get(self.dtype)
        if dtype is None:
            raise ProtocolError(ErrorCode.ARRAY, f"{field}: dtype {self.dtype!r} is not allowed")
        if any(d < 0 for d in self.shape):
            raise ProtocolError(ErrorCode.ARRAY, f"{field}: negative dimension in {self.shape}")
        expected = math.prod(self.shape) * dtype.itemsize
        if self.data.nbytes != expected:
            raise ProtocolError(
                ErrorCode.ARRAY,
                f"{field}: {self.data.nbytes} bytes for shape {self.shape} of {self.dtype} "
                f"(expected {expected})",
            )

    def numpy(self) -> np.ndarray:
        """A read-only view (no copy) of the data."""
        return np.frombuffer(self.data, dtype=ALLOWED_DTYPES[self.dtype]).reshape(self.shape)
