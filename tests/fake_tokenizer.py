"""A stand-in for a ``tokenizers.Tokenizer`` in the output side's unit tests: token i decodes
to ``<i>``, and no token is special."""

from __future__ import annotations


class BracketTokenizer:
    """The calls the output side makes of a tokenizers.Tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def get_added_tokens_decoder(self):
        return {}

    def id_to_token(self, token_id):
        return f"t{token_id}"
