"""Time per token of the stop-string check, by output length.

Feeds one request's output tokens to the engine's ``StopRule`` one at a time (as the scheduler
does after each sampled token) and reports the mean time per token over outputs of several
lengths, next to the rule that decodes the whole output and searches all of it at every token.
The output is random text with multi-byte characters, as neo-tiny's byte tokens; the stop
strings never occur in it, so every token is checked. Each figure is the best of ``--repeats``
runs, after one run to warm up.

    python benchmarks/stop_check.py [--lengths 200,2000,20000] [--stops 4] [--stop-length 8]
        [--repeats 3]
"""

import argparse
import random
import time

from neo import SamplingParams
from neo.engine.stop import StopRule
from neo.request import Request
from neo.tokenizer import Tokenizer


def incremental_seconds(tokenizer: Tokenizer, token_ids: list[int], stops: list[str]) -> float:
    rule = StopRule(frozenset(), tokenizer, max_model_len=10**9)
    request = Request("bench", [1], SamplingParams(max_tokens=10**9, stop=stops, ignore_eos=True))
    start = time.perf_counter()
    for token in token_ids:
        request.append_token(token)
        assert rule(request, token) is None
    return time.perf_counter() - start


def full_decode_seconds(tokenizer: Tokenizer, token_ids: list[int], stops: list[str]) -> float:
    start = time.perf_counter()
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:end])
        assert not any(stop in text for stop in stops)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="200,2000,20000", help="output lengths in tokens")
    parser.add_argument("--stops", type=int, default=4, help="number of stop strings")
    parser.add_argument("--stop-length", type=int, default=8, help="characters per stop string")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the best is shown)")
    parser.add_argument("--full-decode-limit", type=int, default=20000,
                        help="longest output to time the full-decode rule on (it is quadratic)")
    args = parser.parse_args()
    tokenizer = Tokenizer.tiny()
    rng = random.Random(0)
    stops = ["#" * (args.stop_length - 1) + str(index % 10) for index in range(args.stops)]
    print(f"{args.stops} stop strings of {args.stop_length} characters; microseconds per token")
    print(f"{'tokens':>8} {'incremental':>12} {'full decode':>12}")
    for length in map(int, args.lengths.split(",")):
        text = "".join(rng.choice("abcdefgh ij,.é日本🎉") for _ in range(length))
        token_ids = tokenizer.encode(text, add_special_tokens=False)[:length]

        def microseconds_per_token(rule) -> float:
            rule(tokenizer, token_ids, stops)  # warm-up
            return min(rule(tokenizer, token_ids, stops) for _ in range(args.repeats)) / length * 1e6

        incremental = microseconds_per_token(incremental_seconds)
        full = (f"{microseconds_per_token(full_decode_seconds):12.1f}" if length <= args.full_decode_limit
                else f"{'-':>12}")
        print(f"{length:>8} {incremental:12.1f} {full}")


if __name__ == "__main__":
    main()
