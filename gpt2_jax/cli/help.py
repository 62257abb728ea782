"""The help formatter every gpt2-jax command uses."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except unset ones (None, False) and those whose help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in (action.help or ""):  # fmt: skip
            return action.help
        return super()._get_help_string(action)
