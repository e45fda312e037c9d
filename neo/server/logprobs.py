"""OpenAI's ``logprobs`` objects, built from a completion's ``CompletionOutput.logprobs``.

Each generated token comes from the engine with a dict ``{token id: Logprob}`` holding the
sampled token and the ``SamplingParams.logprobs`` most likely ones. Two shapes carry them:

- ``/v1/completions`` (OpenAI's legacy shape): ``{"tokens": [text, ...], "token_logprobs":
  [float, ...], "top_logprobs": [{text: float, ...}, ...], "text_offset": [int, ...]}``, each
  ``top_logprobs`` dict holding every token of the engine's dict (the most likely ones and the
  sampled one, as OpenAI's API describes), most likely first; ``text_offset`` is where each
  token's text starts in the concatenation of the tokens' texts;
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...]}`` with exactly ``top_logprobs`` entries per
  token, most likely first.

A token's text is its decoding alone, special tokens spelled out (``token_id:<id>`` for a model
without a tokenizer); ``bytes`` are its UTF-8 bytes. JSON has no infinity, so a log-probability
of -inf is sent as ``MIN_LOGPROB``, as OpenAI and vLLM do.
"""

from neo.outputs import Logprob
from neo.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class LogprobsShape:
    """Builds the ``logprobs`` object of a stretch of one completion's tokens.

    tokenizer: the model's (None: tokens are named by id). chat: the chat shape.
    num_top: the most likely tokens listed per token (``SamplingParams.logprobs``).
    """

    def __init__(self, tokenizer: Tokenizer | None, chat: bool, num_top: int):
        self.tokenizer = tokenizer
        self.chat = chat
        self.num_top = num_top

    def build(self, token_ids: list[int], entries: list[dict[int, Logprob]],
              text_offset: int = 0) -> tuple[dict, int]:
        """The object for the tokens ``token_ids`` and their engine dicts ``entries`` (one per
        token, same order); ``text_offset``: where the first token's text starts (completions
        shape). Returns it and the offset after the last token's text."""
        if len(entries) != len(token_ids):
            raise ValueError(f"{len(entries)} log-probability entries for {len(token_ids)} tokens")
        texts = self._token_texts({token_id for entry in entries for token_id in entry})
        ranked = [sorted(entry.items(), key=lambda item: item[1].rank) for entry in entries]
        if self.chat:
            content = [self._chat_entry(texts[token_id], entry[token_id].logprob,
                                        [(texts[other], logprob.logprob)
                                         for other, logprob in top[:self.num_top]])
                       for token_id, entry, top in zip(token_ids, entries, ranked)]
            end = text_offset + sum(len(texts[token_id]) for token_id in token_ids)
            return {"content": content}, end
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry, top in zip(token_ids, entries, ranked):
            offsets.append(text_offset)
            text_offset += len(texts[token_id])
            tokens.append(texts[token_id])
            token_logprobs.append(_finite(entry[token_id].logprob))
            top_logprobs.append({texts[other]: _finite(logprob.logprob) for other, logprob in top})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}, text_offset

    def _chat_entry(self, text: str, logprob: float, top: list[tuple[str, float]]) -> dict:
        return {"token": text, "logprob": _finite(logprob), "bytes": _bytes(text),
                "top_logprobs": [{"token": other, "logprob": _finite(value),
                                  "bytes": _bytes(other)} for other, value in top]}

    def _token_texts(self, token_ids: set[int]) -> dict[int, str]:
        """Each token's text alone, special tokens spelled out."""
        ids = sorted(token_ids)
        if self.tokenizer is None:
            return {token_id: f"token_id:{token_id}" for token_id in ids}
        texts = self.tokenizer.backend.decode_batch([[token_id] for token_id in ids],
                                                    skip_special_tokens=False)
        return dict(zip(ids, texts))


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
