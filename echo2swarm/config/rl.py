"""Config sections of the RL loop: what the learner trains and how rollout peers take work."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from echo2swarm.control.activation import DEFAULT_HYSTERESIS
from echo2swarm.control.capacity import DEFAULT_GAMMA, DEFAULT_PUBLISH_EVERY, DEFAULT_STALENESS, staleness_problem
from echo2swarm.runtime.devices import check_cpus, check_device_name
from echo2swarm.wire.ids import MAX_VERIFIERS, PEER_ID_PATTERN
from echo2swarm.wire.sampling import SAMPLER
from echo2swarm.wire.work import MAX_COMPLETION_TOKENS, MAX_GROUP_SIZE, MAX_PROMPTS_PER_LEASE

# Checked for spelling here (no torch import); whether the CUDA device exists is checked at
# daemon preflight and again when the trainer or engine is built.
Device = Annotated[str, AfterValidator(check_device_name)]

# Defaults the engines' own constructors take too (rollout/engines/hf.py, vllm.py): stated once, here.
DEFAULT_MAX_BATCH_SEQUENCES = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# The loss's choices (train/grpo.py computes them; docs/architecture.md §7 says what each is).
LossType = Literal["bnpo", "grpo", "dr_grpo", "dapo"]
IsMode = Literal["truncate", "mask"]
IsLevel = Literal["token", "sequence", "sequence_product"]
KlEstimator = Literal["k3_is", "k3"]
LOSS_DOCS = "docs/architecture.md §7"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class TrainConfig(_Section):
    """GRPO on the learner. A step trains on `prompts_per_step` groups of `group_size` completions."""

    task: str = Field("arith", description="Task adapter name (built-in: arith, math, poker; others via entry points).")
    task_options: dict[str, Any] = Field(default_factory=dict, description="Keyword options for the task adapter.")
    steps: int = Field(200, ge=1, description="Optimizer steps to run; the learner then writes the final model and exits.")
    reward_target: float | None = Field(
        None, description="Stop early once the mean reward of the last 10 steps reaches this. None: run all steps."
    )
    staleness: int = Field(
        DEFAULT_STALENESS, ge=0, description="S: rollouts of version x may train step t only if t - x <= S. 0 = on-policy."
    )
    publish_every: int = Field(DEFAULT_PUBLISH_EVERY, ge=1, description="kappa: publish a new policy version every this many steps.")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="Groups (prompts) per step.")
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE, description="G: completions per prompt.")
    max_new_tokens: int = Field(8, ge=1, le=MAX_COMPLETION_TOKENS, description="Completion length limit, in tokens.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature on rollout peers.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling on rollout peers; their behaviour logprobs are renormalised "
        "over the nucleus (architecture.md §6, rollout/engines/base.py). 1.0: no truncation.",
    )
    lr: float = Field(3e-4, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay (0: none).")
    adam_beta1: float = Field(
        0.7, ge=0, lt=1, description="AdamW's first-moment decay (TRL's name). 0.7, not torch's 0.9: momentum is a "
        "delay that adds to staleness (operations.md, 'Staleness'); 0.9 for runs that stay on-policy.",
    )
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW's second-moment decay (TRL's name).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    clip_low: float = Field(0.2, gt=0, lt=1, description=f"PPO clip of the ratio below 1 ({LOSS_DOCS}).")
    clip_high: float = Field(0.2, gt=0, description=f"PPO clip of the ratio above 1 ({LOSS_DOCS}).")
    is_cap: float = Field(
        10.0, ge=1, le=1e6, description=f"Cap of the importance weights of stale rollouts, in the objective and the "
        f"KL term; it bounds what a peer's claimed logprobs can weigh ({LOSS_DOCS}).",
    )
    is_mode: IsMode = Field(
        "truncate", description=f"Above is_cap: 'truncate' the weight to the cap or 'mask' the token ({LOSS_DOCS}).",
    )
    is_level: IsLevel = Field(
        "token", description=f"One importance weight per 'token', 'sequence' or 'sequence_product' ({LOSS_DOCS}).",
    )
    ppo_epochs: int = Field(2, ge=1, le=16, description=f"Passes over each step's batch ({LOSS_DOCS}).")
    minibatches: int = Field(
        1, ge=1, le=256, description=f"Optimizer updates per pass, each on whole groups; fewer when the step has "
        f"fewer groups ({LOSS_DOCS}).",
    )
    loss_type: LossType = Field(
        "bnpo", description=f"How token losses become one loss: 'bnpo', 'grpo', 'dr_grpo' or 'dapo' ({LOSS_DOCS}).",
    )
    max_offpolicy_gap: float | None = Field(
        None, gt=0, description="Drop a group whose mean |log proximal - log behaviour| per token exceeds this "
        "(offpolicy_dropped; docs/architecture.md §7). None: keep all.",
    )
    schedule: Literal["freshest", "oldest"] = Field(
        "freshest", description="Which buffered groups a step trains: 'freshest' (newest version first: lowest "
        "staleness) or 'oldest' (oldest first: fewest groups dropped as stale, staleness near S).",
    )
    inflight_headroom: float = Field(
        1.5, ge=1, le=10, description="Groups leased or buffered are capped at R + headroom x the groups trained "
        "while one lease is generated (measured), never above (S + 1) x R. Lower: fresher rollouts, more bubble.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description=f"Weight of the KL term to the initial policy; 0: none, and no reference model kept "
        f"({LOSS_DOCS}).",
    )
    kl_estimator: KlEstimator = Field("k3_is", description=f"The KL term's estimator: 'k3_is' or 'k3' ({LOSS_DOCS}).")
    scale_std: bool = Field(True, description="Divide group advantages by the group's reward std.")
    seed: int = Field(0, ge=0, description="Seeds prompts and torch (the seeds leases hand to peers are unpredictable).")
    threads: int | None = Field(None, ge=1, description="torch threads for training. None: torch's default.")
    device: Device = Field(
        "auto", description="Torch device for the policy, reference model, optimizer state and batches: auto (cuda "
        "when a CUDA device is visible, else cpu), cpu, cuda or cuda:N. Published weights are fp32 on CPU either way.",
    )
    micro_batch_sequences: int | None = Field(
        None, ge=1, le=65536, description="Sequences per forward/backward at most: a larger minibatch is split into "
        "micro-batches accumulating one update (spread across a sharded learner's ranks). None: a whole minibatch.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (less memory, about a third more compute).",
    )
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        "auto", description="Sharded learners (FSDP2): 'bf16' computes in bfloat16 with fp32 masters, optimizer "
        "state and reductions; 'off' in fp32; 'auto' bf16 on CUDA, off on the CPU. One process: fp32.",
    )
    checkpoint_every: int = Field(20, ge=1, description="Steps between checkpoints (model, optimizer, RNG, cursor).")
    keep_checkpoints: int = Field(2, ge=1)
    run_dir: Path | None = Field(None, description="metrics.jsonl, checkpoints, final model. None: <state_dir>/run.")
    min_step_s: float | None = Field(
        None, gt=0, le=3600,
        description="Pad each step's learner time to at least this many seconds (emulates a larger model in "
        "benchmarks, as worker.max_rollouts_per_s emulates slower GPUs). None: no padding.",
    )

    @model_validator(mode="after")
    def _staleness_covers_the_publish_period(self) -> "TrainConfig":
        problem = staleness_problem(self.staleness, self.publish_every)
        if problem is not None:
            raise ValueError(f"train.{problem}")
        return self

    @model_validator(mode="after")
    def _fits_in_a_message(self) -> "TrainConfig":
        # One group travels in one RPC message (< 4 MiB); a token costs at most ~14 bytes in msgpack.
        if self.group_size * self.max_new_tokens * 14 > 4_000_000:
            raise ValueError(
                f"group_size x max_new_tokens = {self.group_size * self.max_new_tokens} tokens per group exceeds "
                "what one 4 MiB RPC message carries (~285k tokens); lower group_size or max_new_tokens"
            )
        return self


class LeaseConfig(_Section):
    """How the learner hands out work."""

    max_prompts: int = Field(8, ge=1, le=MAX_PROMPTS_PER_LEASE, description="Prompts in one lease at most.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds before an unfinished lease is re-issued to someone else.")
    wait_retry_s: float = Field(0.05, gt=0, le=60, description="Back-off a peer is told when no work is available.")
    max_hold_s: float = Field(
        5.0, ge=0, le=60, description="Longest a peer's lease request is held waiting for work (long polling); "
        "0: answer at once.",
    )
    expiry_check_s: float = Field(
        0.5, gt=0, le=60, description="Seconds between looks for expired leases while the learner waits for a "
        "batch (an expired lease is re-issued at the next look).",
    )


class PeersConfig(_Section):
    """How the learner holds rollout peers to account (learner/accountability.py): caps and bans.

    A public swarm is joined by strangers: a peer's claims count once it delivers, and a peer caught
    lying is banned for the run (its groups dropped, its leases re-issued, its card ignored).
    """

    enabled: bool = Field(True, description="Apply the caps and bans below; off: trust every peer (closed swarms).")
    probation_prompts: int = Field(
        2, ge=1, le=256, description="Prompts a peer that has delivered nothing yet may hold at once.",
    )
    max_open_leases: int = Field(
        3, ge=1, le=64, description="Leases one peer may hold at once (a worker prefetches one ahead).",
    )
    window_s: float = Field(60.0, gt=0, le=3600, description="Window, in seconds, of max_undelivered_prompts.")
    max_undelivered_prompts: int = Field(
        64, ge=1, le=100_000, description="Prompts one peer may have taken and not delivered within window_s; a "
        "client that polls for work and never submits holds no more.",
    )
    ban_after_violations: int = Field(
        3, ge=1, le=1000, description="Groups an honest peer never sends (no lease for them, malformed, bad "
        "shapes or logprobs, undecodable) after which the peer is banned for the run.",
    )
    ban_after_verify_failures: int = Field(
        2, ge=1, le=1000, description="Groups refused by the learner's verification (logprobs that do not match "
        "the behaviour version, text the policy would not sample) after which the peer is banned for the run.",
    )
    ban_after_lapsed_leases: int = Field(
        4, ge=1, le=1000, description="Leases in a row that lapse with nothing delivered after which the peer is "
        "banned for the run.",
    )
    graduate_after_groups: int = Field(
        4, ge=1, le=10_000, description="Verified groups a peer delivers before it leaves probation; until then its "
        "work comes from the newcomers' shared pool (docs/protocol.md §10.3).",
    )
    newcomer_prompts: int | None = Field(
        None, ge=1, le=100_000, description="Prompts all peers on probation together may hold, outside the in-flight "
        "cap. None: train.prompts_per_step.",
    )
    capped_retry_s: float = Field(
        1.0, gt=0, le=60, description="Seconds a peer at its cap (open leases, undelivered prompts, probation) is "
        "told to wait before asking again; its request is answered at once, never held.",
    )
    max_tracked_peers: int = Field(
        10_000, ge=16, le=1_000_000, description="Peers (and bans) remembered at most; bounds the learner's memory "
        "under a flood of fresh peer ids.",
    )

    @model_validator(mode="after")
    def _probation_below_the_cap(self) -> "PeersConfig":
        if self.probation_prompts > self.max_undelivered_prompts:
            raise ValueError("peers.probation_prompts must not exceed peers.max_undelivered_prompts")
        return self


class VLLMOptions(_Section):
    """Settings only the vLLM engine reads (`[engine.vllm]`); the transformers engine ignores them."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype. auto: the checkpoint's own, float32 included."
    )
    kv_cache_gib: float | None = Field(
        None, gt=0, description="KV cache size in GiB. None: gpu_memory_utilization on GPUs, 1 GiB on CPUs."
    )
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1, description="Fraction of GPU memory vLLM may take when kv_cache_gib is None (GPUs only)."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + completion in tokens. None: the model's max_position_embeddings."
    )
    enforce_eager: bool | None = Field(
        None, description="Disable CUDA graphs / compilation. None: eager on CPUs, graphs on GPUs."
    )
    block_size: int | None = Field(
        None, ge=1, description="KV cache block in tokens, the prefix cache's unit. None: vLLM's (128 on CPUs)."
    )


