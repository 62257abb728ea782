"""GPT2Config: a frozen, hashable description of one GPT-2 model, with named presets.

Shape legend used across the package:
  B batch, T query positions, S cache/key positions, D model width (n_embd),
  H heads, K head dim (D // H), F MLP width (4 D), V vocab rows, L layers, P context.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeGuard

from gpt2_jax.errors import ConfigError

# Activation names as transformers spells them; value = does it use the tanh approximation.
HF_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}


# Sizes are counts of rows, positions and token ids, which JAX indexes with int32.
MAX_SIZE = 2**31 - 1
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "n_valid_tokens")
_FLAGS = ("gelu_approximate", "bias", "scale_attn_weights", "scale_attn_by_inverse_layer_idx")


def _real(value: Any) -> bool:
    """An int or float that is not a bool (True would pass as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """repr(value) cut to a readable length (a config file may hold a megabyte string, or an int too
    long for Python to print)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def _check(name: str, ok: bool, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"GPT2Config.{name} must be {allowed}, got {shown(value)}")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Hyper-parameters of a GPT-2 model. Frozen and hashable, so it can be a static jit argument."""

    vocab_size: int = 50257  # V: rows of wte (nanoGPT pads 50257 to 50304)
    n_positions: int = 1024  # P: context length, rows of wpe
    n_embd: int = 768  # D
    n_layer: int = 12  # L
    n_head: int = 12  # H
    n_inner: int | None = None  # F; None means 4 * D, GPT-2's choice
    layer_norm_epsilon: float = 1e-5
    gelu_approximate: bool = True  # GPT-2 uses the tanh form; nanoGPT uses exact erf GELU
    bias: bool = True  # nanoGPT can train without biases in Linear and LayerNorm
    # Number of real token ids; rows at or above it are padding that is never sampled.
    # None means every row of wte is a real token.
    n_valid_tokens: int | None = None
    scale_attn_weights: bool = True  # divide scores by sqrt(K)
    scale_attn_by_inverse_layer_idx: bool = False  # also divide layer i's scores by i + 1
    # The end-of-text id generation stops on by default (GPT-2's <|endoftext|>; a HuggingFace
    # config.json's eos_token_id). None, or an id outside the vocab, means no default EOS.
    eos_token_id: int | None = 50256
    # Dropout rates; used only by the training loss when train=True, never at inference.
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    resid_pdrop: float = 0.1

    def __post_init__(self):
        for name in _SIZES:
            value, optional = getattr(self, name), name in ("n_inner", "n_valid_tokens")
            ok = (value is None and optional) or (_int(value) and 1 <= value <= MAX_SIZE)
            _check(name, ok, f"an int in [1, {MAX_SIZE}]" + (" or None" if optional else ""), value)
        for name in _FLAGS:
            _check(name, isinstance(getattr(self, name), bool), "true or false", getattr(self, name))
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            value = getattr(self, name)
            _check(name, _real(value) and 0.0 <= value < 1.0, "a dropout rate, in [0, 1)", value)
        eps = self.layer_norm_epsilon  # NaN and infinities fail the comparison
        _check("layer_norm_epsilon", _real(eps) and 0.0 < eps < 1.0, "a finite number in (0, 1)", eps)
        eos = self.eos_token_id
        _check("eos_token_id", eos is None or _int(eos), "an int or None", eos)
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_valid_tokens is not None and not 0 < self.n_valid_tokens <= self.vocab_size:
            raise ConfigError(
                f"GPT2Config.n_valid_tokens={self.n_valid_tokens} must be in [1, vocab_size={self.vocab_size}]"
            )

    @property
    def eos_id(self) -> int | None:
        """The default EOS for generation: eos_token_id when it is a real token of this vocab, else None."""
        eos = self.eos_token_id
        return eos if isinstance(eos, int) and 0 <= eos < self.valid_vocab else None

    @property
    def head_dim(self) -> int:
        """K = D // H."""
        return self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        """F, the MLP hidden width."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def valid_vocab(self) -> int:
        """How many leading rows of wte are real tokens."""
        return self.n_valid_tokens if self.n_valid_tokens is not None else self.vocab_size

    @property
    def n_params(self) -> int:
        """Parameter count with the unembedding tied to wte (as GPT-2 is)."""
        d, f, b = self.n_embd, self.mlp_dim, int(self.bias)
        ln = d * (1 + b)
        attn = d * 3 * d + 3 * d * b + d * d + d * b
        mlp = d * f + f * b + f * d + d * b
        per_layer = 2 * ln + attn + mlp
        return self.vocab_size * d + self.n_positions * d + self.n_layer * per_layer + ln

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """One of the released GPT-2 sizes, by exact name."""
        if name not in PRESETS:
            raise ConfigError(f"unknown GPT-2 preset {name!r}; known presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def replace(self, **changes: Any) -> GPT2Config:
        """A copy with some fields changed (the config itself is never mutated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPT2Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown GPT2Config fields {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}
