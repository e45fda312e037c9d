"""``LLM``: the front door, shaped like vLLM's offline API."""

from jinja2.exceptions import TemplateError
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
        """Generate for each prompt; one output per prompt, in order, with
        ``SamplingParams.n`` completions each. A prompt is a string, a list of token ids, or
        vLLM's dict forms ``{"prompt": str}`` and ``{"prompt_token_ids": list[int]}``; a single
        prompt may be passed without a list.

        Raises ``ValueError`` for a rejected prompt or parameters (nothing is generated), and
        ``GenerationError`` (with every output) when the engine ended some requests because
        their work failed. On any exception, Ctrl-C included, this call's unfinished requests
        are aborted, so the engine is ready for the next call."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [prompt_of(prompt) for prompt in prompts]
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

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role": ..., "content": ...}``
        messages) or to each of a list of conversations; one output per conversation, whose
        ``prompt`` is the rendered conversation.

        Each conversation is rendered with ``chat_template`` (a Jinja template, as in Hugging
        Face's ``apply_chat_template``), else the model's own, then generated as in
        ``generate``. Raises ``ValueError`` when the model has no tokenizer, or no chat template
        and none is given, or a message or the template's rendering is bad."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.engine.config.model!r} has no tokenizer.json: chat needs a "
                             f"tokenizer to render messages; use generate with token ids")
        template = chat_template or tokenizer.chat_template
        if not template:
            raise ValueError(f"model {self.engine.config.model!r} has no chat template (tokenizer_config.json's "
                             f"chat_template or chat_template.jinja): pass chat_template=")
        conversations = [messages] if not messages or isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            check_conversation(conversation)
            try:
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt, chat_template=template)
            except TemplateError as error:
                raise ValueError(f"the chat template failed to render the conversation: {error}") from error
            prompts.append((text, tokenizer.encode(text, add_special_tokens=False)))
        outputs = self.generate([token_ids for _, token_ids in prompts], sampling_params, use_tqdm)
        for output, (text, _) in zip(outputs, prompts):
            output.prompt = text
        return outputs

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """Cumulative engine counters (iterations, two-sub-batch iterations, prefill tokens,
        GPU and host decode tokens, blocks swapped out and in, ...)."""
        return self.engine.metrics.as_dict()

    def start_profile(self) -> None:
        """Start recording a ``torch.profiler`` timeline on every rank (needs
        ``torch_profiler_dir``)."""
        self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop recording; returns each rank's trace file (Chrome trace), rank 0's first."""
        return self.engine.stop_profile()

    def close(self) -> None:
        self.engine.close()


def prompt_of(prompt) -> str | list[int]:
    """A string or a list of token ids from any prompt form ``LLM.generate`` takes (the dict
    forms unwrapped); other values go to the engine, which names what it accepts."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(str(key) for key in prompt if key not in ("prompt", "prompt_token_ids"))
    if unknown:
        raise ValueError(f"prompt dict key {unknown[0]!r} is not supported: a prompt dict holds "
                         f"\"prompt\" (a string) or \"prompt_token_ids\" (a list of token ids)")
    if len(prompt) != 1:
        raise ValueError("a prompt dict holds exactly one of \"prompt\" (a string) or \"prompt_token_ids\" "
                         f"(a list of token ids), got {len(prompt)} keys")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt dict key \"prompt\" must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    token_ids = prompt["prompt_token_ids"]
    if not isinstance(token_ids, list):
        raise ValueError(f"prompt dict key \"prompt_token_ids\" must be a list of token ids, got "
                         f"{type(token_ids).__name__}")
    return token_ids


def check_conversation(conversation) -> None:
    """A conversation is a list of dicts with a string "role" and a "content"."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {conversation!r:.80}")
    for position, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"message {position} must be a dict with a string \"role\" and a \"content\", "
                             f"got {message!r:.80}")