class EngineConfig(_Section):
    type: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="Generation engine; auto picks vllm when it imports here, else transformers."
    )
    threads: int | None = Field(None, ge=1, description="torch threads for generation. None: torch's default.")
    device: Device = Field(
        "auto", description="Torch device of the transformers engine: auto (cuda when visible, else cpu), cpu, cuda "
        "or cuda:N. vLLM picks its own device and ignores this.",
    )
    max_batch_sequences: int = Field(DEFAULT_MAX_BATCH_SEQUENCES, ge=1, description="Sequences generated in one batch at most.")
    isolate: bool = Field(
        True, description="Run the engine in a process of its own, so generation never shares the GIL with the "
        "daemon's event loop (serving chunks, RPCs, the DHT). false: in a thread of the daemon.",
    )
    cpus: list[int] | None = Field(
        None, min_length=1, description="Cores the engine process runs on (needs isolate), e.g. [2, 3]; its torch "
        "threads default to their number. None: wherever the daemon runs.",
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="vLLM engine settings.")

    @field_validator("cpus")
    @classmethod
    def _cores_exist(cls, cpus: list[int] | None) -> list[int] | None:
        if cpus is not None:
            if len(set(cpus)) != len(cpus) or min(cpus) < 0:
                raise ValueError(f"engine.cpus must list distinct core numbers >= 0, got {cpus}")
            check_cpus(cpus)
        return cpus

    @model_validator(mode="after")
    def _cpus_need_a_process(self) -> "EngineConfig":
        if self.cpus is not None and not self.isolate:
            raise ValueError("engine.cpus pins the engine's own process: it needs engine.isolate = true")
        return self


