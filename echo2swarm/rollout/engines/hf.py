"""Transformers engine: the CPU (and plain-CUDA) fallback behind the :class:`Engine` protocol.

    prompts ─► tokenize ─► rows = prompt × n ─► sub-batches of ≤ max_batch_sequences rows
        └─► prefill each distinct prompt once (left-padded, last-position logits only)
            ─► fan the KV cache out to the n rows of its group
            ─► decode loop with a DynamicCache:
                 sample (temperature, top-p; the lease's seeded sampler, or a local torch.Generator)
                 ─► record token + logprob
                 ─► finished rows are dropped from the batch once enough of them pile up

A hand-written loop rather than ``model.generate``: the behaviour logprob has one exact
definition here (see ``base.py``: under the temperature-scaled nucleus, renormalised), there is
no logits-processor stack to second-guess, and the per-step overhead is a single forward call.
Memory is bounded by ``max_batch_sequences``; the caller applies back-pressure by how much it
asks for at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from echo2swarm.config.rl import DEFAULT_MAX_BATCH_SEQUENCES
from echo2swarm.models.kv_cache import kv_cache
from echo2swarm.rollout.engines.base import SEEDED_SAMPLERS, Completion, SamplingParams, encode_prompts
from echo2swarm.runtime.devices import resolve_device
from echo2swarm.runtime.logging import get_logger
from echo2swarm.train.sampling import gumbel_noise, sample_seeded, seeded_choice

logger = get_logger(__name__)

__all__ = ["TransformersEngine"]

# Rebuild the batch without finished rows once at least this fraction of the rows is finished:
# compacting copies the whole KV cache, so doing it for every single EOS costs more than it saves.
_COMPACT_FRACTION = 0.25


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Use ``threads`` intra-op threads for the duration, then restore the process setting."""
    if threads is None or threads == torch.get_num_threads():
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class TransformersEngine:
    """Batched sampling with a KV cache on a Hugging Face causal LM.

    Example::

        engine = TransformersEngine(Path("models/tiny"), threads=2)
        groups = engine.generate(["12+3=", "7+8="], SamplingParams(n=8, max_new_tokens=6, seed=1))
        seconds = engine.load_weights(Path("policy/v2"))   # same model object, new weights
        engine.close()
    """

    name = "transformers"

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        threads: int | None = None,
        max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES,
        dtype: torch.dtype | None = None,
    ):
        """
        Args:
            model_dir: an HF model directory (config, tokenizer, ``*.safetensors``).
            device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (cuda when visible, else cpu).
            threads: torch intra-op threads while generating or loading; None leaves the
                process setting alone.
            max_batch_sequences: most rows (prompt × sample) in one forward batch.
            dtype: parameter dtype; None means float32 on CPU and the checkpoint's dtype elsewhere.
        """
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device, setting="engine.device (--device)")
        self.threads = threads
        self.max_batch_sequences = max_batch_sequences
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else "auto"
        with _torch_threads(threads):
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        # sha256 of every tensor the model holds, from the signed manifest beside the version directory
        # (policy/manifest.py); a delta version then refits only the tensors whose hash changed
        self._hashes: dict[str, str] | None = signed_tensor_hashes(self.model_dir)
        self.last_refit_tensors: int | None = None  # tensors copied by the last load_weights
        self._eos_ids = self._find_eos_ids()
        self._eos_tensor = torch.tensor(sorted(self._eos_ids), dtype=torch.long, device=self.device)
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids)
        self._max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        logger.info(
            "transformers engine: %s on %s (%s, %d params, eos ids %s, threads %s)",
            self.model_dir, self.device, next(self.model.parameters()).dtype,
            sum(p.numel() for p in self.model.parameters()), sorted(self._eos_ids), threads or "process default",
        )

    def _find_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        if configured is None:
            configured = getattr(self.model.config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured is not None:
            ids.update(int(i) for i in configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        if not ids:
            raise ValueError(
                f"{self.model_dir}: no EOS token id in generation_config.json, config.json or the tokenizer; "
                "set eos_token_id in one of them"
            )
        return ids

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        model = self._require_open()
        if not prompts:
            return []
        if params.sampler is not None and params.sampler not in SEEDED_SAMPLERS[self.name]:
            raise ValueError(f"the {self.name} engine does not implement the sampler {params.sampler!r}")
        params.check_prompts(prompts)
        encoded = encode_prompts(self.tokenizer, prompts)
        longest = max(len(ids) for ids in encoded)
        if self._max_positions is not None and longest + params.max_new_tokens > self._max_positions:
            logger.warning(
                "prompt of %d tokens + max_new_tokens %d exceeds the model's %d positions",
                longest, params.max_new_tokens, self._max_positions,
            )

        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        # Row r is sample r % n of prompt r // n; with a seeded sampler its noise is keyed by keys[r].
        total = len(encoded) * params.n
        seeded = params.sampler is not None and not params.greedy
        keys = torch.tensor(params.completion_keys(), dtype=torch.long, device=self.device) if seeded else None
        order = list(range(total))
        if total > self.max_batch_sequences:
            # Similar lengths share a sub-batch, so less compute goes to padding.
            order.sort(key=lambda r: len(encoded[r // params.n]))
        results: list[Completion | None] = [None] * total
        with _torch_threads(self.threads), torch.inference_mode():
            for start in range(0, len(order), self.max_batch_sequences):
                chunk = order[start : start + self.max_batch_sequences]
                # A GRPO group repeats its prompt n times: prefill each distinct prompt once.
                firsts: dict[int, int] = {}
                expand = [firsts.setdefault(row // params.n, len(firsts)) for row in chunk]
                distinct = [encoded[prompt] for prompt in firsts]
                chunk_keys = keys[torch.tensor(chunk, device=self.device)] if keys is not None else None
                for row, completion in zip(chunk, self._generate_batch(model, distinct, expand, params, generator,
                                                                       chunk_keys)):
                    results[row] = completion
        return [results[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]  # type: ignore[misc]

    def _generate_batch(
        self,
        model: torch.nn.Module,
        prompts: Sequence[list[int]],
        expand: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        keys: torch.Tensor | None = None,
    ) -> list[Completion]:
        """Sample one completion per entry of ``expand`` (an index into ``prompts``); ``keys``
        (``[len(expand), 2]``): each row's seeded-sampler key words, None for the generator."""
        device = self.device
        width, steps = max(len(p) for p in prompts), params.max_new_tokens
        input_ids = torch.tensor(
            [[self._pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device
        )
        # Qwen-style RoPE numbers positions 0..L-1 regardless of padding unless told otherwise.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        # Without padding the model can take its plain-causal fast path: pass no mask at all.
        mask = attention_mask if any(len(p) != width for p in prompts) else None
        cache = DynamicCache(config=model.config)
        logits = model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **kv_cache(model, cache),
        ).logits[:, -1, :]
        if expand != list(range(len(prompts))):
            rows = torch.tensor(expand, dtype=torch.long, device=device)
            cache.batch_select_indices(rows)  # gathers with repeats: each row gets its prompt's KV
            logits, position_ids = logits[rows], position_ids[rows]
            mask = mask[rows] if mask is not None else None
        next_position = position_ids[:, -1] + 1

        batch = len(expand)
        tokens = torch.full((batch, steps), self._pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), steps, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        live = torch.arange(batch, device=device)  # batch position → row
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # per batch position

        # A small batch's noise for every step at once: one pass instead of ~30 small ops a step, which
        # at a tiny model's size cost as much as its forward (the same bits: train/sampling.py).
        noise = _noise_ahead(keys, steps, logits.shape[-1]) if keys is not None and not params.greedy else None
        for step in range(steps):
            if noise is not None:
                token, logprob = sample_seeded(logits.float() / params.temperature, noise[live, step], params.top_p)
            else:
                token, logprob = _sample(logits, params, generator, keys[live] if keys is not None else None, step)
            tokens[live, step] = token
            logprobs[live, step] = logprob
            hit = torch.isin(token, self._eos_tensor) & ~done
            if step == steps - 1:
                stopped[live[hit]] = True
                lengths[live[hit]] = step + 1
                break
            if bool(hit.any()):
                stopped[live[hit]] = True
                lengths[live[hit]] = step + 1
                done |= hit
                finished = int(done.sum())
                if finished == done.numel():
                    break
                if finished >= _COMPACT_FRACTION * done.numel():
                    keep = (~done).nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    next_position = next_position[keep]
                    mask = mask[keep] if mask is not None else None
                    token, live, done = token[keep], live[keep], done[keep]
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = model(
                input_ids=token[:, None], attention_mask=mask,
                position_ids=next_position[:, None], use_cache=True, **kv_cache(model, cache),
            ).logits[:, -1, :]
            next_position = next_position + 1

        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        return [
            Completion(token_ids=t[:n], logprobs=lp[:n], finish_reason="stop" if s else "length")
            for t, lp, n, s in zip(token_rows, logprob_rows, lengths.tolist(), stopped.tolist())
        ]

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_dir: Path) -> float:
        """Swap in a version's weights in place. When both the loaded version and this one carry signed
        tensor hashes (their manifests beside the directories), only the tensors whose hash changed
        are read and copied into the live parameters; otherwise every tensor is loaded."""
        model = self._require_open()
        started = time.perf_counter()
        model_dir = Path(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors files to load")
        hashes = signed_tensor_hashes(model_dir)
        if hashes is not None and self._hashes is not None and set(hashes) == set(self._hashes) and len(files) == 1:
            changed = sorted(name for name, sha in hashes.items() if self._hashes[name] != sha)
            try:
                with _torch_threads(self.threads):
                    copied = _copy_changed(model, files[0], changed)
            except BaseException:
                self._hashes = None  # some tensors may have changed: the next load is a full one
                raise
            if copied is not None:
                self._hashes, self.last_refit_tensors = hashes, copied
                seconds = time.perf_counter() - started
                logger.info("refitted %d of %d tensors (the ones whose signed hash changed) from %s in %.3f s",
                            copied, len(hashes), model_dir, seconds)
                return seconds
        with _torch_threads(self.threads):
            loaded: dict[str, torch.Tensor] = {}
            for file in files:
                try:
                    tensors = load_file(file, device="cpu")
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"{file}: not a readable safetensors file ({e}); old weights kept") from e
                duplicated = sorted(set(tensors) & set(loaded))
                if duplicated:
                    raise ValueError(f"{model_dir}: tensors {duplicated} appear in more than one safetensors file")
                loaded.update(tensors)
            full = _complete_state_dict(model, loaded, model_dir)
            # Copies into the existing parameters (tied ones share storage), so every holder of
            # the model object sees the new weights and nothing is re-instantiated.
            model.load_state_dict(full, strict=True)
        self._hashes, self.last_refit_tensors = hashes, len(loaded)
        seconds = time.perf_counter() - started
        logger.info("loaded %d tensors from %s in %.3f s", len(loaded), model_dir, seconds)
        return seconds

    def close(self) -> None:
        if getattr(self, "model", None) is None:
            return
        on_cuda = self.device.type == "cuda"
        self.model = None  # type: ignore[assignment]
        if on_cuda:
            torch.cuda.empty_cache()

    def _require_open(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("TransformersEngine is closed")
        return self.model


NOISE_AHEAD_ELEMENTS = 1 << 21
"""Rows × steps × vocabulary entries up to which a batch's seeded noise is drawn before its first step
(8 MiB of float32); larger batches draw each step's as it comes (train/sampling.py `seeded_choice`)."""


def _noise_ahead(keys: torch.Tensor, steps: int, vocab: int) -> torch.Tensor | None:
    """g ``[rows, steps, vocab]`` of every row (``keys`` ``[rows, 2]``) at positions 0 .. steps-1, or None
    past NOISE_AHEAD_ELEMENTS."""
    rows = keys.shape[0]
    if rows * steps * vocab > NOISE_AHEAD_ELEMENTS:
        return None
    t = torch.arange(steps, dtype=torch.long, device=keys.device).repeat(rows)
    k0, k1 = keys[:, 0].repeat_interleave(steps), keys[:, 1].repeat_interleave(steps)
    return gumbel_noise(k0, k1, t, vocab).view(rows, steps, vocab)


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, keys: torch.Tensor | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (token ids, their behaviour logprobs: see ``base.py``).

    ``keys`` (``[rows, 2]``): the seeded sampler's key words of each row, whose token number ``step``
    this is (train/sampling.py); None: the generator draws."""
    logits = logits.float()
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
    elif keys is not None:
        position = torch.full((len(keys),), step, dtype=torch.long, device=keys.device)
        return seeded_choice(logits / params.temperature, keys[:, 0], keys[:, 1], position, params.top_p)
    elif params.top_p < 1.0:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        sorted_logp, sorted_ids = logp.sort(dim=-1, descending=True)
        sorted_probs = sorted_logp.exp()
        # Keep a token while the mass ranked above it is still short of top_p (the top one always).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        choice = torch.multinomial(sorted_probs.masked_fill_(drop, 0.0), 1, generator=generator)
        token = sorted_ids.gather(-1, choice).squeeze(-1)
        # The token came from the nucleus renormalised: its logprob there, not in the full softmax.
        log_mass = torch.logsumexp(sorted_logp.masked_fill(drop, -math.inf), dim=-1)
        return token, sorted_logp.gather(-1, choice).squeeze(-1) - log_mass
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def signed_tensor_hashes(model_dir: Path) -> dict[str, str] | None:
    """name -> sha256 of every tensor of an installed version, from the signed manifest the follower
    verified and stored beside its directory (`versions/v00000007.manifest`); None when it has none."""
    import json

    path = Path(model_dir).with_name(Path(model_dir).name + ".manifest")
    try:
        tensors = json.loads(path.read_bytes())["manifest"]["tensors"]
        hashes = {t["name"]: t["sha256"] for t in tensors}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hashes if hashes and all(isinstance(v, str) for v in hashes.values()) else None


def _copy_changed(model: torch.nn.Module, file: Path, names: list[str]) -> int | None:
    """Copy the tensors `names` from a safetensors file into the model's parameters in place (every one
    read before the first is copied). None, with nothing changed, when a name or shape does not fit."""
    from safetensors import safe_open

    state = model.state_dict()
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError):
        return None
    if any(name not in state or tuple(t.shape) != tuple(state[name].shape) for name, t in tensors.items()):
        return None
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)  # state_dict tensors share storage with the parameters (and tied aliases)
    return len(tensors)


def _complete_state_dict(
    model: torch.nn.Module, loaded: dict[str, torch.Tensor], source: Path
) -> dict[str, torch.Tensor]:
    """Validate ``loaded`` against the model and fill in tied aliases absent from the file.

    Raises ValueError naming every unexpected, missing or wrongly shaped tensor.
    """
    state = model.state_dict()
    # Tied parameters (lm_head ↔ embed_tokens) are the same tensor under two names.
    aliases: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for key, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        aliases.setdefault(identity, []).append(key)

    unexpected = sorted(k for k in loaded if k not in state)
    mismatched = sorted(
        f"{k} (file {tuple(v.shape)}, model {tuple(state[k].shape)})"
        for k, v in loaded.items()
        if k in state and tuple(v.shape) != tuple(state[k].shape)
    )
    full: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    differing: list[str] = []
    for group in aliases.values():
        present = [k for k in group if k in loaded]
        if not present:
            missing.extend(group)
            continue
        first = loaded[present[0]]
        for other in present[1:]:
            if loaded[other].shape == first.shape and not torch.equal(loaded[other], first):
                differing.append(f"{present[0]} / {other}")
        for key in group:
            full[key] = loaded.get(key, first)

    problems = []
    if mismatched:
        problems.append(f"shape mismatch: {', '.join(mismatched)}")
    if missing:
        problems.append(f"missing: {', '.join(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    if differing:
        problems.append(f"tied in the model but different in the file: {', '.join(differing)}")
    if problems:
        raise ValueError(f"{source}: weights do not fit the loaded model ({'; '.join(problems)}); old weights kept")
    return full
