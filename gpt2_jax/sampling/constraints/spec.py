"""What a constraint is: the Constraint value, its three constructors and their eager validation.

Every constraint is held as the regex it compiles to (outlines-core's Rust regex syntax), checked
at construction by building outlines-core's DFA index over a 256-token vocabulary of single bytes.
GPT-2's byte-level BPE holds all 256 single bytes as tokens, so a pattern that passes here can be
spelled by GPT-2 tokens too.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from gpt2_jax.errors import ConfigError

KINDS = ("regex", "choice", "json_schema")
# regex-syntax's is_meta_character: the characters that Rust's regex crate lets (or needs) a
# backslash before. Escaping anything else is an error there: "\<" and "\>" are word boundaries,
# and a backslash before a letter, a digit or a non-ASCII character is an unknown escape.
RUST_META = frozenset("\\.+*?()|[]{}^$#&-~")


class ConstraintError(ConfigError):
    """A constraint that cannot be compiled: bad regex, bad JSON schema, bad choice list, wrong vocabulary."""


def escape(text: str) -> str:
    """Escape `text` so that Rust's regex (outlines-core) matches it literally, character for character.

    Only regex-syntax's meta characters get a backslash; spaces, quotes, newlines and non-ASCII text
    stay as they are, because Rust's regex treats them as literals (and rejects `\\é`).
    """
    return "".join("\\" + ch if ch in RUST_META else ch for ch in text)


@functools.lru_cache(maxsize=1)
def _bytes_vocabulary():
    """outlines-core Vocabulary of the 256 single bytes (ids 0..255, EOS 256): cheap to index against."""
    from outlines_core import Vocabulary

    return Vocabulary(256, {bytes([i]): [i] for i in range(256)})


@functools.lru_cache(maxsize=1024)
def regex_problem(pattern: str) -> str | None:
    """outlines-core's complaint about `pattern`, or None when it builds an index (so it is usable)."""
    from outlines_core import Index

    try:
        Index(pattern, _bytes_vocabulary())
    except Exception as e:  # outlines-core raises ValueError; anything else is still a refusal
        message = str(e).strip()
        if message.startswith("The vocabulary provided is incompatible"):
            return f"the pattern matches no text at all ({message})"
        return message
    return None


MAX_STATES = 1 << 16  # the library's bound on a pattern's size (estimate_states); a server sets its own
CHARS_PER_STATE = 64  # a pattern longer than this many characters per allowed state is refused unread


