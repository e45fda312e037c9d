"""The stop rule: its incremental stop-string search against decoding the whole output at every
token (the rule it replaces), on neo-tiny's byte-level tokenizer, and the bounds on stop strings
and stop token ids.

neo-tiny's tokenizer has one token per byte, so every character of two or more UTF-8 bytes is
split across tokens and every stop string longer than one byte spans token boundaries.
"""

import random

import pytest

from neo import LLM, SamplingParams
from neo.engine.stop import StopRule
from neo.incremental_text import IncrementalText
from neo.request import Request
from neo.sampling_params import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from neo.tokenizer import Tokenizer

ALPHABET = "abcdefgh ij,.é日本🎉€\n"
NUM_BYTE_TOKENS = 256
VOCAB = 320  # 256 bytes and 64 special tokens (decoded as nothing)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.tiny()


def random_token_ids(rng: random.Random, tokenizer: Tokenizer, length: int) -> list[int]:
    """Text with multi-byte characters, as byte tokens, with special tokens and stray bytes
    (lone continuation bytes, cut-off lead bytes) mixed in."""
    text = "".join(rng.choice(ALPHABET) for _ in range(length))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(rng.randint(0, length // 8)):
        stray = rng.choice([rng.randrange(0x80, 0xC0), rng.randrange(0xC2, 0xF5),
                            rng.randrange(NUM_BYTE_TOKENS, VOCAB)])
        token_ids.insert(rng.randrange(len(token_ids) + 1), stray)
    return token_ids


def broken_utf8_token_ids(rng: random.Random, num_pieces: int) -> list[int]:
    """Long runs of bytes that never complete a character (lone continuation bytes, lead bytes,
    cut-off sequences), special tokens inside and between characters, and whole characters."""
    pieces = []
    for _ in range(num_pieces):
        kind = rng.randrange(5)
        if kind == 0:
            pieces += [rng.randrange(0x80, 0xC0) for _ in range(rng.randint(1, 20))]
        elif kind == 1:
            pieces += [rng.choice([0xC3, 0xE2, 0xF0]) for _ in range(rng.randint(1, 20))]
        elif kind == 2:
            encoded = list(rng.choice("é日🎉€").encode())
            pieces += encoded[:rng.randrange(1, len(encoded))]
        elif kind == 3:
            pieces += [rng.randrange(NUM_BYTE_TOKENS, VOCAB) for _ in range(rng.randint(1, 12))]
        else:
            encoded = list(rng.choice("aé日🎉€ ").encode())
            for _ in range(rng.randint(0, 2)):  # special tokens inside the character
                encoded.insert(rng.randrange(len(encoded) + 1), rng.randrange(NUM_BYTE_TOKENS, VOCAB))
            pieces += encoded
    return pieces


def random_stops(rng: random.Random, text: str) -> list[str]:
    """Pieces of ``text`` (some with U+FFFD where the text has one), and strings it lacks."""
    stops = []
    for _ in range(rng.randint(1, 4)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 12)])
        else:
            stops.append("".join(rng.choice(ALPHABET + "\ufffd") for _ in range(rng.randint(1, 6))))
    return stops


def full_decode_rule(tokenizer: Tokenizer, token_ids: list[int], stops: list[str]):
    """The rule the incremental search replaces: after each token, decode the whole output and
    stop at the first stop string found. Returns (tokens kept, cut text) or None."""
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:end])
        found = [position for position in (text.find(stop) for stop in stops) if position >= 0]
        if found:
            return end, text[:min(found)]
    return None


def incremental_rule(tokenizer: Tokenizer, token_ids: list[int], stops: list[str]):
    """The engine's ``StopRule`` over the same tokens, one ``update`` at a time; also checks that
    the incremental text equals the whole output's decode after every token."""
    rule = StopRule(frozenset(), tokenizer, max_model_len=10**9)
    request = Request("r", [1], SamplingParams(max_tokens=10**9, stop=stops, ignore_eos=True))
    for token in token_ids:
        request.append_token(token)
        reason = rule(request, token)
        assert request.incremental_text.text == tokenizer.decode(request.output_token_ids)
        if reason is not None:
            assert reason == "stop"
            return request.num_output_tokens, request.output_text
    return None


