"""``StopRule``: why a request ends after a sampled token (the scheduler asks it in ``update``),
and ``IncrementalText``, the decoded output it searches for stop strings."""

from neo.request import Request

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


class StopRule:
    """End-of-sequence tokens (unless ``ignore_eos``), the request's stop token ids and stop
    strings, its ``max_tokens``, and the model's context length.

    Stop strings are searched for incrementally: the request keeps an ``IncrementalText`` of its
    output, and each token's search covers only the text it added plus the characters before it
    that a stop string could still end past (one fewer than the longest stop string has). A
    stop string that ends in the older text would have stopped the request at an earlier token,
    so this finds what searching the whole text finds: the request stops at the first token
    whose text holds a stop string, and its text is cut where the first one starts.
    """

    def __init__(self, eos_token_ids: frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Decoding skips special tokens, so the incremental text leaves them out.
        self.special_token_ids = frozenset() if tokenizer is None else frozenset(
            token_id for token_id, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special)

    def __call__(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in request.stop_token_ids:
            return "stop"
        if params.stop and self.tokenizer is not None and self._cut_at_stop_string(request):
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, request: Request) -> bool:
        stops = request.sampling_params.stop
        if request.incremental_text is None:
            longest = max(len(stop) for stop in stops)
            request.incremental_text = IncrementalText(self.tokenizer, longest - 1, self.special_token_ids)
        text = request.incremental_text
        start, recent = text.update(request.output_token_ids)
        positions = [recent.find(stop) for stop in stops]
        found = [position for position in positions if position >= 0]
        if not found:
            return False
        request.output_text = text.text[:start + min(found)]
        return True
