"""The offline benchmark (``neo bench``) on neo-tiny on the CPU: the headline is end to end
over the run to completion, the steady window second, then how long the first and last 10% of
the output tokens took; a time limit says so in the headline; the progress bar counts output
tokens."""

import pytest

from neo.bench import run_offline_benchmark
from neo.bench.offline import head_and_tail_seconds
from neo.config import EngineConfig

CONFIG = EngineConfig(model="neo-tiny", device="cpu", gpu_kv_cache_gib=0.01, cpu_kv_cache_gib=0.01,
                      max_num_seqs=16)


def test_headline_is_end_to_end_and_the_bar_counts_output_tokens(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    lengths = [(12, 5), (30, 9), (7, 1), (20, 14)]
    path.write_text("".join(f'{{"prompt_len": {prompt}, "output_len": {output}}}\n' for prompt, output in lengths))
    result = run_offline_benchmark(CONFIG, f"file:{path}", 100, show_progress=True)
    outputs = sum(output for _, output in lengths)
    assert result["num_requests"] == result["finished_requests"] == 4 and not result["cut_short"]
    assert result["output_tokens_per_s"] == pytest.approx(outputs / result["elapsed_s"])
    assert result["total_tokens_per_s"] == pytest.approx((outputs + 69) / result["elapsed_s"])
    lines = result["summary"].splitlines()
    assert lines[1].startswith("  end to end, every request run to completion in ")
    assert f"{result['output_tokens_per_s']:.1f} output tokens/s" in lines[1]
    assert lines[2].startswith("  steady window (between 10% and 90% of the output tokens): ")
    head, tail = result["head_and_tail_s"]
    assert 0 < head <= result["elapsed_s"] and 0 <= tail <= result["elapsed_s"]
    assert lines[3] == f"  first 10% of the output tokens in {head:.2f} s, last 10% in {tail:.2f} s"
    bar = capsys.readouterr().err
    assert f"{outputs}/{outputs}" in bar and "tok" in bar and "0/4 " not in bar


def test_time_limit_is_named_in_the_headline():
    result = run_offline_benchmark(CONFIG, "synthetic:input=20,output=4000", 3, show_progress=False,
                                   duration=0.5)
    assert result["cut_short"] and result["finished_requests"] == 0
    assert result["summary"].splitlines()[1].startswith("  cut short at the time limit after ")
    assert "0 of 3 requests finished" in result["summary"]
    assert result["summary"].splitlines()[2].startswith("  steady window (from 20% of the run to its end)")
    assert result["head_and_tail_s"] is None and "first 10%" not in result["summary"]
    # Prompts processed count even though no request finished.
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"] > 0


@pytest.mark.parametrize("duration", [0.0, -1.0])
def test_duration_must_be_positive(duration):
    with pytest.raises(ValueError, match=f"duration must be > 0 seconds, got {duration}"):
        run_offline_benchmark(CONFIG, "synthetic:input=20,output=4", 3, duration=duration)


def test_head_and_tail_come_from_the_token_log():
    # (seconds, cumulative output tokens): 10 of 100 tokens by 2 s, 90 by 7 s, the last at 10 s.
    log = [(1.0, 5), (2.0, 10), (5.0, 50), (7.0, 90), (8.0, 95), (10.0, 100)]
    assert head_and_tail_seconds(log, cut_short=False) == (2.0, 3.0)
    assert head_and_tail_seconds(log, cut_short=True) is None
    assert head_and_tail_seconds([], cut_short=False) is None
    assert head_and_tail_seconds([(1.0, 0)], cut_short=False) is None
