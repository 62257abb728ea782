"""One choice's text, streamed as its tokens arrive without ever taking back a character (serving.choices'
Choice): what might still become a stop string, an incomplete UTF-8 character and a trailing EOS (or stop token
id) wait until the row ends."""

from __future__ import annotations

import codecs
from collections.abc import Collection
from typing import Any

from gpt2_jax.serving.slots import Request


class Choice:
    """One row of a request: its tokens and logprobs as they arrive, and its text, streamed without
    ever taking back a character: text that might still become a stop string, an incomplete UTF-8
    character and a trailing token that may have ended the row (EOS, a stop token id) are held back until
    the row ends. ends: the ids that end this row; skip_special: leave <|endoftext|> out of the text
    (vLLM's skip_special_tokens), else it is text like any other token, unless it ended the row."""

    def __init__(self, index: int, prompt_index: int, enc: Any, stops: list[str], ends: Collection[int] = (),
                 skip_special: bool = True):  # fmt: skip
        self.index, self.prompt_index, self.enc, self.ends = index, prompt_index, enc, frozenset(ends)
        self.skipped = frozenset([enc.eot_token]) if skip_special else frozenset()
        self.patterns = [s.encode("utf-8") for s in stops]
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[list, list]] = []
        self.data = bytearray()  # the text's bytes so far, a trailing token that may have ended the row excluded
        self.shown = ""  # the text streamed so far
        self.finish: str | None = None
        self.stop: str | None = None
        self.request: Request | None = None

    def _bytes(self, tokens: list[int]) -> bytes:
        return b"".join(self.enc.decode_single_token_bytes(t) for t in tokens if t not in self.skipped)

    def add(self, token: int, logprob: float, top_ids: list, top_lps: list) -> None:
        if self.tokens and self.tokens[-1] in self.ends:  # a token that may end the row, and did not: it is text
            self.data += self._bytes(self.tokens[-1:])
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top.append((top_ids, top_lps))
        if token not in self.ends:
            self.data += self._bytes([token])

    def _held(self) -> int:
        """Bytes at the end of the text that are the start of some stop string."""
        data, held = self.data, 0
        for p in self.patterns:
            for k in range(min(len(p) - 1, len(data)), held, -1):
                if data.endswith(p[:k]):
                    held = k
                    break
        return held

    def safe_text(self) -> str:
        """The text that no later token can change: up to a stop string that completed (its "done" event
        comes after its token), else without the tail that could still begin one."""
        found = [i for i in (self.data.find(p) for p in self.patterns) if i >= 0]
        end = min(found) if found else len(self.data) - self._held()
        safe = bytes(self.data[:end])
        return codecs.getincrementaldecoder("utf-8")("replace").decode(safe, final=False)

    def final_text(self) -> str:
        """gpt2_jax.complete's text: without the token that ended the row (EOS, a stop token id), cut before the
        stop string that matched, and without <|endoftext|> when skip_special."""
        shown = self.tokens
        if self.finish == "stop" and self.stop is None and shown and shown[-1] in self.ends:
            shown = shown[:-1]
        data = self._bytes(shown)
        if self.stop is not None:
            cut = data.find(self.stop.encode("utf-8"))
            data = data[: cut if cut >= 0 else len(data)]
        return data.decode("utf-8", errors="replace")

    def delta(self, final: bool) -> str:
        text = self.final_text() if final else self.safe_text()
        if not text.startswith(self.shown):  # cannot happen (see safe_text); never resend text
            return ""
        out, self.shown = text[len(self.shown) :], text
        return out
