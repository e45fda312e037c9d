"""Tensor-parallel models (``neo.models.parallel``) on 2 gloo ranks equal the one-rank model.

Each model runs the model tests' schedule (packed prefills, mixed prefill + decode steps,
decode steps over shuffled paged block tables, two sequences in the host cache decoded stage
by stage like the pipeline) on 2 spawned ranks; every step's logits must equal the one-rank
model's within float32 reduction-order rounding. Models: neo-tiny (built-in weights and dummy
weights), a sharded Qwen3 directory, Qwen2 (q/k/v biases) and Llama with o/MLP biases (the
row-parallel biases are added once). The dummy weights of a rank must be the one-rank dummy
weights sliced, and a model whose KV heads do not divide is refused with its numbers. The GPU
pool's activation measure runs on each rank with the rank's KV heads.
"""

import pytest
import torch

from model_harness import PagedKVHarness
from model_reference import BLOCK_SIZE, STEPS, assert_logits_close, make_sequences, save_variant
from neo import EngineConfig
from neo.kv.budget import prefill_probe
from neo.models.loader import load_model, resolve_model_config
from neo.models.parallel import TensorParallel, check_divisible, rank_config
from tensor_parallel_harness import run_ranks

import torch.distributed as dist

HOST_SEQUENCES = (1, 3)
# (name, model source, load_format): the source is a variant saved by the test or neo-tiny.
CASES = [("neo-tiny", "neo-tiny", "auto"), ("neo-tiny-dummy", "neo-tiny", "dummy"),
         ("qwen3", "qwen3", "auto"), ("qwen2", "qwen2", "auto"), ("llama-biases", "llama-biases", "auto")]


def schedule_logits(model) -> list[torch.Tensor]:
    """The float32 logits ``[T, vocab]`` of every step of the model tests' schedule."""
    prompts, continuations = make_sequences(model.config.vocab_size, seed=0)
    full = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    harness = PagedKVHarness(model.rank_config, num_blocks=40, block_size=BLOCK_SIZE, dtype=torch.float32)
    fed, logits = {}, []
    for prefilled, decoded in STEPS:
        prefills = [(i, "host" if i in HOST_SEQUENCES else "device", prompts[i]) for i in prefilled]
        gpu_decodes = [(i, full[i][fed[i]]) for i in decoded if i not in HOST_SEQUENCES]
        host_decodes = [(i, full[i][fed[i]]) for i in decoded if i in HOST_SEQUENCES]
        for i in prefilled:
            fed[i] = len(prompts[i])
        for i in decoded:
            fed[i] += 1
        logits.append(harness.run(model, prefills, gpu_decodes, host_decodes))
    return logits


def _load(source: str, load_format: str, directory, parallel: TensorParallel | None = None):
    model = source if source == "neo-tiny" else str(directory / source)
    return load_model(model, dtype=torch.float32, device="cpu", load_format=load_format, seed=7,
                      parallel=parallel)


def _rank_schedules(rank: int, size: int, directory) -> None:
    """On each rank: every case's schedule logits, and the dummy model's split weights."""
    parallel = TensorParallel(dist.group.WORLD)
    results = {}
    for name, source, load_format in CASES:
        model = _load(source, load_format, directory, parallel)
        results[name] = schedule_logits(model)
        if load_format == "dummy":
            layer = model.layers[0]
            results["dummy-weights"] = {"qkv": layer.qkv_proj_weight.clone(), "o": layer.o_proj_weight.clone(),
                                        "down": layer.down_proj_weight.clone(),
                                        "embed": model.embed_tokens_weight.clone()}
    torch.save(results, directory / f"rank{rank}.pt")


def _rank_prefill_probe(rank: int, size: int) -> None:
    """The GPU pool's activation measure runs the largest prefill against caches of the rank's
    KV heads (a cache of every head fails the attention's shape check)."""
    model = _load("neo-tiny", "dummy", None, TensorParallel(dist.group.WORLD))
    assert model.rank_config.num_kv_heads == model.config.num_kv_heads // size
    prefill_probe(model, EngineConfig(model="neo-tiny", device="cpu", max_num_batched_tokens=96, max_num_seqs=4),
                  torch.device("cpu"), max_model_len=40)


def test_the_activation_measure_runs_on_each_rank_with_its_kv_heads():
    run_ranks(_rank_prefill_probe, 2)


