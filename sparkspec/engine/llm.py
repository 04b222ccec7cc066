"""LLM: the offline API. `LLM(model=DIR, speculative="dspark").generate(prompts, SamplingParams(...))`.

`SamplingParams(n=3)` gives one `RequestOutput` per prompt whose `outputs` lists the 3 samples (vLLM's shape; its
top-level fields are sample 0's); `logprobs=N` / `prompt_logprobs=N` fill `RequestOutput.logprobs` (one
{token id: logprob} per output token) and `.prompt_logprobs` (None for the first prompt token).

Every tool that generates text offline (`sparkspec generate`, `sparkspec eval`, `train regenerate`, tests) goes
through this class or `LLMEngine` directly, so there is one generation path to keep exact. `build_llm` is the one
way the command-line tools (`generate`, `serve`, `bench offline`) build it from their flags, for one process or
several (tensor parallel).
"""

from __future__ import annotations

from pathlib import Path

from sparkspec.engine.config import EngineConfig, apply_batch_invariant
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.outputs import RequestOutput
from sparkspec.sampling_params import SamplingParams


def default_spec_method(checkpoint) -> str:
    """`speculative="auto"`: DSpark when the checkpoint ships it (the method this project is about), else none."""
    return "dspark" if checkpoint.has_dspark_weights else "none"


class LLM:
    def __init__(self, model, speculative: str = "none", num_spec_tokens: int | None = None,
                 spec_budget: str = "adaptive", device: str | None = None, dtype: str | None = None,
                 parallel=None, expert_parallel: bool = False, **engine_kw):
        """`model`: a checkpoint directory, or a `LoadedCheckpoint` already in memory (several engines can then
        share one model); `speculative`: none | dspark | mtp | ngram | auto; `parallel`: this process's
        `distributed.ParallelGroup` when the model is sharded over several (see `engine/lockstep.py`);
        other keywords go to `EngineConfig` (max_num_seqs, max_num_batched_tokens, max_model_len,
        kv_cache_memory, block_size, batch_invariant, ...)."""
        if isinstance(model, (str, Path)):
            from sparkspec.loading.checkpoint import load_checkpoint

            model = load_checkpoint(model, device=device, dtype=dtype)
        self.checkpoint = model
        self.parallel = parallel
        self.method = default_spec_method(model) if speculative == "auto" else speculative
        engine_kw.setdefault("max_waiting", 1 << 20)
        if parallel is not None and parallel.world_size > 1:
            engine_kw.update(parallel_engine_kwargs(parallel, self.method, spec_budget))
        config = EngineConfig(speculative=self.method, num_spec_tokens=num_spec_tokens, spec_budget=spec_budget,
                              **engine_kw)
        apply_batch_invariant(config)  # process-wide, on before the engine runs or captures a graph
        engine_cls, extra = LLMEngine, {}
        if parallel is not None and parallel.world_size > 1:
            from sparkspec.distributed.tensor_parallel import shard_
            from sparkspec.engine.lockstep import DistributedLLMEngine

            if getattr(model.model, "shard_cuts", None) is None:  # a sharded load has done it already
                shard_(model.model, parallel, expert_parallel)
            if parallel.rank == 0:
                engine_cls, extra = DistributedLLMEngine, {"pg": parallel}
        self.engine = engine_cls(model.model, model.tokenizer, config, model.drafter_tensors, **extra)

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer

    @property
    def num_spec_tokens(self) -> int:
        """Drafts per step the engine plans at most (0 without speculation)."""
        return self.engine.spec.num_spec_tokens if self.engine.spec is not None else 0

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are text (tokenised with BOS) or token-id lists; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), sampling_params or SamplingParams())

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this checkpoint has no tokenizer")
        ids = tok.encode_chat(messages)  # special-token text in a message stays text, as in the server
        return self.engine.generate([ids], sampling_params or SamplingParams())[0]

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine, when done: stop the other ranks and leave the group. Nothing to do
        for one process."""
        if self.parallel is not None and self.parallel.world_size > 1 and self.parallel.rank == 0:
            from sparkspec.engine.lockstep import finish

            finish(self.engine)


SERVING_GC_GEN0 = 50_000  # container allocations between young collections while serving (CPython: 700)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive (the model, tokenizer, captured graphs, tables: ~10^5 objects
    that live as long as the engine) into the cyclic collector's permanent generation, as vLLM does once its engine
    has started, and collect the young generation every `SERVING_GC_GEN0` container allocations instead of
    CPython's 700. Full collections then scan only what serving allocates: at c = 256 on the demo pair one full
    collection of the start-up heap took ~48 ms on a 2-core CPU, inside a level of ~130 steps. And a step at
    c = 256 allocates ~1,300 containers (the scheduler's items, the step's lists, the outputs), nearly all freed by
    their reference counts within the step; at 700 a young collection ran about twice a step, and on the H200 demo
    pair the collector took 210-380 us of a 3.2-5.5 ms host step (`bench offline --profile-host`'s gc column). The
    two older generations keep their thresholds (counted in young collections, so they run as much less often).
    Call it once the engine is built and warm (the servers and `bench offline` do). Frozen objects are never
    collected while frozen: a process that drops an engine and builds another calls `gc.unfreeze()` before it
    collects (`bench offline`'s `release`). -> objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, SERVING_GC_GEN0), middle, old)
    return gc.get_freeze_count()


def build_llm(model, tensor_parallel_size: int = 1, device: str | None = None, dtype: str | None = None,
              quantization: str = "auto", expert_parallel: bool = False, progress: bool = True,
              **llm_kwargs) -> LLM:
    """The engine from the command-line flags' values, for one process or `tensor_parallel_size` of them.

    One process: load `model` (a directory; or a `LoadedCheckpoint`, which several engines may share) and build
    the `LLM`. N processes: start ranks 1..N-1 (each loads its own slices, builds the same engine and follows
    rank 0: `run_rank`), then load rank 0's slices here; `llm.engine` is then the `DistributedLLMEngine` that
    drives them, and `llm.close()` stops them. `llm_kwargs` are `LLM`'s: speculative (auto: dspark when the
    checkpoint has its weights), num_spec_tokens, spec_budget, and `EngineConfig`'s fields."""
    from sparkspec.loading.checkpoint import load_checkpoint

    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size}: expected a positive integer")
    if tensor_parallel_size == 1:
        if isinstance(model, (str, Path)):
            model = load_checkpoint(model, device=device, dtype=dtype, progress=progress, quantization=quantization)
        return LLM(model, **llm_kwargs)
    if not isinstance(model, (str, Path)):
        raise ValueError("a tensor-parallel engine loads its checkpoint on every rank: pass its directory")
    from sparkspec.engine.lockstep import finish, launch, rank_device

    spec = llm_kwargs.get("speculative", "none")  # bad flags fail here, before any process starts
    EngineConfig(**{"max_waiting": 1 << 20, **llm_kwargs, "speculative": "none" if spec == "auto" else spec})
    llm_kwargs = {**llm_kwargs, "expert_parallel": expert_parallel}
    rank0 = rank_device(0, device)
    pg = launch(tensor_parallel_size, run_rank, (str(model), device, dtype, llm_kwargs, quantization), rank0)
    ckpt = load_checkpoint(model, device=rank0, dtype=dtype, progress=progress, parallel=pg,
                           expert_parallel=expert_parallel, quantization=quantization)
    try:
        return LLM(ckpt, parallel=pg, **llm_kwargs)
    except BaseException:  # the other ranks are waiting for this one: stop them before the error goes up
        finish(None)
        raise