def estimate_states(pattern: str) -> int | None:
    """A quick size estimate of `pattern`'s automaton, in milliseconds whatever the pattern: its character
    positions with bounded repeats expanded (a{1000} is 1000, (ab|c){3} is 9, a* is 1). A token-level DFA
    has at least about this many states (a{100000} would take outlines-core minutes to index). None when
    Python's regex parser cannot read the pattern (outlines-core reads Rust syntax; most patterns parse)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import sre_constants as sc
        import sre_parse

    def size(items) -> int:
        total = 0
        for op, arg in items:
            if op in (sc.MAX_REPEAT, sc.MIN_REPEAT, getattr(sc, "POSSESSIVE_REPEAT", None)):
                lo, hi, inner = arg
                total += (max(lo, 1) if hi == sc.MAXREPEAT else hi) * size(inner)
            elif op is sc.SUBPATTERN:
                total += size(arg[-1])
            elif op is sc.BRANCH:
                total += sum(size(b) for b in arg[1])
            elif op in (sc.LITERAL, sc.NOT_LITERAL, sc.ANY, sc.IN, sc.CATEGORY):
                total += 1
        return total

    try:
        return size(sre_parse.parse(pattern))
    except Exception:  # Rust-only syntax, or something Python rejects: let outlines-core judge it
        return None


def check_size(pattern: str, max_states: int, what: str) -> None:
    """ConstraintError when the pattern's estimated size is over max_states (before any costly indexing). A pattern
    over CHARS_PER_STATE characters a state is refused by its length alone: estimating takes time linear in the
    length (seconds for the megabytes of regex a JSON schema with hundreds of optional properties becomes), and
    even a verbose pattern (JSON's string classes) spends only a few characters on each state."""
    if len(pattern) > CHARS_PER_STATE * max_states:
        raise ConstraintError(f"{what} is too large: its regex is {len(pattern)} characters, over the limit of "
                              f"{CHARS_PER_STATE} x {max_states} states = {CHARS_PER_STATE * max_states}")  # fmt: skip
    n = estimate_states(pattern)
    if n is not None and n > max_states:
        raise ConstraintError(f"{what} is too large: about {n} states, over the limit of {max_states} states")


@dataclass(frozen=True, repr=False)
class Constraint:
    """A validated constraint on generated text: `source` is the regex the whole output must match.

    Frozen and hashable (equal kind and source compare equal), so it keys compile_constraint's cache.
    Build one with regex(), choice() or json_schema(); direct construction validates the regex too.
    """

    kind: str
    source: str
    description: str = field(default="", compare=False)
    # validate=False skips outlines-core's check of the regex: for a source that was already checked (in
    # another process, say); max_states bounds the pattern's estimated size first, so a huge pattern fails fast.
    validate: bool = field(default=True, compare=False)
    max_states: int = field(default=MAX_STATES, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConstraintError(f"constraint source must be a regex string, got {type(self.source).__name__}")
        check_size(self.source, self.max_states, self.description or f"{self.kind} constraint")
        if not self.validate:
            return
        problem = regex_problem(self.source)
        if problem is not None:
            what = self.description or f"{self.kind} constraint"
            if self.kind == "regex":
                raise ConstraintError(f"invalid regex {self.source!r}: outlines-core says: {problem}")
            raise ConstraintError(f"{what} compiles to regex {self.source!r}, which outlines-core rejects: {problem}")

    def __repr__(self) -> str:
        return f"Constraint({self.description or self.kind + ' ' + repr(self.source)})"


def _short(text: str, n: int = 60) -> str:
    """repr of text, cut to about n characters for messages and reprs."""
    r = repr(text)
    return r if len(r) <= n else r[: n - 4] + "...'"


def regex(pattern: str, *, validate: bool = True, max_states: int = MAX_STATES) -> Constraint:
    """The output must match `pattern` completely (Rust regex syntax, as outlines-core reads it). A pattern
    estimated over max_states states is refused at once (see estimate_states)."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"regex pattern must be a str, got {type(pattern).__name__}")
    return Constraint("regex", pattern, f"regex {_short(pattern)}", validate, max_states)


def choice(options: list[str], *, validate: bool = True, max_states: int = MAX_STATES) -> Constraint:
    """The output must be exactly one of `options` (matched literally; duplicates are harmless)."""
    if isinstance(options, str) or not hasattr(options, "__iter__"):
        raise ConstraintError(f"choice needs a list of strings, got {type(options).__name__}")
    options = list(options)
    if not options:
        raise ConstraintError("choice needs at least one option")
    for i, option in enumerate(options):
        if not isinstance(option, str):
            raise ConstraintError(f"choice option {i} must be a str, got {type(option).__name__}: {option!r}")
    unique = list(dict.fromkeys(options))
    source = "(" + "|".join(escape(o) for o in unique) + ")"
    shown = ", ".join(_short(o, 24) for o in unique[:4]) + (", ..." if len(unique) > 4 else "")
    return Constraint("choice", source, f"choice of {len(unique)}: [{shown}]", validate, max_states)


def json_schema(
    schema: dict | str, *, whitespace: str | None = None, validate: bool = True, max_states: int = MAX_STATES
) -> Constraint:
    """The output must be JSON valid under `schema` (a dict, or its JSON text), as outlines-core
    turns it into a regex. `whitespace` is the regex allowed between tokens (outlines' default `[ ]?`)."""
    if isinstance(schema, dict):
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ConstraintError(f"JSON schema is not JSON-serialisable: {e}") from None
    elif isinstance(schema, str):
        text = schema
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"JSON schema text is not valid JSON: {e}") from None
    else:
        raise ConstraintError(f"JSON schema must be a dict or a JSON string, got {type(schema).__name__}")
    if whitespace is not None and not isinstance(whitespace, str):
        raise ConstraintError(f"whitespace must be a regex string or None, got {type(whitespace).__name__}")
    if whitespace is not None and (problem := regex_problem(whitespace)) is not None:
        raise ConstraintError(f"invalid whitespace regex {whitespace!r}: outlines-core says: {problem}")
    from outlines_core import json_schema  # the package's own name for it; its submodule path exists only at run time

    try:
        source = json_schema.build_regex_from_schema(text, whitespace)
    except Exception as e:  # ValueError or TypeError from the Rust side
        raise ConstraintError(f"invalid JSON schema {_short(text)}: outlines-core says: {str(e).strip()}") from None
    return Constraint("json_schema", source, f"JSON schema {_short(text)}", validate, max_states)
