"""The storage of an array's elements, for pricing and memory: numpy dtypes as they are, and
JAX's extended dtypes (typed PRNG keys, ``key<fry>``) as what each key holds.

A typed key array of shape ``S`` is ``S + key_shape`` unsigned integers underneath (two
uint32 for threefry). The planner keeps the key array's own shape, so that specs and rules
see the dimensions the program sees, and prices each element as an opaque item of the key
data's size.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["storage_dtype"]


@functools.lru_cache(maxsize=None)
def storage_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype of an element's size: ``dtype`` itself when numpy knows it; for a typed
    key (one of JAX's extended dtypes), an unsigned integer (or raw bytes) as wide as one
    key's data.

    >>> import jax
    >>> storage_dtype(jax.random.key(0).dtype)
    dtype('uint64')
    >>> storage_dtype("bfloat16").itemsize
    2
    """
    import jax

    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return np.dtype(dtype)
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    size = int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
    return np.dtype({1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}.get(size, f"V{size}"))