@pytest.mark.parametrize("source", ["text", "any-token", "broken-utf8"])
def test_incremental_search_equals_full_decode(source, seed, tokenizer):
    rng = random.Random(seed)
    stopped = 0
    for _ in range(300):
        if source == "text":
            token_ids = random_token_ids(rng, tokenizer, rng.randint(1, 80))
        elif source == "any-token":  # any token of the vocabulary: mostly invalid UTF-8
            token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 80))]
        else:
            token_ids = broken_utf8_token_ids(rng, rng.randint(1, 16))
        stops = random_stops(rng, tokenizer.decode(token_ids))
        expected = full_decode_rule(tokenizer, token_ids, stops)
        assert incremental_rule(tokenizer, token_ids, stops) == expected, (token_ids, stops)
        stopped += expected is not None
    assert stopped > 100  # most cases stop somewhere, many at a multi-byte or spanning stop


def test_stop_across_a_split_character_and_a_long_stop_string(tokenizer):
    # "é" is two tokens (C3 A9): a stop ending in it is found at its second token, one ending
    # in the U+FFFD its first token decodes to is found at the first (as the full decode does).
    token_ids = tokenizer.encode("xx café au lait", add_special_tokens=False)
    second = token_ids.index(0xA9)
    assert incremental_rule(tokenizer, token_ids, ["fé"]) == (second + 1, "xx ca")
    assert incremental_rule(tokenizer, token_ids, ["fé a"]) == (second + 3, "xx ca")
    assert incremental_rule(tokenizer, token_ids, ["f\ufffd"]) == (second, "xx ca")
    # A cut-off character (F0 9F 98 is one U+FFFD) in a run of bytes that never completes a
    # character: the run settles in parts, and the text stays that of decoding every token.
    token_ids = [0xE2] * 4 + [0xF0, 0x9F, 0x98] + [0xE2] * 20 + list("日".encode())
    assert incremental_rule(tokenizer, token_ids, ["\ufffd" * 25 + "日"]) == (len(token_ids), "")
    assert incremental_rule(tokenizer, token_ids, ["\ufffd" * 26]) == (len(token_ids) - 2, "")  # 日 begun
    assert incremental_rule(tokenizer, token_ids, ["\ufffd" * 27]) is None
    # A stop string as long as allowed, ending at the last token.
    rng = random.Random(1)
    text = "".join(rng.choice("abcdé日") for _ in range(300))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    stop = text[-MAX_STOP_STRING_LENGTH:]
    assert incremental_rule(tokenizer, token_ids, ["zz", stop]) == (len(token_ids), text[:-len(stop)])
    # The first stop string in the text wins, whichever is listed first.
    token_ids = tokenizer.encode("one two three", add_special_tokens=False)
    assert incremental_rule(tokenizer, token_ids, ["three", "e t"]) == (token_ids.index(ord("t")) + 1, "on")


def test_update_decodes_a_window_of_constant_size(tokenizer):
    """The work per token does not grow with the output: count the tokens each update hands to
    the real tokenizer's decode, for a short and a long output."""

    class CountingTokenizer:
        def __init__(self):
            self.decoded_tokens = 0

        def decode(self, token_ids):
            self.decoded_tokens += len(token_ids)
            return tokenizer.decode(token_ids)

    rng = random.Random(0)
    special_ids = StopRule(frozenset(), tokenizer, max_model_len=1).special_token_ids
    assert special_ids == frozenset(range(NUM_BYTE_TOKENS, VOCAB))
    per_token = []
    for length in (200, 4000):
        token_ids = random_token_ids(rng, tokenizer, length)
        counting = CountingTokenizer()
        text = IncrementalText(counting, MAX_STOP_STRING_LENGTH - 1, special_ids)
        longest_recent = 0
        for end in range(1, len(token_ids) + 1):
            start, recent = text.update(token_ids[:end])
            longest_recent = max(longest_recent, len(recent))
        assert text.text == tokenizer.decode(token_ids)
        per_token.append(counting.decoded_tokens / len(token_ids))
        # What a token's search covers: the overlap plus the few characters it added.
        assert longest_recent <= MAX_STOP_STRING_LENGTH - 1 + 8
    assert per_token[1] < per_token[0] * 1.5 and per_token[1] < 20, per_token
    # Outputs that never complete a character, or only special tokens, keep the window short too.
    for run in ([0x80], [0xE2], [0xE2, 0x82], [0xF0, 300, 0x9F, 301], [300]):
        counting = CountingTokenizer()
        text = IncrementalText(counting, 3, special_ids)
        token_ids = (run * 4000)[:4000]
        for end in range(1, len(token_ids) + 1):
            text.update(token_ids[:end])
        assert text.text == tokenizer.decode(token_ids)
        assert counting.decoded_tokens / len(token_ids) < 40, (run, counting.decoded_tokens)


