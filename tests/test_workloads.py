"""Benchmark workloads: synthetic, the bundled Azure trace, and trace files (CSV / JSONL) with
every rule a bad file can break reported with its file and line."""

import json

import pytest

from neo.bench.workloads import WorkloadRequest, parse_workload

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_synthetic_lengths_stay_within_ten_percent():
    requests = parse_workload("synthetic:input=1000,output=300", 200, seed=3)
    assert len(requests) == 200
    assert all(900 <= item.prompt_len <= 1100 and 270 <= item.output_len <= 330 for item in requests)
    assert all(item.arrival_offset is None for item in requests)
    assert requests == parse_workload("synthetic:input=1000,output=300", 200, seed=3)


def test_bundled_trace_starts_at_zero_with_rising_arrivals():
    requests = parse_workload("azure-code", 50)
    assert requests[0] == WorkloadRequest(4808, 10, 0.0)
    offsets = [item.arrival_offset for item in requests]
    assert offsets == sorted(offsets) and offsets[1] == pytest.approx(0.052, abs=1e-6)


def test_csv_file_in_the_azure_format_matches_the_bundled_trace(tmp_path):
    rows = ["2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,8",
            "2023-11-16 18:17:04.0781490,110,27"]
    path = write(tmp_path, "trace.csv", AZURE_HEADER + "\n".join(rows) + "\n")
    assert parse_workload(f"file:{path}", 10) == parse_workload("azure-code", 3)


def test_csv_file_with_numeric_times_extra_columns_and_no_times(tmp_path):
    path = write(tmp_path, "seconds.CSV", "GeneratedTokens,TIMESTAMP,ContextTokens,note\n"
                                           "5,10.5,100,a\n7,10.5,200,b\n1,12,3,c\n")
    assert parse_workload(f"file:{path}", 2) == [WorkloadRequest(100, 5, 0.0), WorkloadRequest(200, 7, 0.0)]
    path = write(tmp_path, "lengths.csv", "ContextTokens,GeneratedTokens\n100,5\n200,7\n")
    assert parse_workload(f"file:{path}", 5) == [WorkloadRequest(100, 5), WorkloadRequest(200, 7)]


def test_jsonl_file_takes_all_when_fewer_than_asked(tmp_path):
    lines = [{"prompt_len": 10, "output_len": 3, "arrival_s": 100.0, "prompt": "ignored"},
             {"prompt_len": 20, "output_len": 1, "arrival_s": 100.25}, {}]
    text = "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
    path = write(tmp_path, "trace.jsonl", text)
    assert parse_workload(f"file:{path}", 1000) == [WorkloadRequest(10, 3, 0.0), WorkloadRequest(20, 1, 0.25)]
    assert parse_workload(f"file:{path}", 1) == [WorkloadRequest(10, 3, 0.0)]
    path = write(tmp_path, "untimed.jsonl", '{"prompt_len": 4, "output_len": 2}\n')
    assert parse_workload(f"file:{path}", 3) == [WorkloadRequest(4, 2)]


BAD_CSV = {
    "missing column": ("TIMESTAMP,ContextTokens\n1,2\n", "line 1", "GeneratedTokens"),
    "empty cell": ("ContextTokens,GeneratedTokens\n10,5\n10,\n", "line 3", "GeneratedTokens"),
    "short row": ("ContextTokens,GeneratedTokens\n10\n", "line 2", "GeneratedTokens"),
    "non-integer": ("ContextTokens,GeneratedTokens\n10,5\n10.5,5\n", "line 3", "'10.5'"),
    "zero output": ("ContextTokens,GeneratedTokens\n10,0\n", "line 2", "GeneratedTokens must be >= 1, got 0"),
    "negative prompt": ("ContextTokens,GeneratedTokens\n-3,4\n", "line 2", "ContextTokens must be >= 1"),
    "bad time": (AZURE_HEADER + "yesterday,10,5\n", "line 2", "TIMESTAMP"),
    "decreasing times": (AZURE_HEADER + "5,10,5\n6,10,5\n5.5,10,5\n", "line 4", "must not decrease"),
    "header only": ("ContextTokens,GeneratedTokens\n", "", "holds no request"),
    "empty": ("", "", "empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_CSV))
def test_bad_csv_file_names_the_file_and_line(case, tmp_path):
    text, line, problem = BAD_CSV[case]
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(ValueError) as error:
        parse_workload(f"file:{path}", 10)
    message = str(error.value)
    assert path in message and line in message and problem in message, message


BAD_JSONL = {
    "not json": ('{"prompt_len": 1, "output_len": 1}\n{prompt_len\n', "line 2", "not JSON"),
    "not an object": ("[1, 2]\n", "line 1", "JSON object"),
    "missing key": ('{"prompt_len": 5}\n', "line 1", "output_len"),
    "float length": ('{"prompt_len": 5.0, "output_len": 2}\n', "line 1", "prompt_len must be an integer"),
    "boolean length": ('{"prompt_len": 5, "output_len": true}\n', "line 1", "output_len must be an integer"),
    "zero prompt": ('\n{"prompt_len": 0, "output_len": 2}\n', "line 2", "prompt_len must be >= 1"),
    "text time": ('{"prompt_len": 5, "output_len": 2, "arrival_s": "soon"}\n', "line 1", "arrival_s"),
    "times on some lines": ('{"prompt_len": 5, "output_len": 2, "arrival_s": 1}\n'
                            '{"prompt_len": 5, "output_len": 2}\n', "line 2", "every request or for none"),
    "decreasing times": ('{"prompt_len": 5, "output_len": 2, "arrival_s": 3}\n'
                         '{"prompt_len": 5, "output_len": 2, "arrival_s": 2.5}\n', "line 2", "must not decrease"),
    "blank": ("\n\n", "", "holds no request"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_jsonl_file_names_the_file_and_line(case, tmp_path):
    text, line, problem = BAD_JSONL[case]
    path = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(ValueError) as error:
        parse_workload(f"file:{path}", 10)
    message = str(error.value)
    assert path in message and line in message and problem in message, message


@pytest.mark.parametrize("spec, problem", [
    ("file:", "needs a path"),
    ("file:requests.txt", "unknown extension '.txt'"),
    ("file:/nonexistent/requests.jsonl", "cannot read it"),
    ("trace:x.csv", "unknown workload 'trace:x.csv'"),
    ("synthetic:input=10", "needs both input=N and output=M"),
    ("azure-code:3", "takes no arguments"),
])
def test_bad_workload_spec_is_a_value_error(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_workload(spec, 5)


def test_file_that_is_not_utf8_is_a_value_error(tmp_path):
    path = tmp_path / "binary.csv"
    path.write_bytes(b"ContextTokens,GeneratedTokens\n\xff\xfe,1\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_workload(f"file:{path}", 5)
