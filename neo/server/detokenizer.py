"""``IncrementalDetokenizer``: turns a growing list of output token ids into text deltas.

Streamed deltas concatenate to the text of the whole output (the text the engine reports when
the request finishes), which needs two kinds of holding back:

- a byte-level tokenizer can split one UTF-8 character over several tokens; decoding such a
  prefix ends in U+FFFD, so nothing is released until the character is complete;
- a stop string may be forming at the end of the text; the engine cuts the text where a stop
  string starts, so the last ``len(longest stop string) - 1`` characters wait until the
  request goes on or finishes.

Decoding is incremental: each update decodes only a short window of recent tokens (the tokens
since the previous release plus the ones released with it, so a tokenizer that drops a
leading space of the first decoded token treats both decodes alike).
"""

import logging

from neo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one request's output tokens.

    tokenizer: the model's tokenizer. stop: the request's stop strings (may be empty).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold_back = max((len(text) for text in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (complete characters only)
        self.num_released = 0  # characters of ``text`` already handed out
        self.prefix_offset = 0  # window start: first token of the previous release
        self.read_offset = 0  # first token not yet turned into ``text``

    def update(self, token_ids: list[int]) -> str:
        """Take the output's token ids so far (a longer list than last time); return the text
        that can be released now."""
        self.token_ids = list(token_ids)
        window = self.token_ids[self.prefix_offset:]
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self.tokenizer.decode(window)
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT_CHARACTER):
            self.text += window_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        releasable = len(self.text) - self.hold_back
        if releasable <= self.num_released:
            return ""
        delta = self.text[self.num_released:releasable]
        self.num_released = releasable
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the text once the request finished; ``final_text`` is the engine's text
        of the whole output (already cut at a stop string)."""
        if not final_text.startswith(self.text[:self.num_released]):
            logger.warning("streamed text is not a prefix of the final text: the tokenizer "
                           "decodes a token differently depending on what follows it")
        delta = final_text[self.num_released:]
        self.num_released = len(final_text)
        return delta
