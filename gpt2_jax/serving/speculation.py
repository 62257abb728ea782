"""Speculative decoding in the engine: what proposes (prompt lookup or a draft model), and, step by step, whether a
speculative round or a plain decode step gives more tokens per second for the rows decoding now.

A round checks k proposals per row in one forward over k + 1 tokens per row and keeps 1 + (accepted) tokens per
row; a plain step keeps 1. Either way each token is the one plain decoding draws (generation.speculative), so the
choice changes speed only. A round costs more than a step, and the more so the more rows it covers: at batch 1 a
step reads every weight for one token and a round reads them once for up to k + 1; over many rows the forward is
compute-bound and a round's k extra tokens per row cost nearly k extra steps. So the engine measures both: the
seconds a step and a round take for each compiled row count, and for each row the tokens its rounds kept (an
exponential average; a request new to speculation starts at the average over every round so far, OPTIMISTIC
before the first). It runs a round when the rows' expected tokens per second beat a plain step's by MARGIN: both
times are averages of noisy measurements, and a round that keeps only its first token is a plain step that costs
more, so without a margin rows with nothing to propose would flip into rounds whenever the noise made a round look
as cheap as a step. Where no round was timed yet, and after EXPLORE plain steps, it runs a round anyway, so a workload whose text starts repeating itself is noticed; after EXPLORE rounds it runs a plain step,
so a step timed once when the machine was busy does not keep rounds going that no longer pay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.speculative.speculator import PROMPT_LOOKUP, check_draft
from gpt2_jax.model import Params

WHEN = ("auto", "always")  # auto: the per-step choice in the module docstring; always: every step a round
OPTIMISTIC = 2.0  # tokens a row new to speculation is expected to keep per round
EXPLORE = 64  # plain steps (per row count) before a round is tried again, and rounds before a plain step
SMOOTHING = 0.25  # weight of the newest measurement in the averages
MARGIN = 1.05  # a round must promise this many times a plain step's tokens per second


@dataclasses.dataclass(frozen=True)
class Speculation:
    """An engine's speculative decoding: prompt lookup (draft None) or a draft model (params, config) with the
    target's vocabulary; k proposals per round; when: "auto" or "always" (module docstring)."""

    k: int = 4
    draft: tuple[Params, GPT2Config] | None = None
    when: str = "auto"

    def __post_init__(self):
        if self.when not in WHEN:
            raise ConfigError(f"speculation's when must be one of {WHEN}, got {self.when!r}")

    @property
    def draft_params(self) -> Params | None:
        return None if self.draft is None else self.draft[0]

    @property
    def draft_config(self) -> GPT2Config | None:
        return None if self.draft is None else self.draft[1]

    def check(self, config: GPT2Config, max_seq: int) -> None:
        """generate's checks of k and of the draft (speculative.speculator.check_draft: its vocabulary, its
        context against max_seq, its params against its config)."""
        check_draft(PROMPT_LOOKUP if self.draft is None else self.draft, config, self.k, max_seq)


class Policy:
    """The per-step choice (module docstring): `choose(rows, requests)` before a step, `observe(...)` after it."""

    def __init__(self, speculation: Speculation):
        self.k, self.always = speculation.k, speculation.when == "always"
        self.step: dict[int, float] = {}  # seconds of a plain step, by compiled row count
        self.round: dict[int, float] = {}  # seconds of a round, by compiled row count
        self.since: dict[int, int] = {}  # plain steps since the last round, by compiled row count
        self.since_round: dict[int, int] = {}  # rounds since the last plain step, by compiled row count
        self.kept: dict[int, float] = {}  # tokens per round, by request (id of its Request)
        self.prior = OPTIMISTIC  # tokens per round over every request: where a new request starts

    def choose(self, size: int, requests: list[Any]) -> bool:
        """Whether the step over `size` compiled rows, for these requests (those with speculate set), is a round."""
        wanting = [r for r in requests if r.speculate]
        if not wanting:
            return False
        if self.always:
            return True
        if size not in self.step or self.since_round.get(size, 0) >= EXPLORE:
            return False  # a plain step's time first (the yardstick), and again every EXPLORE rounds
        if size not in self.round or self.since.get(size, 0) >= EXPLORE:
            return True
        expected = len(requests) - len(wanting) + sum(self.kept.get(id(r), self.prior) for r in wanting)
        return expected / self.round[size] > MARGIN * len(requests) / self.step[size]

    def observe(self, size: int, speculated: bool, seconds: float, kept: dict[int, int]) -> None:
        """A step over `size` rows took `seconds`; kept: tokens each speculating request kept (a round only)."""
        table = self.round if speculated else self.step
        table[size] = seconds if size not in table else (1 - SMOOTHING) * table[size] + SMOOTHING * seconds
        self.since[size] = 0 if speculated else self.since.get(size, 0) + 1
        self.since_round[size] = self.since_round.get(size, 0) + 1 if speculated else 0
        for rid, n in kept.items():
            self.kept[rid] = (1 - SMOOTHING) * self.kept.get(rid, self.prior) + SMOOTHING * n
            self.prior = (1 - SMOOTHING) * self.prior + SMOOTHING * n

    def forget(self, request: Any) -> None:
        self.kept.pop(id(request), None)