def _rank_side_group(rank: int, size: int) -> None:
    """Collectives inside ``on_side_group`` go over the side group, the group is restored after
    the block (also when it raises), and a side group of other ranks is refused."""
    side = dist.new_group(backend="gloo")
    only_first = dist.new_group(ranks=[0], backend="gloo")  # every rank takes part in making it
    parallel = TensorParallel(dist.group.WORLD, side)
    assert parallel.group is dist.group.WORLD and parallel.side_group is side
    with parallel.on_side_group():
        assert parallel.group is side
        summed = parallel.all_reduce(torch.full((3,), float(rank + 1)))
        gathered = parallel.gather_columns(torch.full((2, 1), float(rank)))
    assert parallel.group is dist.group.WORLD
    assert torch.equal(summed, torch.full((3,), float(sum(range(1, size + 1)))))
    assert torch.equal(gathered, torch.arange(size, dtype=torch.float32).expand(2, size))
    with pytest.raises(KeyError):
        with parallel.on_side_group():
            raise KeyError("inside the block")
    assert parallel.group is dist.group.WORLD
    assert TensorParallel(dist.group.WORLD).side_group is dist.group.WORLD  # no side group: the group serves
    if rank == 0:
        with pytest.raises(ValueError, match="the side group must hold the same ranks as the group: rank 0 of 2, "
                                             "but rank 0 of 1 there"):
            TensorParallel(dist.group.WORLD, only_first)


def test_collectives_beside_the_iterations_go_over_the_side_group():
    run_ranks(_rank_side_group, 2)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tensor_parallel")
    for _, source, _ in CASES:
        if source != "neo-tiny" and not (directory / source).exists():
            save_variant(source, directory / source)
    run_ranks(_rank_schedules, 2, directory)
    return directory, [torch.load(directory / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("name, source, load_format", CASES, ids=[case[0] for case in CASES])
def test_two_ranks_give_the_logits_of_one(two_rank_results, name, source, load_format):
    directory, ranks = two_rank_results
    expected = schedule_logits(_load(source, load_format, directory))
    for rank, results in enumerate(ranks):
        assert len(results[name]) == len(expected)
        for step, (actual, wanted) in enumerate(zip(results[name], expected)):
            assert_logits_close(actual, wanted, f"{name}, rank {rank}, step {step}")


def test_dummy_weights_of_a_rank_are_the_one_rank_weights_sliced(two_rank_results):
    directory, ranks = two_rank_results
    whole = _load("neo-tiny", "dummy", directory)
    config, layer = whole.config, whole.layers[0]
    q, kv = config.q_size // 2, config.kv_size // 2
    intermediate, vocab = config.intermediate_size // 2, config.vocab_size // 2
    for rank, results in enumerate(ranks):
        weights = results["dummy-weights"]
        qkv = layer.qkv_proj_weight
        expected_qkv = torch.cat([qkv[rank * q:(rank + 1) * q],
                                  qkv[config.q_size + rank * kv:config.q_size + (rank + 1) * kv],
                                  qkv[config.q_size + config.kv_size + rank * kv:
                                      config.q_size + config.kv_size + (rank + 1) * kv]])
        assert torch.equal(weights["qkv"], expected_qkv)
        assert torch.equal(weights["o"], layer.o_proj_weight[:, rank * q:(rank + 1) * q])
        assert torch.equal(weights["down"], layer.down_proj_weight[:, rank * intermediate:(rank + 1) * intermediate])
        assert torch.equal(weights["embed"], whole.embed_tokens_weight[rank * vocab:(rank + 1) * vocab])


def test_a_model_whose_kv_heads_do_not_divide_is_refused(tmp_path):
    save_variant("qwen3-tied-biases", tmp_path)
    config = resolve_model_config(str(tmp_path))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide num_key_value_heads 1 of "
                                         r".*\(num_attention_heads 4, num_key_value_heads 1, intermediate_size "
                                         r"128, vocab_size 88\); sizes that work: 1$"):
        rank_config(config, 2)


def test_the_rank_shapes():
    config = resolve_model_config("neo-tiny")
    shard = rank_config(config, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (4, 1, 320, 160)
    assert (shard.hidden_size, shard.head_dim) == (config.hidden_size, config.head_dim)
    assert rank_config(config, 1) is config
    with pytest.raises(ValueError, match="sizes that work: 1, 2$"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        check_divisible(config, 0)
