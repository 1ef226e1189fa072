"""The learner: lease prompts, take back groups, train with GRPO, publish signed versions, checkpoint.

    rollout peers ─rpc_lease/rpc_submit─► Intake ─► RolloutBuffer ─► Trainer.step (worker thread)
         ▲                                                               │
         └── chunk server ◄── Publisher (signed version v+1, every κ) ◄──┘ ─► metrics.jsonl, checkpoints

    start: trainer (one process, or rank 0 of W) ─► checkpoint restored ─► first version published
           ─► metrics sinks ─► intake ─► the RPC surface served
    run:   wait for a batch (expire leases, re-issue a departed peer's) ─► step ─► strikes for refused
           groups, per-peer tests (evidence.py) ─► publish every κ steps ─► metrics ─► checkpoint every N
           steps ─► ... ─► final model

Versions: version v is the policy before step v. Step t trains on groups of versions x with
t − x ≤ S, then the policy becomes version t + 1. A restarted learner resumes from its latest
checkpoint and continues with a version strictly above everything it published before, so
followers never go back and reattach without a restart.
Back-pressure: the trainer waits for the buffer (waiting time is the bubble); the intake caps
work in flight at (S + 1) · R groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2swarm.config.models import LearnerConfig
from echo2swarm.learner.accountability import PeerLedger
from echo2swarm.learner.activation_loop import LearnerActivation
from echo2swarm.learner.broadcast_tracker import BroadcastTracker
from echo2swarm.learner.checkpoint import load_latest, save_checkpoint
from echo2swarm.learner.evidence import PeerStatistics
from echo2swarm.learner.intake import Intake
from echo2swarm.learner.leases import GroupLimits
from echo2swarm.learner.metrics import MetricsLog
from echo2swarm.learner.publisher import Publisher
from echo2swarm.learner.versions import PublishedVersion
from echo2swarm.overlay.node import Overlay
from echo2swarm.overlay.rpc import serve
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime.aio import wait_any
from echo2swarm.runtime.logging import get_logger
from echo2swarm.train.base import Trainer
from echo2swarm.train.group import Group
from echo2swarm.train.verify import GroupEvidence, NonFiniteWeightsError
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.wire.surfaces import LEARNER_RPC

if TYPE_CHECKING:
    from echo2swarm.learner.verifiers import RemoteVerifiers

logger = get_logger(__name__)
RECENT_REWARDS = 10  # steps whose mean reward train.reward_target is compared with


class Learner:
    """Built from its config section and its collaborators; the daemon's adapter only hosts it.

    >>> learner = Learner(config, overlay=overlay, chunks=chunks, versions=versions, announce=announcer.trigger)
    >>> await learner.start()        # trainer, checkpoint, first version, intake, RPCs
    >>> await learner.run(stop)      # until train.steps, the reward target, or stop
    """

    def __init__(self, config: LearnerConfig, *, overlay: Overlay, chunks: ChunkStore, versions: VersionStore,
                 announce: Callable[[], None]):
        self.config = config
        self.train = config.train
        self.overlay = overlay
        self.versions = versions
        self.announce = announce  # our card or head changed: tell the swarm now, not at the next period
        self.key = PolicyKey.load(config.publish.policy_key)  # type: ignore[arg-type]
        self.publisher = Publisher(config.publish, keep=config.versions_kept, swarm=config.overlay.swarm,
                                   key=self.key, chunks=chunks, versions=versions, peer_id=overlay.peer_id)
        self.ledger = PeerLedger(config.peers)  # who is on probation, capped or banned (intake, trainer, broadcast)
        # each peer's sequential tests over its verified groups (what one group's check cannot prove)
        self.statistics = PeerStatistics(config.verify, max_peers=config.peers.max_tracked_peers)
        refresh_s = config.publish.cards_refresh_s or min(2.0, config.overlay.announce_period_s / 2)
        self.broadcast = BroadcastTracker(overlay, self.key, config.publish.seeds, refresh_s=refresh_s,
                                          ewma_alpha=config.activation.ewma_alpha, excluded=lambda: self.ledger.bans.keys(),
                                          delivered=lambda: self.intake.delivered if self.intake else {},  # roster
                                          shape=config.publish.plan_shape, unproven=config.publish.plan_unproven)
        # Cost-aware activation (docs/architecture.md §8); T_bcast from the broadcast tracker once it measures one.
        self.activation = LearnerActivation(config.activation, self.train, t_bcast=lambda: self.broadcast.t_bcast_s)
        self.run_dir = Path(self.train.run_dir or Path(config.state_dir) / "run")
        self.state = "starting"
        self.version = 1
        self.steps_done = 0
        self.trainer: Trainer | None = None
        self.verifiers: RemoteVerifiers | None = None  # verifier daemons, when the config lists any
        self.intake: Intake | None = None
        self.metrics: MetricsLog | None = None
        self.recent_rewards: deque[float] = deque(maxlen=RECENT_REWARDS)
        self.wait_s = self.busy_s = 0.0
        self.rollbacks = 0  # times the policy went non-finite and was reset to the last published version

    @property
    def published(self) -> PublishedVersion | None:
        return self.publisher.published

    # -- start ---------------------------------------------------------------------------------
    async def start(self) -> None:
        # torch + transformers: only in the learner. Under torchrun (W > 1) this is rank 0 of a sharded
        # trainer; ranks 1..W-1 follow its commands (train/distributed.py, started by `daemon`).
        from echo2swarm.tasks.registry import get_task
        from echo2swarm.learner.verifiers import RemoteVerifiers
        from echo2swarm.train.distributed import make_trainer

        versions = self.versions
        verify = self.config.verify
        if verify.enabled and verify.verifiers and verify.offload != "never":  # exact checks elsewhere too
            self.verifiers = RemoteVerifiers(self.overlay.p2p, self.config.overlay.swarm, verify,
                                             asyncio.get_running_loop())
        trainer = self.trainer = await asyncio.to_thread(
            make_trainer, self.publisher.model_dir, self.train, verify=verify,
            # behaviour versions within the staleness window are on disk (LearnerConfig.versions_kept)
            weights_of=lambda v: versions.dir(v) if versions.installed(v) else None, remote=self.verifiers,
        )
        task = get_task(self.train.task, seed=self.train.seed, **self.train.task_options)
        cursor, requeue = 0, []
        checkpoint = await asyncio.to_thread(load_latest, self.run_dir)
        if checkpoint is not None:
            await asyncio.to_thread(checkpoint.restore, trainer)  # written by any number of ranks
            self.steps_done = checkpoint.step
            cursor = checkpoint.state["extra"]["cursor"]
            requeue = checkpoint.state["extra"]["requeue"]
            logger.info("resuming from %s: %d steps done", checkpoint.path, checkpoint.step)
        # Strictly above anything published before, even versions published after the checkpoint.
        self.version = max(checkpoint.version if checkpoint else 1, (versions.latest() or 0) + 1)
        with contextlib.suppress(Exception):  # followers already in the swarm get the first version by plan
            self.broadcast.observe((await self.overlay.get_cards())[0])
        await self._publish()
        # In a thread: wandb.init may take up to metrics.wandb_init_timeout_s, and the DHT keeps announcing meanwhile.
        self.metrics = await asyncio.to_thread(MetricsLog, self.run_dir, self.config.metrics, decode=trainer.decode,
                                               hparams=self.config.model_dump(mode="json"))
        self.intake = Intake(
            task, self.train, self.config.leases, encode=trainer.encode_prompt, decode=trainer.decode,
            limits=GroupLimits(self.train.group_size, self.train.max_new_tokens, trainer.vocab_size,
                               trainer.eos_token_ids, self.config.verify.required_sampler),
            version=self.version, cursor=cursor, requeue=requeue, gate=self.activation, head_json=self._head_json(),
            ledger=self.ledger,
        )
        await serve(self.overlay.p2p, self.config.overlay.swarm, LEARNER_RPC, self.intake)  # rpc_lease, rpc_submit
        self.state = "ready"
        logger.info("policy key %s; followers pin it with --trust %s", self.key.public.fingerprint, self.key.public.text)

    def head(self) -> HeadRecord | None:
        """The newest version's head, signed afresh, with where followers reach us as the daemon advertises it
        and the card shard depth our whole reads of the cards call for (overlay/shards.py `ShardDepth`)."""
        bits = self.overlay.cards.depth.wanted(self.config.overlay.max_card_shard_bits)
        self.overlay.set_card_shards(bits)
        return self.publisher.head(self.config.overlay.record_ttl_s, self.overlay.chunk_url, self.overlay.maddrs, bits,
                                   self.config.verify.verifiers)

    def _head_json(self) -> str | None:
        head = self.head()
        return head.model_dump_json() if head else None

    # -- publishing ----------------------------------------------------------------------------
    async def _publish(self) -> float:
        """Publish the policy as version `self.version` (learner/publisher.py); the seconds it took."""
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self.publisher.publish, self.trainer, self.version)
        except NonFiniteWeightsError as e:  # never signed; training goes on from the last good version
            await self._roll_back(str(e))
            return time.perf_counter() - started
        self.broadcast.plan(self.version)
        if self.intake is not None:
            self.intake.published(self.version, self._head_json())
        self.announce()
        return time.perf_counter() - started

    async def _roll_back(self, why: str) -> None:
        """The policy went non-finite: reload the last version published (finite: it was checked when
        signed) and forget the optimizer's moments, which went the same way."""
        assert self.trainer is not None
        if self.published is None:
            raise RuntimeError(f"the initial policy is not finite: {why}")
        logger.error("NOT publishing v%d: %s; rolling back to v%d's weights and resetting the optimizer state",
                     self.version, why, self.published.version)
        tensors = await asyncio.to_thread(self.publisher.rollback_weights)  # load_weights casts into the masters
        self.trainer.load_weights(tensors)
        self.trainer.reset_optimizer()  # on every rank of a sharded learner
        self.rollbacks += 1

    # -- training loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        assert self.trainer is not None and self.metrics is not None
        started = time.monotonic()
        watcher = asyncio.create_task(self.broadcast.run(stop))
        try:
            await self._train(stop, started)
        finally:
            watcher.cancel()
        await asyncio.to_thread(self.trainer.close)  # a sharded learner's other ranks leave too
        # Training is over or the daemon is stopping (a crash raised above, and the supervisor reruns
        # us with the log open): finish the trackers now, as the daemon leaves with os._exit.
        await asyncio.to_thread(self.metrics.close)

    async def _train(self, stop: asyncio.Event, started: float) -> None:
        assert self.intake is not None and self.trainer is not None
        intake, train = self.intake, self.train
        while self.steps_done < train.steps and not stop.is_set():
            # Peers that asked for work, and what they did lately (banned ones are out of the plan).
            # re-plans take the broadcast tracker's latest read of every card shard when it is fresh enough
            fresh_cards = functools.partial(self.overlay.get_cards, max_age_s=self.broadcast.refresh_s)
            self.activation.ensure_running(stop, fresh_cards, intake.activity)
            step_started = time.monotonic()
            if not await self._wait_for_batch(stop):
                break
            waited = time.monotonic() - step_started
            groups = intake.buffer.take(self.version, train.prompts_per_step)
            # From here on the intake serves the next step: its slot is the one new work can still fill,
            # and a group too old for it is refused now rather than buffered only to go stale.
            intake.advance(self.version + 1)  # the batch left the buffer: held lease requests can be answered
            stats = await asyncio.to_thread(self.trainer.step, groups, self.version)
            self._judge(groups, stats.pop("refused_groups", []), stats.pop("group_evidence", []))
            self.steps_done += 1
            trained_version = self.version
            self.version += 1
            t_publish = await self._publish() if self.steps_done % train.publish_every == 0 else 0.0
            if train.min_step_s is not None:  # emulate a larger model's step time (benchmarks)
                pad = train.min_step_s - (time.monotonic() - step_started - waited)
                if pad > 0:
                    await asyncio.sleep(pad)
            busy = time.monotonic() - step_started - waited
            self.wait_s += waited
            self.busy_s += busy
            self.activation.on_step(busy)
            if stats.get("groups_trained", len(groups)):  # a step whose every group was refused trained nothing
                self.recent_rewards.append(stats["reward_mean"])
            self._write_metrics(groups, stats, trained_version=trained_version, started=started,
                                step_started=step_started, waited=waited, busy=busy, t_publish=t_publish)
            if self.steps_done % train.checkpoint_every == 0:
                await self._checkpoint()
            if train.reward_target is not None and len(self.recent_rewards) == self.recent_rewards.maxlen \
                    and sum(self.recent_rewards) / len(self.recent_rewards) >= train.reward_target:
                logger.info("reward target %.3f reached at step %d", train.reward_target, self.steps_done)
                break
        if not stop.is_set():
            await self._finish()
            stop.set()  # training is over: the daemon shuts down cleanly

    def _judge(self, groups: list[Group], refused: list[tuple[str, str, str]],
               evidence: Sequence[GroupEvidence] = ()) -> None:
        """Strikes for groups verification refused (lies), counts for atypical ones; their prompts go out
        again, to other peers; each group's evidence to its peer's sequential tests, whose crossing bans;
        the rest is verified work, which graduation and activation count."""
        assert self.intake is not None
        for peer, prompt_id, reason in refused:
            logger.warning("group %s from %s failed verification (%s): not trained on", prompt_id, peer, reason)
            if reason == "atypical_text":  # statistical, and honest samples reach its tail now and then
                self.ledger.stats["verify_atypical"] += 1
            else:  # logprobs that do not match the behaviour version: a lie
                self.intake.strike(peer, f"verify_{reason}")
        for measured in evidence:
            if self.ledger.banned(measured.peer_id) is not None:
                continue
            crossing = self.statistics.observe(measured)
            if crossing is not None:
                logger.warning("peer %s failed its sequential test (%s)", crossing.peer_id, crossing.describe())
                self.intake.strike(crossing.peer_id, "verify_peer_statistics", conclusive=True)
        thrown = {(peer, prompt_id) for peer, prompt_id, _ in refused}
        self.intake.reissue([g for g in groups if (g.peer_id, g.prompt_id) in thrown])
        verified = [g for g in groups if (g.peer_id, g.prompt_id) not in thrown]
        self.intake.verified(verified)  # graduation from probation (learner/accountability.py)
        self.activation.on_verified(g.peer_id for g in verified)  # what activation plans with (learner/activation_loop.py)

    def _write_metrics(self, groups: list[Group], stats: dict[str, Any], *, trained_version: int, started: float,
                       step_started: float, waited: float, busy: float, t_publish: float) -> None:
        assert self.intake is not None and self.metrics is not None
        intake = self.intake
        now = time.monotonic()
        self.metrics.write({
            "step": self.steps_done, "version": trained_version, "published_version": intake.published_version,
            "time_s": round(now - started, 3), **{k: _round(v) for k, v in stats.items()},
            "t_publish_s": round(t_publish, 4), "wait_s": round(waited, 4),
            "t_bcast_s": _round(self.broadcast.t_bcast_s),
            "bubble_ratio": round(waited / max(1e-9, waited + busy), 4),
            "bubble_ratio_total": round(self.wait_s / max(1e-9, self.wait_s + self.busy_s), 4),
            "staleness": [trained_version - g.version for g in groups], "inflight_cap": intake.capacity,
            "accepted": intake.accepted, "refused": dict(intake.refused), "dropped": dict(intake.buffer.dropped),
            "leases": dict(intake.leases.stats), "delivered": dict(intake.delivered),
            "tokens_per_s": round(stats["tokens"] / max(1e-9, now - step_started), 1),
            **self.activation.step_metrics(waited + busy),
        }, groups=groups)  # every metrics.samples_every steps a few decoded completions go with it

    async def _wait_for_batch(self, stop: asyncio.Event) -> bool:
        assert self.intake is not None
        needed = self.train.prompts_per_step
        last_check = time.monotonic()
        while not self.intake.buffer.ready(self.version, needed):
            if stop.is_set():
                return False
            self.intake.wake.clear()
            self.intake.expire_leases()
            if time.monotonic() - last_check > self.config.overlay.announce_period_s:
                last_check = time.monotonic()
                await self._revoke_departed()
            await wait_any(self.intake.wake, stop, timeout=self.config.leases.expiry_check_s)
        return True

    async def _revoke_departed(self) -> None:
        """Re-issue at once the leases of peers whose cards vanished (dead), rather than at their timeout."""
        assert self.intake is not None
        holders = {lease.peer_id for lease in self.intake.leases.open.values()}
        if not holders:
            return
        cards, _ = await self.overlay.get_cards(max_age_s=self.broadcast.refresh_s)  # the tracker's, if fresh
        alive = {c.peer_id for c in cards if c.state != "stopping"}
        for peer in holders - alive:
            n = self.intake.leases.drop_peer(peer)
            self.intake.work_freed()
            logger.info("peer %s left the swarm: re-issuing its %d open prompts", peer[-8:], n)

    # -- checkpoints ---------------------------------------------------------------------------
    async def _checkpoint(self) -> None:
        assert self.intake is not None and self.trainer is not None
        try:
            await asyncio.to_thread(self.trainer.assert_finite)
        except NonFiniteWeightsError as e:  # a checkpoint of a non-finite policy would be resumed from
            await self._roll_back(str(e))
            return
        path = await asyncio.to_thread(
            save_checkpoint, self.run_dir, step=self.steps_done, version=self.version, trainer=self.trainer,
            extra=self.intake.leases.snapshot(), keep=self.train.keep_checkpoints,
        )
        logger.info("checkpoint step %d (version %d) at %s", self.steps_done, self.version, path)

    async def _finish(self) -> None:
        assert self.intake is not None and self.trainer is not None
        self.intake.finish()
        await self._checkpoint()
        final = await asyncio.to_thread(self.trainer.save_model_dir, self.run_dir / "final")
        logger.info("training finished after %d steps; final model at %s", self.steps_done, final)

    # -- what the daemon reports ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        broadcast = self.broadcast
        out: dict[str, Any] = {"published_version": self.published.version if self.published else None,
                               "steps_done": self.steps_done, "t_bcast_s": _round(broadcast.t_bcast_s),
                               "t_bcast": {str(v): round(t, 3) for v, t in broadcast.t_bcast.items()},
                               # planned receivers left out of T_bcast(v) for never reporting v
                               "t_bcast_unreported": {str(v): n for v, n in broadcast.unreported.items()}}
        if self.intake is not None:
            out.update(accepted=self.intake.accepted, refused=dict(self.intake.refused),
                       dropped=dict(self.intake.buffer.dropped), leases=dict(self.intake.leases.stats),
                       peers=self.intake.ledger.snapshot())
        out["capacity"] = self.activation.snapshot()
        out["rollbacks"] = self.rollbacks
        if self.verifiers is not None:
            out["verifiers"] = self.verifiers.snapshot()
        out.update(self.publisher.stats())  # "versions" (per recent version), "publish" (the newest one's)
        return out


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value