class WorkerConfig(_Section):
    """How a rollout peer takes leases."""

    max_prompts: int = Field(8, ge=1, le=MAX_PROMPTS_PER_LEASE, description="Prompts asked for per lease.")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Seconds for one lease or submit call.")
    idle_retry_s: float = Field(1.0, gt=0, description="Seconds between attempts while no learner is reachable.")
    lease_wait_s: float = Field(
        5.0, ge=0, le=60, description="Ask the learner to hold a lease request up to this long until work is free "
        "(long polling; the learner caps it), so work is taken the moment it exists. 0: poll.",
    )
    prefetch_leases: int = Field(
        1, ge=0, le=4, description="Leases asked for ahead of the one generating, so the engine does not wait on the "
        "round trip. 0: ask for the next lease only when a batch is done.",
    )
    max_pending_submits: int = Field(
        2, ge=1, le=16, description="Generated batches still being submitted before generation waits for them.",
    )
    max_rollouts_per_s: float | None = Field(
        None, gt=0, description="Pace generation to at most this many rollouts/s (emulates slower GPUs in benchmarks)."
    )
    calibrate: bool = Field(
        True, description="Measure rollouts/s once the engine loads (cached per engine, model and settings) so the "
        "learner can plan with it before the first lease.",
    )
    calibration_prompts: int = Field(4, ge=1, le=256, description="Prompts in the calibration batch.")
    calibration_group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="Completions per calibration prompt "
                                        "(until a lease shows the task's own group size).")
    calibration_max_new_tokens: int = Field(8, ge=1, le=MAX_COMPLETION_TOKENS, description="Completion length of the calibration batch "
                                            "(until a lease shows the task's own).")
    ewma_alpha: float = Field(0.2, gt=0, le=1, description="Weight of the newest lease in the rollouts/s average.")
    max_refit_share: float = Field(
        0.05, gt=0, le=1, description="Most of the engine's time spent loading new versions: the newest waits until "
        "the last load's seconds / this share have passed, or until a lease needs it. 1: load each as it comes.",
    )

    @model_validator(mode="after")
    def _held_requests_fit_the_timeout(self) -> "WorkerConfig":
        if self.lease_wait_s >= self.rpc_timeout_s:
            raise ValueError(
                f"worker.lease_wait_s ({self.lease_wait_s:g}) must be below worker.rpc_timeout_s "
                f"({self.rpc_timeout_s:g}): a held lease request would time out"
            )
        return self


