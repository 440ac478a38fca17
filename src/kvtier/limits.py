"""What a model can take: token ids in its vocabulary, positions within its context.

Every generation entry (:func:`kvtier.generate.generate_step`,
:func:`kvtier.generate.stream_steps` under ``stream_generate``/``generate``, and
:func:`kvtier.speculative.speculative_generate_step`) checks its prompts here before
any forward, and learns how many tokens each row may still generate:

- a token id outside ``[0, vocab_size)`` is a ``ValueError`` (it would index past the
  embedding table);
- a prompt longer than ``max_position_embeddings`` is a ``ValueError`` naming both
  numbers and the fix;
- a row stops once its last token sits at the last position of the context: a
  prompt of ``L`` tokens leaves room for ``max_position_embeddings - L + 1`` new tokens
  (the last one is sampled from position ``max_position_embeddings - 1`` and never
  fed back). The streaming layer ends such a row with ``finish_reason="length"``,
  as ``max_tokens`` does.

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model()                      # SmolLM2: 49,152 ids, 8,192 positions
    >>> context_room(lm.model, [[1, 2, 3], [4] * 8192])
    [8190, 1]
"""

from __future__ import annotations

from collections.abc import Sequence


def context_room(model, rows: Sequence[Sequence[int]]) -> list[int]:
    """Check ``rows`` (``B`` prompts of token ids) against ``model.args`` (``vocab_size``,
    ``max_position_embeddings``) and return how many tokens each row may generate.

    Raises ``ValueError`` naming the row and the fix for an id outside the vocabulary
    or a prompt longer than the context.
    """
    vocab, context = model.args.vocab_size, model.args.max_position_embeddings
    for i, row in enumerate(rows):
        bad = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt {i} holds token ids {bad[:5]} outside the model's vocabulary [0, {vocab}); "
                "encode the text with the model's own tokenizer"
            )
        if len(row) > context:
            raise ValueError(
                f"prompt {i} has {len(row)} tokens but the model's context is {context} positions; "
                f"shorten it to at most {context} tokens (keep its end), or use a model with a "
                "longer context"
            )
    return [context - len(row) + 1 for row in rows]
