"""python -m gpt2_jax: the same as the gpt2-jax console script."""

from gpt2_jax.cli import main

raise SystemExit(main())
