"""The README's examples run as written: each code block is read from README.md (so the text and
the test cannot drift) and run in a fresh interpreter."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_TIMEOUT_SECONDS = 300


def readme_block(marker: str) -> str:
    """The fenced block that follows the line ``<!-- marker -->`` in README.md."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    start = lines.index(f"<!-- {marker} -->") + 1
    assert lines[start].startswith("```"), f"no code block after <!-- {marker} -->"
    end = next(index for index in range(start + 1, len(lines)) if lines[index].startswith("```"))
    return "\n".join(lines[start + 1:end]) + "\n"


def test_the_offloading_example_decodes_on_the_host():
    code = readme_block("example:offload")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=EXAMPLE_TIMEOUT_SECONDS)
    assert result.returncode == 0, result.stderr
    counters = ast.literal_eval(result.stdout.splitlines()[-1])
    assert counters["host_decode_tokens"] > 0 and counters["host_batches"] > 0, counters
    assert counters["gpu_decode_tokens"] > 0, counters
    assert counters["host_decode_tokens"] + counters["gpu_decode_tokens"] == 32 * 63  # the first token is the prefill's
