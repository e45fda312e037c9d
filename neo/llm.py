"""``LLM``: the front door, shaped like vLLM's offline API."""

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class GenerationError(RuntimeError):
    """Some requests of a ``generate`` call failed (finish reason "error"). ``outputs``: one
    per prompt, in order, the failed ones among them; ``failed``: those."""

    def __init__(self, outputs: list[RequestOutput], failed: list[RequestOutput]):
        reasons = "; ".join(f"request {output.request_id}: {output.error}" for output in failed[:3])
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed: {reasons}{more}")
        self.outputs = outputs
        self.failed = failed


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
        in order. A single prompt may be passed without a list.

        Raises ``ValueError`` for a rejected prompt or parameters (nothing is generated), and
        ``GenerationError`` (with every output) when the engine ended some requests because
        their work failed. On any exception, Ctrl-C included, this call's unfinished requests
        are aborted, so the engine is ready for the next call."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        request_ids = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(engine.add_request(prompt, params).request_id)
            with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm, unit="req") as progress:
                while len(results) < len(request_ids):
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            progress.update(1)
        except BaseException:  # a rejected prompt, a failure outside any request, Ctrl-C
            for request_id in request_ids:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        outputs = [results[request_id] for request_id in request_ids]
        failed = [output for output in outputs if output.error is not None]
        if failed:
            raise GenerationError(outputs, failed)
        return outputs

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """Cumulative engine counters (iterations, two-sub-batch iterations, prefill tokens,
        GPU and host decode tokens, blocks swapped out and in, ...)."""
        return self.engine.metrics.as_dict()

    def close(self) -> None:
        self.engine.close()