def parallel_engine_kwargs(pg, speculative: str, spec_budget: str) -> dict:
    """What a rank of a tensor-parallel engine changes in its `EngineConfig`:
    * graphs only where the collectives can be captured (NCCL / RCCL); gloo runs eagerly. Every rank captures
      the same shapes in the same order, since rank 0 broadcasts the steps;
    * the adaptive budget's cost table is measured afresh by every rank (in lockstep: measuring runs sharded
      forwards) and rank 0's is then used by all (`engine.lockstep.sync_budget`); a cached table could exist
      on one rank and not another, and then only one of them would run the measuring forwards."""
    import tempfile

    import torch.distributed as dist

    out = {}
    if dist.get_backend(pg.group) != "nccl":
        out["enforce_eager"] = True
    if speculative != "none" and spec_budget == "adaptive":
        out["cost_cache_dir"] = tempfile.mkdtemp(prefix=f"sparkspec-costs-rank{pg.rank}-")
    return out


def run_rank(pg, model_path: str, device: str | None, dtype: str | None, llm_kwargs: dict,
             quantization: str = "auto") -> None:
    """Ranks 1.. of a tensor-parallel run: load this rank's slices only, build the same engine as rank 0, then
    follow it."""
    from sparkspec.engine.lockstep import rank_device, worker_loop
    from sparkspec.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model_path, device=rank_device(pg.rank, device), dtype=dtype, parallel=pg,
                           expert_parallel=llm_kwargs.get("expert_parallel", False), quantization=quantization)
    worker_loop(LLM(ckpt, parallel=pg, **llm_kwargs).engine, pg)
