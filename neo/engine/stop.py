"""``StopRule``: why a request ends after a sampled token (the scheduler asks it in ``update``),
and ``IncrementalText``, the decoded output it searches for stop strings."""

from neo.request import Request

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalText:
    """The text of one request's output tokens, decoded a few tokens at a time.

    Each ``update`` decodes one short window: the tokens not settled yet plus the ones settled
    last (the prefix; a tokenizer that drops the leading space of the first decoded token then
    treats the prefix alike in both decodes, as ``neo.server.detokenizer`` does). The window's
    new text is settled once it does not end in U+FFFD: a byte-level tokenizer can split one
    UTF-8 character over several tokens, and decoding a part of it ends in U+FFFD. Until then
    the new text is pending and is decoded again with the next token. Settled plus pending text
    is what decoding every token at once gives.

    Settled text is kept as a list of pieces (joined only by ``text``) and its last ``overlap``
    characters as one string, so an update's cost does not grow with the output's length.

    tokenizer: the model's tokenizer (``neo.tokenizer.Tokenizer``). overlap: how many settled
    characters ``update`` hands back in front of the new text.
    """

    def __init__(self, tokenizer, overlap: int):
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.pieces: list[str] = []  # the settled text
        self.num_settled_characters = 0
        self.settled_tail = ""  # the last ``overlap`` settled characters
        self.pending = ""  # text of the tokens from ``read_offset`` on, not settled yet
        self.prefix_offset = 0  # window start: the first token settled last
        self.read_offset = 0  # the first token not settled
        self.prefix_text = ""  # text of the tokens [prefix_offset, read_offset), decoded alone

    def update(self, token_ids: list[int]) -> tuple[int, str]:
        """Take the output's token ids so far (the same list, longer than last time).

        Returns ``(start, recent)`` with ``recent == self.text[start:]``: the text the new
        tokens added (or changed, where they completed a pending character) plus up to
        ``overlap`` settled characters before it.
        """
        overlap_text = self.settled_tail
        start = self.num_settled_characters - len(overlap_text)
        window_text = self.tokenizer.decode(token_ids[self.prefix_offset:])
        new_text = window_text[len(self.prefix_text):]
        if new_text and not new_text.endswith(REPLACEMENT_CHARACTER):
            self._settle(new_text, token_ids)
        else:
            self.pending = new_text
        return start, overlap_text + new_text

    def _settle(self, new_text: str, token_ids: list[int]) -> None:
        self.pieces.append(new_text)
        self.num_settled_characters += len(new_text)
        tail = self.settled_tail + new_text
        self.settled_tail = tail[max(0, len(tail) - self.overlap):]
        self.pending = ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.prefix_text = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset])

    @property
    def text(self) -> str:
        """The whole text so far (joins the pieces: linear in its length)."""
        return "".join(self.pieces) + self.pending


class StopRule:
    """End-of-sequence tokens (unless ``ignore_eos``), the request's stop token ids and stop
    strings, its ``max_tokens``, and the model's context length.

    Stop strings are searched for incrementally: the request keeps an ``IncrementalText`` of its
    output, and each token's search covers only the text it added plus the (longest stop string
    - 1) characters before it. A stop string that ends in the older text would have stopped the
    request at an earlier token, so this finds what searching the whole text finds: the request
    stops at the first token whose text holds a stop string, and its text is cut where the first
    one starts.
    """

    def __init__(self, eos_token_ids: frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

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
            request.incremental_text = IncrementalText(self.tokenizer, overlap=longest - 1)
        text = request.incremental_text
        start, recent = text.update(request.output_token_ids)
        positions = [recent.find(stop) for stop in stops]
        found = [position for position in positions if position >= 0]
        if not found:
            return False
        request.output_text = text.text[:start + min(found)]
        return True
