"""``IncrementalText``: a request's output decoded a few tokens at a time (what the stop rule
searches for stop strings)."""

REPLACEMENT_CHARACTER = "\ufffd"
# A pending run longer than this many tokens is split: all but its last KEPT_PENDING_TOKENS
# settle where that is provably final (see ``IncrementalText``). A UTF-8 character has at most
# 4 bytes, so a character still forming lies within the last 3 text-bearing tokens.
MAX_PENDING_TOKENS = 8
KEPT_PENDING_TOKENS = 4


class IncrementalText:
    """The text of one request's output tokens, decoded a few tokens at a time.

    Each ``update`` decodes one short window: the tokens not settled yet plus the ones settled
    last (the prefix; a tokenizer that drops the leading space of the first decoded token then
    treats the prefix alike in both decodes, as ``neo.server.detokenizer`` does). The window's
    new text is settled once it does not end in U+FFFD: a byte-level tokenizer can split one
    UTF-8 character over several tokens, and decoding a part of it ends in U+FFFD. Until then
    the new text is pending and is decoded again with the next token. Settled plus pending text
    is what decoding every token at once gives.

    Two kinds of output would keep text pending for ever and make every window longer: special
    tokens, which decoding skips (they are dropped here, so they never enter a window), and a
    run of bytes that never completes a character (invalid UTF-8). When more than
    ``MAX_PENDING_TOKENS`` are pending, the run is split before its last
    ``KEPT_PENDING_TOKENS``, and the head settles if decoding the two parts apart gives the
    window's text: then no byte after the split continues a character begun before it, so later
    tokens cannot change the head's text.

    Settled text is kept as a list of pieces (joined only by ``text``) and its last ``overlap``
    characters as one string, so an update's cost does not grow with the output's length.

    tokenizer: the model's tokenizer (``neo.tokenizer.Tokenizer``). overlap: how many settled
    characters ``update`` hands back in front of the new text. skipped_ids: the ids decoding
    turns into no text (the tokenizer's special tokens).
    """

    def __init__(self, tokenizer, overlap: int, skipped_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.skipped_ids = skipped_ids
        self.num_consumed = 0  # output tokens taken so far, skipped ones included
        self.token_ids: list[int] = []  # the output's tokens that decode to text
        self.pieces: list[str] = []  # the settled text
        self.num_settled_characters = 0
        self.settled_tail = ""  # the last ``overlap`` settled characters
        self.pending = ""  # text of the tokens from ``read_offset`` on, not settled yet
        self.prefix_offset = 0  # window start: the first token settled last
        self.read_offset = 0  # the first token not settled
        self.prefix_text = ""  # text of the tokens [prefix_offset, read_offset), decoded alone

    def update(self, output_token_ids: list[int]) -> tuple[int, str]:
        """Take the output's token ids so far (the same list, longer than last time).

        Returns ``(start, recent)`` with ``recent == self.text[start:]``: the text the new
        tokens added (or changed, where they completed a pending character) plus up to
        ``overlap`` settled characters before it.
        """
        new_tokens = output_token_ids[self.num_consumed:]
        self.num_consumed = len(output_token_ids)
        self.token_ids += [token for token in new_tokens if token not in self.skipped_ids]
        overlap_text = self.settled_tail
        start = self.num_settled_characters - len(overlap_text)
        window_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        self.pending = window_text[len(self.prefix_text):]
        recent = overlap_text + self.pending
        if self.pending and not self.pending.endswith(REPLACEMENT_CHARACTER):
            self._settle(len(self.token_ids), self.pending)
        elif len(self.token_ids) - self.read_offset > MAX_PENDING_TOKENS:
            self._settle_head(window_text)
        return start, recent

    def _settle_head(self, window_text: str) -> None:
        """Settle the pending run but its last tokens, if the split there is final."""
        split = len(self.token_ids) - KEPT_PENDING_TOKENS
        head_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:split])
        tail_text = self.tokenizer.decode(self.token_ids[split:])
        if (tail_text and head_text + tail_text == window_text and len(head_text) > len(self.prefix_text)
                and head_text.startswith(self.prefix_text)):
            self._settle(split, head_text[len(self.prefix_text):])

    def _settle(self, read_offset: int, text: str) -> None:
        """Settle ``text``: the text of the tokens from ``self.read_offset`` to ``read_offset``,
        which starts the pending text."""
        self.pieces.append(text)
        self.num_settled_characters += len(text)
        tail = self.settled_tail + text
        self.settled_tail = tail[max(0, len(tail) - self.overlap):]
        self.pending = self.pending[len(text):]
        self.prefix_offset, self.read_offset = self.read_offset, read_offset
        self.prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])

    @property
    def text(self) -> str:
        """The whole text so far (joins the pieces: linear in its length)."""
        return "".join(self.pieces) + self.pending