class ActivationConfig(_Section):
    """The learner's closed loop over which rollout peers work (docs/architecture.md §8)."""

    enabled: bool = Field(True, description="Keep only the cheapest peers meeting the throughput floor active; "
                          "off: every peer gets leases.")
    gamma: float = Field(DEFAULT_GAMMA, ge=1, le=10, description="Margin: active peers must give gamma * R / T_train rollouts/s.")
    hysteresis: float = Field(
        DEFAULT_HYSTERESIS, ge=0, lt=1,
        description="Fraction: the active set is kept while it gives >= (1 - hysteresis) of the floor and no plan "
        "is cheaper by more than this fraction, so peers don't flap.",
    )
    replan_period_s: float = Field(10.0, gt=0, le=3600, description="Seconds between re-plans of the active set.")
    standby_retry_s: float = Field(1.0, gt=0, le=60, description="Seconds a standby peer waits before asking again.")
    min_steps: int = Field(
        2, ge=1, le=1000, description="Training steps measured before the first plan; until then every peer is active."
    )
    ewma_alpha: float = Field(0.3, gt=0, le=1, description="Weight of the newest sample in T_train, T_bcast, L_gen, µ.")
    t_bcast_s: float | None = Field(
        None, ge=0, le=3600, description="T_bcast to plan with, in seconds. None: the learner's measurement (else 0)."
    )
    plan_after_groups: int = Field(
        4, ge=1, le=10_000, description="Verified groups a peer delivers before it is planned (again, after it went "
        "quiet while planned): a burst cannot displace peers that deliver.",
    )
    quiet_after_s: float = Field(
        5.0, gt=0, le=3600, description="A planned peer silent this long (or 3x its own lease time, if longer) is "
        "quiet: out of the plan until it delivers plan_after_groups verified groups again.",
    )


