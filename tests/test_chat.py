"""``LLM.chat`` and the prompt forms ``LLM.generate`` takes, as vLLM's offline API has them.

Conversations are rendered by the model's chat template; the rendered token ids must equal
those of transformers' ``AutoTokenizer.apply_chat_template`` over the same directory (neo-tiny
saved as a Hugging Face directory, its tokenizer and chat template included).
"""

import json
import os

import pytest
from transformers import AutoTokenizer

from neo import LLM, SamplingParams
from neo.models.tiny import save_tiny

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is neo?"},
     {"role": "assistant", "content": "an engine"}, {"role": "user", "content": "ünïcödé?"}],
]
OWN_TEMPLATE = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("neo-tiny"))
    save_tiny(directory)
    return directory


@pytest.fixture(scope="module")
def llm(saved_tiny):
    llm = LLM(saved_tiny, device="cpu", perf_model="zero")
    yield llm
    llm.close()


def copy_without(source: str, destination, file: str | None, drop_chat_template: bool = False) -> str:
    """A copy of a saved model directory without ``file`` (and its chat template, if asked)."""
    destination.mkdir()
    for name in os.listdir(source):
        if name == file:
            continue
        content = open(os.path.join(source, name), "rb").read()
        if name == "tokenizer_config.json" and drop_chat_template:
            config = json.loads(content)
            del config["chat_template"]
            content = json.dumps(config).encode()
        (destination / name).write_bytes(content)
    return str(destination)


def test_chat_renders_like_transformers_then_generates(llm, saved_tiny):
    hf_tokenizer = AutoTokenizer.from_pretrained(saved_tiny)
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    expected_ids = [list(hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])
                    for conversation in CONVERSATIONS]
    assert [output.prompt_token_ids for output in outputs] == expected_ids
    assert [output.prompt for output in outputs] == [
        hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        for conversation in CONVERSATIONS]
    plain = llm.generate(expected_ids, GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == [output.outputs[0].token_ids for output in plain]
    # One conversation, not in a list, gives one output.
    [single] = llm.chat(CONVERSATIONS[0], GREEDY)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_chat_template_and_generation_prompt_options(llm):
    [without_prompt] = llm.chat(CONVERSATIONS[0], GREEDY, add_generation_prompt=False)
    assert without_prompt.prompt == "<|begin_of_text|>user: hi\n"
    [own] = llm.chat(CONVERSATIONS[1], GREEDY, chat_template=OWN_TEMPLATE)
    assert own.prompt == "<system>be brief<user>what is neo?<assistant>an engine<user>ünïcödé?"
    assert own.prompt_token_ids == llm.get_tokenizer().encode(own.prompt, add_special_tokens=False)


def test_a_model_without_chat_template_or_tokenizer_is_refused(saved_tiny, tmp_path):
    no_template = LLM(copy_without(saved_tiny, tmp_path / "no-template", None, drop_chat_template=True),
                      device="cpu", perf_model="zero")
    try:
        with pytest.raises(ValueError, match="has no chat template .*pass chat_template="):
            no_template.chat(CONVERSATIONS[0], GREEDY)
        [output] = no_template.chat(CONVERSATIONS[0], GREEDY, chat_template=OWN_TEMPLATE)
        assert output.prompt == "<user>hi"
    finally:
        no_template.close()
    no_tokenizer = LLM(copy_without(saved_tiny, tmp_path / "no-tokenizer", "tokenizer.json"), device="cpu",
                       perf_model="zero")
    try:
        with pytest.raises(ValueError, match="has no tokenizer.json: chat needs a tokenizer"):
            no_tokenizer.chat(CONVERSATIONS[0], GREEDY, chat_template=OWN_TEMPLATE)
    finally:
        no_tokenizer.close()


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list of messages"),
    ([[]], "non-empty list of messages"),
    ([{"content": "no role"}], "message 0 must be a dict with a string \"role\""),
    ([{"role": "user", "content": "hi"}, "text"], "message 1 must be a dict"),
    ("hello", "non-empty list of messages"),
])
def test_bad_conversations_are_refused(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY)


def test_a_template_error_is_a_value_error(llm):
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template failed to render the conversation: roles must alternate"):
        llm.chat(CONVERSATIONS[0], GREEDY, chat_template=template)


def test_every_prompt_form_generates_the_same(llm):
    tokenizer = llm.get_tokenizer()
    text = "neo serves tokens"
    token_ids = tokenizer.encode(text)
    outputs = llm.generate([text, token_ids, {"prompt": text}, {"prompt_token_ids": token_ids}], GREEDY)
    assert len({tuple(output.outputs[0].token_ids) for output in outputs}) == 1
    assert [output.prompt for output in outputs] == [text, None, text, None]
    assert all(output.prompt_token_ids == token_ids for output in outputs)
    for single in (text, token_ids, {"prompt": text}, {"prompt_token_ids": token_ids}):
        [output] = llm.generate(single, GREEDY)
        assert output.outputs[0].token_ids == outputs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "multi_modal_data": {}}, "prompt dict key 'multi_modal_data' is not supported"),
    ({"prompt_token_ids": [1], "mm_processor_kwargs": {}}, "prompt dict key 'mm_processor_kwargs'"),
    ({}, "exactly one of \"prompt\".* got 0 keys"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of .* got 2 keys"),
    ({"prompt": 5}, "\"prompt\" must be a string, got int"),
    ({"prompt_token_ids": "12"}, "\"prompt_token_ids\" must be a list of token ids, got str"),
    ({"prompt_token_ids": [1, "2"]}, "a prompt must be a string or a list of integer token ids"),
])
def test_bad_prompt_dicts_are_refused_naming_the_key(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": "fine"}, prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()
