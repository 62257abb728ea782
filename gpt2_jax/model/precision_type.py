"""The one precision type: which of gpt2_jax.model.precision's modes a params tree computes in.

A user names a mode by its string (load(..., dtype="int8"), with_precision(params, "w8a8")), which
Precision.parse turns into the enum once, with an error naming the allowed values. A params tree carries
its mode in how its embedding is stored (Packed, int8 with scales, or float), which Precision.of reads
once at each entry of the model (gpt2_jax.model.gpt2); below that the functions take the enum and branch
on it. An enum member is hashable and fixed by the params' structure and dtypes, so a jitted function
compiles once per mode, as it already does per dtype, and never again for a new setting.
"""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp

from gpt2_jax.errors import ConfigError
from gpt2_jax.kernels.packed import Packed


class Precision(enum.Enum):
    """A precision mode (gpt2_jax.model.precision's docstring describes each); its value is its name."""

    FLOAT32 = "float32"
    FLOAT32_PACKED = "float32-packed"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    W8A8 = "w8a8"

    @classmethod
    def parse(cls, mode: Any) -> Precision:
        """A mode's name ("int8"), a jnp dtype (jnp.bfloat16) or a Precision -> the Precision."""
        if isinstance(mode, cls):
            return mode
        try:
            return cls(mode if isinstance(mode, str) else jnp.dtype(mode).name)
        except (TypeError, ValueError):
            raise ConfigError(f"precision {mode!r} is not one of {', '.join(MODES)}") from None

    @classmethod
    def of(cls, params: dict) -> Precision:
        """The mode params are in, from how they store the tied embedding: Packed, int8 with its scales
        (w8a8's also with its rows' sums), or float (wpe's dtype: the one matrix no mode quantizes)."""
        if isinstance(params["wte"], Packed):
            return cls.FLOAT32_PACKED
        if "wte_scale" in params:
            return cls.W8A8 if "wte_qsum" in params else cls.INT8
        return cls.BFLOAT16 if params["wpe"].dtype == jnp.bfloat16 else cls.FLOAT32

    @property
    def quantized(self) -> bool:
        """int8 matmul weights with per-output scales (int8 and w8a8)."""
        return self in (Precision.INT8, Precision.W8A8)

    @property
    def packed(self) -> bool:
        """float32 weights held packed in 3.5 bytes (gpt2_jax.kernels.packed.Packed)."""
        return self is Precision.FLOAT32_PACKED

    @property
    def trainable(self) -> bool:
        """Float leaves that take gradients (the other modes are inference forms)."""
        return self in (Precision.FLOAT32, Precision.BFLOAT16)

    @property
    def read_dtype(self) -> Any:
        """The dtype a checkpoint's float tensors are read in before the mode is applied to them."""
        return jnp.dtype(jnp.bfloat16 if self is Precision.BFLOAT16 else jnp.float32)


MODES = tuple(p.value for p in Precision)
