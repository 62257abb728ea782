"""Speculative decoding that returns exactly the tokens of plain decoding, only faster.

Batch-1 decode reads every weight once per token. Speculation guesses k tokens cheaply (a proposer:
prompt lookup or a small draft model, see .propose) and checks them with one forward of the target
over k + 1 tokens, one read of the weights (see .verify). The check is not the usual ratio test that
preserves the output *distribution*: a row's draw at position t is already a deterministic function
of its logits, its key fold_in(row_key, t) and its settings, and the cached forward is bit-identical
to one-token steps, so verification draws the very token plain decoding would draw at each position
and keeps a proposal only while it equals that token. Greedy or sampled, with any processor or
constraint, the tokens, lengths and logprobs equal plain `generate` with the same key, bit for bit;
the proposer only decides how many tokens each target forward yields. (For a deterministic proposer
the acceptance rate is also the usual test's: a proposal d is kept with probability p(d) either way.)

    generate(..., draft="prompt_lookup", num_speculative_tokens=4)
    generate(..., draft=(draft_params, draft_config), num_speculative_tokens=4)
"""