class VerifyConfig(_Section):
    """The learner's checks of rollout peers' groups against its own policy (train/verify.py), before
    they train: implausible behaviour logprobs, logprobs that are not the claimed version's, text the
    policy would almost never sample. A refused group is dropped from the step and reported.

    Defaults leave ~3x margin over the honest spread `scripts/bench_verify.py` measured (tiny arith
    model, transformers engine, fp32 and bf16, lr 3e-4): the figures are in docs/benchmarks.md
    ("Verifying peers' groups"), when to change them in docs/operations.md ("Bans, caps and verification")."""

    enabled: bool = Field(True, description="Check every group before it trains; off: train on whatever peers send.")
    sample_fraction: float = Field(
        0.05, ge=0, le=1, description="Fraction (0-1) of older groups, drawn at random, recomputed under their own "
        "version's weights; groups of the step's own version, and suspicious ones, are always checked exactly.",
    )
    exact_tolerance: float = Field(
        1.0, gt=0, description="Nats: largest |claimed - recomputed| logprob of any token under the group's own "
        "version; also the per-token bound against the current policy at staleness 0.",
    )
    exact_mean_tolerance: float = Field(
        0.2, gt=0, description="Nats: largest mean |claimed - recomputed| logprob over a group's tokens under its "
        "own version.",
    )
    token_gap_per_version: float = Field(
        3.0, ge=0, description="Nats per version of staleness added to exact_tolerance: the per-token bound against "
        "the current policy for a group k versions old. Scale it with the learning rate.",
    )
    mean_gap_per_version: float = Field(
        1.0, ge=0, description="Nats per version of staleness added to exact_mean_tolerance: the bound on a "
        "k-versions-old group's mean gap to the current policy.",
    )
    sample_tolerance: float = Field(
        1.0, ge=0, description="Nats of logits: how far an honest engine's logits may differ from the learner's in "
        "the seeded-choice check (protocol.md §10.4.1 check 6; measured: benchmarks.md, 'Seeded sampling').",
    )
    require_seeded: bool = Field(
        True, description="Refuse groups not drawn with the lease's seeded sampler (reason `unseeded`, which the "
        "peer sees; no strike). Off: they train after every other check.",
    )
    suspect_fraction: float = Field(
        0.25, gt=0, le=1, description="Gaps past this fraction (0-1) of their bounds (a choice's: of "
        "sample_tolerance) make a group suspicious: its peer's older groups are checked exactly (protocol.md §10.4.1).",
    )
    newcomer_groups: int = Field(
        64, ge=0, description="A peer's first N groups are checked under their own version (choices re-derived) "
        "whatever their staleness; later ones by sample_fraction and suspicion (protocol.md §10.4.1).",
    )
    peer_choice_scale: float = Field(
        0.25, ge=0, description="Nats of logits: a re-derived choice this far or more below the sampler's counts 1 "
        "toward its peer's choice CUSUM, nearer ones (gap / scale)² (protocol.md §10.4.1 'Per-peer tests').",
    )
    peer_choice_allowance: float = Field(
        0.003, ge=0, description="Choice evidence per re-derived position that a peer's sequential test forgives "
        "(protocol.md §10.4.1 'Per-peer tests'; honest engines measured: benchmarks.md, 'Attacks on sampling').",
    )
    peer_choice_threshold: float | None = Field(
        4.0, gt=0, description="A peer whose CUSUM of choice evidence reaches this is banned (verify_peer_statistics). "
        "None: no such test.",
    )
    peer_z_allowance: float = Field(
        0.75, ge=0, description="Typicality z per group that a peer's two-sided sequential test forgives.",
    )
    peer_z_threshold: float | None = Field(
        20.0, gt=0, description="A peer whose CUSUM of typicality z (either sign) reaches this is banned "
        "(verify_peer_statistics). None: no such test.",
    )
    typicality_z: float | None = Field(
        24.0, gt=0, description="One-sided z threshold on sum(surprisal - entropy) per sequence and per group; "
        "above it the text is refused as atypical, no strike (protocol.md §10.4.1). None: no typicality test.",
    )
    suspect_steps: int = Field(
        10, ge=0, description="Steps: after one of a peer's groups is refused, all its older groups are checked "
        "exactly for this many steps.",
    )
    spare_models: int = Field(
        1, ge=1, le=8, description="Whole copies of the policy kept for exact checks where a verifier loads older "
        "versions whole (benchmarks' baseline); the learner streams them from its store and keeps none.",
    )
    seed: int | None = Field(
        None, ge=0, description="Seeds the choice of sampled groups (tests). None: unpredictable, so a peer cannot "
        "tell which of its groups will be checked.",
    )
    verifiers: list[Annotated[str, Field(pattern=PEER_ID_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_VERIFIERS, description="Peer ids of verifier daemons (`--role verifier`, "
        "operations.md 'Verifier daemons') that may compute exact checks; listed in the signed head.",
    )
    offload: Literal["never", "when_full", "always"] = Field(
        "when_full", description="When exact checks go to `verifiers`: when_full - when the learner's device has less "
        "free memory than the check's forward needs; always - whenever one answers (the learner computes it when "
        "none does); never - only here.",
    )
    remote_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Seconds a verifier daemon has to answer one exact check before the next "
        "is asked (the learner computes it itself, memory permitting, when none answers).",
    )

    @property
    def required_sampler(self) -> str | None:
        """The seeded sampler the intake requires of every group (`require_seeded`), None when any will do."""
        return SAMPLER if self.require_seeded else None