def test_stop_token_ids_end_generation_at_once():
    rule = StopRule(frozenset({7}), None, max_model_len=100)
    request = Request("r", [1], SamplingParams(max_tokens=50, stop_token_ids=list(range(100, 1100))))
    assert request.stop_token_ids == frozenset(range(100, 1100))
    for token, expected in [(5, None), (7, "stop"), (99, None), (1099, "stop"), (1100, None)]:
        request.append_token(token)
        assert rule(request, token) == expected


def test_before_min_tokens_only_the_length_limits_end_a_request(tokenizer):
    """End-of-sequence and stop tokens end a request from its min_tokens-th token on; a stop
    string only when it ends in text added after that token, and one wholly inside the first
    min_tokens tokens' text is not found later."""
    rule = StopRule(frozenset({257}), tokenizer, max_model_len=100)
    params = SamplingParams(max_tokens=20, min_tokens=3, stop_token_ids=[300], stop=["ab"])
    request = Request("r", [1], params)
    assert rule.stop_ids_before_min_tokens(request) == frozenset({257, 300})
    assert rule.stop_ids_before_min_tokens(Request("r", [1], SamplingParams(ignore_eos=True, min_tokens=1,
                                                                            stop_token_ids=[5]))) == {5}
    assert rule.stop_ids_before_min_tokens(Request("r", [1], SamplingParams(stop_token_ids=[5]))) == frozenset()
    for token, expected in [(257, None), (300, None), (257, "stop")]:  # EOS as the third token counts
        request.append_token(token)
        assert rule(request, token) == expected
    request = Request("r", [1], params)
    for token in b"abc":  # "ab" within the first 3 tokens: not a stop, now or later
        request.append_token(token)
        assert rule(request, token) is None
    for token, expected in [(ord("d"), None), (ord("a"), None), (ord("b"), "stop")]:
        request.append_token(token)
        assert rule(request, token) == expected
    assert request.output_text == "abcd"


def test_engine_stops_where_the_full_decode_rule_does(seed):
    """End to end: greedy generation with stop strings taken from the free-running text."""
    rng = random.Random(seed)
    llm = LLM("neo-tiny", device="cpu", perf_model="zero")
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(4)]
        free_runs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        cases = []
        for prompt, free_run in zip(prompts, free_runs):
            token_ids = free_run.outputs[0].token_ids
            stops = random_stops(rng, free_run.outputs[0].text)
            cases.append((prompt, stops, full_decode_rule(tokenizer, token_ids, stops), token_ids))
        outputs = llm.generate([prompt for prompt, *_ in cases],
                               [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops)
                                for _, stops, *_ in cases])
        for (prompt, stops, expected, token_ids), output in zip(cases, outputs):
            completion = output.outputs[0]
            if expected is None:
                assert completion.finish_reason == "length" and completion.token_ids == token_ids
            else:
                kept, text = expected
                assert completion.finish_reason == "stop", stops
                assert completion.token_ids == token_ids[:kept] and completion.text == text
    finally:
        llm.close()


# -- bounds ----------------------------------------------------------------------------------------


def test_bounds_are_accepted_up_to_the_limit():
    params = SamplingParams(stop=["x" * MAX_STOP_STRING_LENGTH] * MAX_STOP_STRINGS,
                            stop_token_ids=[2**63 - 1] + list(range(MAX_STOP_TOKEN_IDS - 1)))
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize("options, message", [
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop holds 65 strings; at most 64"),
    (dict(stop=["b"] * 200_000), "stop holds 200000 strings; at most 64"),
    (dict(stop="x" * (MAX_STOP_STRING_LENGTH + 1)), "stop strings .* at most 256 characters.*of 257"),
    (dict(stop=["ok", "é" * 1000]), "stop strings .* at most 256 characters.*of 1000"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids holds 1025 ids; at most 1024"),
    (dict(stop_token_ids=[5, 2**63]), r"stop_token_ids .* below 2\*\*63, got 9223372036854775808"),
])
def test_bounds_are_refused_beyond_the_limit(options, message):
    with pytest.raises(ValueError, match=message) as error:
        SamplingParams(**options)
    assert len(str(error.value)) < 300  # the message does not echo the whole value
