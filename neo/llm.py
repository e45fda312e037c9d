"""``LLM``: the front door, shaped like vLLM's offline API."""

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Load a model and generate, e.g.::

        llm = LLM(model="neo-tiny")
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
        print(outputs[0].outputs[0].text)

    Keyword arguments are ``EngineConfig`` fields (device, dtype, policy, gpu_kv_cache_gib,
    cpu_kv_cache_gib, block_size, max_num_seqs, max_num_batched_tokens, load_format, ...).
    """

    def __init__(self, model: str = "neo-tiny", **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); one output per prompt,
        in order. A single prompt may be passed without a list."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(engine.add_request(prompt, params).request_id)
        except ValueError:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm, unit="req")
        while len(results) < len(request_ids):
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
                    progress.update(1)
        progress.close()
        return [results[request_id] for request_id in request_ids]

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """Cumulative engine counters (iterations, two-sub-batch iterations, prefill tokens,
        GPU and host decode tokens, blocks swapped out and in, ...)."""
        return self.engine.metrics.as_dict()

    def close(self) -> None:
        self.engine.close()
