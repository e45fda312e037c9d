"""``Scenario``: a model, a machine, a workload and the policies to compare on them; and
``run_scenario``, which simulates each policy (``neo.sim.simulator``) on the stage times
synthesized for the machine (``neo.sim.stage_times``) or measured on it (``profile``)."""

from dataclasses import dataclass, replace

from neo.bench.workloads import parse_workload
from neo.config import POLICIES, EngineConfig
from neo.models.loader import resolve_model_config
from neo.models.parallel import rank_config
from neo.sched.perf_model import PerfTable

from .hardware import Hardware
from .parts import cache_layout
from .simulator import Simulation, SimulationResult
from .stage_times import synthesize_table

# How the requests of a workload reach the engine: "at-once", all at the start as `neo bench`
# submits them (an offline run); "trace", at the workload's arrival times where it has them.
ARRIVALS = ("at-once", "trace")


@dataclass
class Scenario:
    """What to simulate. ``profile``: a ``neo profile`` table (JSON) instead of synthesized
    stage times; ``duration``: stop each run after that many simulated seconds.
    ``tensor_parallel_size``: the model split over that many GPUs of ``hardware`` (each with its
    own pools of ``gpu_kv_cache_gib`` and ``cpu_kv_cache_gib``, as the engine's settings are per
    rank). The ranks run the same plans in lockstep, so one rank is simulated, with its shapes
    (``neo.models.parallel.rank_config``) and a profile measured on a rank of that many (its
    stage times hold the collectives, which synthesized stage times do not model).
    ``arrivals``: one of ``ARRIVALS``; with "at-once" a trace's arrival times are dropped, so the
    prediction is of what `neo bench` measures on the same workload. ``planning_profile``: a
    ``neo profile`` table the offloading policies' scheduler plans with, while the simulated time
    follows ``profile`` (or the synthesized table): what a profile that is off costs, e.g. one
    measured while something else held the host, or on another machine."""

    model: str
    hardware: Hardware
    workload: str
    num_requests: int
    policies: tuple[str, ...] = ("gpu-only", "neo")
    host_pipeline: str = "async"
    stage_order: str = "asymmetric"
    host_batch_order: str = EngineConfig.host_batch_order
    placement: str | None = None
    return_order: str = EngineConfig.return_order
    gpu_kv_cache_gib: float | None = None
    cpu_kv_cache_gib: float | None = None  # None: half the host's memory, shared by the ranks
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    profile: str | None = None
    duration: float | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    arrivals: str = "at-once"
    planning_profile: str | None = None

    def engine_config(self, policy: str) -> EngineConfig:
        """The engine settings of ``policy`` in this scenario (validated as the engine's)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        cpu_gib = (self.cpu_kv_cache_gib if self.cpu_kv_cache_gib is not None
                   else self.hardware.host_memory_gib / 2 / self.tensor_parallel_size)
        return EngineConfig(model=self.model, policy=policy, host_pipeline=self.host_pipeline,
                            stage_order=self.stage_order, host_batch_order=self.host_batch_order,
                            placement=self.placement,
                            return_order=self.return_order, gpu_kv_cache_gib=self.gpu_kv_cache_gib,
                            cpu_kv_cache_gib=float(cpu_gib),
                            max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization,
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, dtype=self.hardware.dtype,
                            seed=self.seed, tensor_parallel_size=self.tensor_parallel_size)


def load_profile(path: str, scenario: Scenario) -> PerfTable:
    """A measured profile, which must have been measured on as many ranks as the scenario has."""
    table = PerfTable.load(path)
    measured_on = table.key.get("tensor_parallel_size", 1)
    if measured_on != scenario.tensor_parallel_size:
        raise ValueError(f"the profile {path} was measured on a rank of {measured_on}, the "
                         f"scenario has tensor_parallel_size={scenario.tensor_parallel_size}")
    return table


def stage_table(scenario: Scenario, config: EngineConfig, max_model_len: int) -> PerfTable:
    """The measured profile, or the table synthesized for the scenario's pools and limits."""
    if scenario.profile is not None:
        return load_profile(scenario.profile, scenario)
    if scenario.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={scenario.tensor_parallel_size} needs a profile measured on a "
                         f"rank of that many (`neo profile --tensor-parallel-size "
                         f"{scenario.tensor_parallel_size}`): synthesized stage times leave out the collectives")
    model = resolve_model_config(scenario.model)
    layout = cache_layout(config, model, scenario.hardware)
    pool_tokens = max(layout.num_gpu_blocks, layout.num_host_blocks) * config.block_size
    return synthesize_table(model, scenario.hardware, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                            pool_tokens=pool_tokens, block_size=config.block_size)


def run_scenario(scenario: Scenario, show_progress: bool = False, on_iteration=None) -> list[SimulationResult]:
    """One result per policy, in ``scenario.policies`` order. ``on_iteration(plan, seconds)``
    (optional) sees every simulated plan."""
    if scenario.num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {scenario.num_requests}")
    if scenario.duration is not None and not scenario.duration > 0:
        raise ValueError(f"duration must be > 0 simulated seconds, got {scenario.duration}")
    if scenario.arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {scenario.arrivals!r}; choose from {', '.join(ARRIVALS)}")
    model = rank_config(resolve_model_config(scenario.model), scenario.tensor_parallel_size)
    max_model_len = min(scenario.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    workload = parse_workload(scenario.workload, scenario.num_requests, seed=scenario.seed)
    if scenario.arrivals == "at-once":
        workload = [replace(item, arrival_offset=None) for item in workload]
    planning_table = None if scenario.planning_profile is None else load_profile(scenario.planning_profile, scenario)
    results = []
    for policy in scenario.policies:
        config = scenario.engine_config(policy)
        table = stage_table(scenario, config, max_model_len)
        simulation = Simulation(config, model, scenario.hardware, table, max_model_len, on_iteration, planning_table)
        results.append(simulation.run(workload, scenario.duration, show_progress))
    return results
