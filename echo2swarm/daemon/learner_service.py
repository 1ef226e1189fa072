"""The learner's service inside the daemon: train with GRPO, publish signed versions, checkpoint.

    rollout peers ─rpc_lease/rpc_submit─► Intake ─► RolloutBuffer ─► GRPOTrainer.step (thread)
         ▲                                                               │
         └── chunk server ◄── Publisher (signed version v+1, every κ) ◄──┘ ─► metrics.jsonl, checkpoints

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
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from echo2swarm.config.models import LearnerConfig
from echo2swarm.daemon import live_page
from echo2swarm.daemon.context import CardFields, DaemonContext, Stats
from echo2swarm.learner.accountability import PeerLedger
from echo2swarm.learner.activation_loop import LearnerActivation
from echo2swarm.learner.broadcast_tracker import BroadcastTracker
from echo2swarm.learner.checkpoint import load_latest, save_checkpoint
from echo2swarm.learner.intake import Intake
from echo2swarm.learner.leases import GroupLimits
from echo2swarm.learner.metrics import MetricsLog
from echo2swarm.learner.publisher import WEIGHTS_FILE, DeltaBase, PublishedVersion, Publisher, model_files
from echo2swarm.train.verify import NonFiniteWeightsError
from echo2swarm.overlay.rpc import rpc_name, serve_client_stream, serve_unary
from echo2swarm.policy.server import Handler
from echo2swarm.policy.store import collect_garbage
from echo2swarm.runtime.aio import wait_any
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.wire.work import GroupSubmission, LeaseRequest

logger = get_logger(__name__)


class LearnerService:
    def __init__(self, config: LearnerConfig, ctx: DaemonContext):
        self.ctx = ctx
        self.config = config
        self.train = config.train
        self.key = PolicyKey.load(self.config.publish.policy_key)  # type: ignore[arg-type]
        self.publisher = Publisher(
            self.config.overlay.swarm, self.key, ctx.chunks, ctx.versions, self.config.publish.chunk_size, ctx.overlay.peer_id,
            delta_chunk_size=self.config.publish.delta_chunk_size,
        )
        refresh_s = config.publish.cards_refresh_s or min(2.0, config.overlay.announce_period_s / 2)
        self.ledger = PeerLedger(config.peers)  # who is on probation, capped or banned (intake, trainer, broadcast)
        self.broadcast = BroadcastTracker(ctx.overlay, self.key, config.publish.seeds, refresh_s=refresh_s,
                                          excluded=lambda: self.ledger.bans.keys())
        self.run_dir = Path(self.train.run_dir or Path(self.config.state_dir) / "run")
        self.published: PublishedVersion | None = None
        self.state = "starting"
        self.version = 1
        self.steps_done = 0
        self.intake: Intake | None = None
        self.trainer: Any = None
        self.metrics: MetricsLog | None = None
        self.recent_rewards: deque[float] = deque(maxlen=10)
        self.extra_files: dict[str, Path | bytes] = {}  # config and tokenizer files published with each version
        self.wait_s = self.busy_s = 0.0
        self.rollbacks = 0  # times the policy went non-finite and was reset to the last published version
        # Delta versions: the last published tensors and the last keyframe's (publish dtype), the bytes
        # of the deltas since that keyframe, and what each recent version cost (stats, /metrics).
        self.previous: DeltaBase | None = None
        self.keyframe: DeltaBase | None = None
        self.chain_bytes = 0
        self.history: deque[PublishedVersion] = deque(maxlen=16)
        self.published_kinds: Counter[str] = Counter()  # versions published, by kind (dense / delta)
        # Cost-aware activation (docs/architecture.md §8); T_bcast from the broadcast tracker once it measures one.
        self.activation = LearnerActivation(config.activation, self.train, t_bcast=lambda: self.broadcast.t_bcast_s)

    # -- start ---------------------------------------------------------------------------------
    async def start(self) -> None:
        # torch + transformers: only in the learner. Under torchrun (W > 1) this is rank 0 of a sharded
        # trainer; ranks 1..W-1 follow its commands (train/distributed.py, started by `daemon`).
        from echo2swarm.train.distributed import make_trainer
        from echo2swarm.tasks.registry import get_task

        model_dir = Path(self.config.publish.model)  # type: ignore[arg-type]
        versions = self.ctx.versions
        self.trainer = await asyncio.to_thread(
            make_trainer, model_dir, self.train, verify=self.config.verify,
            # Behaviour versions within the staleness window are on disk: the learner keeps S + 4 versions.
            weights_of=lambda v: versions.dir(v) if versions.installed(v) else None,
        )
        task = get_task(self.train.task, seed=self.train.seed, **self.train.task_options)
        cursor, requeue = 0, []
        checkpoint = await asyncio.to_thread(load_latest, self.run_dir)
        if checkpoint is not None:
            await asyncio.to_thread(checkpoint.restore, self.trainer)  # written by any number of ranks
            self.steps_done = checkpoint.step
            cursor = checkpoint.state["extra"]["cursor"]
            requeue = checkpoint.state["extra"]["requeue"]
            logger.info("resuming from %s: %d steps done", checkpoint.path, checkpoint.step)
        # Strictly above anything published before, even versions published after the checkpoint.
        self.version = max(checkpoint.version if checkpoint else 1, (self.ctx.versions.latest() or 0) + 1)
        # Weights come from the trainer; a sharded model's index no longer applies to the single file we publish.
        self.extra_files = {p.name: p for p in model_files(model_dir)
                            if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"}
        with contextlib.suppress(Exception):  # followers already in the swarm get the first version by plan
            self.broadcast.observe((await self.ctx.overlay.get_cards())[0])
        await self._publish()
        # In a thread: wandb.init may take up to metrics.wandb_init_timeout_s, and the DHT keeps announcing meanwhile.
        self.metrics = await asyncio.to_thread(MetricsLog, self.run_dir, self.config.metrics, decode=self.trainer.decode,
                                               hparams=self.config.model_dump(mode="json"))
        self.intake = Intake(
            task, self.train, self.config.leases,
            encode=self.trainer.encode_prompt, decode=self.trainer.decode,
            limits=GroupLimits(self.train.group_size, self.train.max_new_tokens, self.trainer.vocab_size,
                               self.trainer.eos_token_ids),
            version=self.version, cursor=cursor, requeue=requeue, gate=self.activation, head_json=self._head_json(),
            ledger=self.ledger,
        )
        p2p, swarm = self.ctx.overlay.p2p, self.config.overlay.swarm
        await serve_unary(p2p, rpc_name(swarm, "lease"), self.intake.rpc_lease, LeaseRequest)
        await serve_client_stream(p2p, rpc_name(swarm, "submit"), self.intake.rpc_submit, GroupSubmission)
        self.state = "ready"
        logger.info("policy key %s; followers pin it with --trust %s", self.key.public.fingerprint, self.key.public.text)

    async def _publish(self) -> float:
        """Publish the policy in the engine's dtype (publish.dtype) as version `self.version`: a keyframe
        or a delta against the previous version (learner/publisher.py)."""
        started = time.perf_counter()
        publish = self.config.publish
        try:
            # the previous version's values are held where the masters stay near them (publish.hold_ulps)
            state = await asyncio.to_thread(self.trainer.weights_state, self.trainer.publish_dtype(publish.dtype),
                                            self.previous.tensors if self.previous else None, publish.hold_ulps)
        except NonFiniteWeightsError as e:  # never signed; training goes on from the last good version
            await self._roll_back(str(e))
            return time.perf_counter() - started
        if self.previous is None:
            await asyncio.to_thread(self._load_bases, state)
        published = await asyncio.to_thread(
            self.publisher.publish_state, state, self.extra_files, self.version, previous=self.previous,
            keyframe=self.keyframe, keyframe_every=publish.keyframe_every, max_ratio=publish.delta_max_ratio,
            chain_bytes=self.chain_bytes, composites=publish.composites,
        )
        self.published = published
        self.history.append(published)
        self.published_kinds[published.kind] += 1
        # A copy: on the CPU in the master dtype, the trainer's cast is the live parameters themselves,
        # which the next step changes in place (the next delta would then be against itself).
        base = await asyncio.to_thread(lambda: {name: t.clone() for name, t in state.items()})
        self.previous = DeltaBase(published.version, published.manifest_sha256, base)
        if published.kind == "dense":
            self.keyframe, self.chain_bytes = self.previous, 0
        else:
            self.chain_bytes += published.delta_bytes or 0
        self.broadcast.plan(self.version)
        # Keep a few versions beyond the staleness window (a slow follower may still be fetching one),
        # and the last keyframe with every version since: the paths followers catch up by.
        keep = max(self.config.store.keep_versions, self.train.staleness + 4)
        assert self.keyframe is not None
        chain = set(range(self.keyframe.version, published.version + 1))
        await asyncio.to_thread(collect_garbage, self.ctx.versions, self.ctx.chunks, keep, chain)
        if self.intake is not None:
            self.intake.published(self.version, self._head_json())
        self.ctx.announcer.trigger()
        return time.perf_counter() - started

    async def _roll_back(self, why: str) -> None:
        """The policy went non-finite: reload the last version published (finite: it was checked when
        signed) and forget the optimizer's moments, which went the same way."""
        if self.published is None:
            raise RuntimeError(f"the initial policy is not finite: {why}")
        logger.error("NOT publishing v%d: %s; rolling back to v%d's weights and resetting the optimizer state",
                     self.version, why, self.published.version)
        from safetensors.torch import load_file

        if self.previous is not None and self.previous.version == self.published.version:
            tensors = self.previous.tensors  # in the publish dtype; load_weights casts into the fp32 masters
        else:
            path = self.ctx.versions.dir(self.published.version) / WEIGHTS_FILE
            tensors = await asyncio.to_thread(load_file, str(path))
        self.trainer.load_weights(tensors)
        self.trainer.reset_optimizer()  # on every rank of a sharded learner
        self.rollbacks += 1

    def _load_bases(self, state: dict[str, Any]) -> None:
        """After a restart: the last version in our store (and its keyframe) as delta bases, when its
        weights have the same tensors and dtypes as `state`; otherwise the next version is a keyframe."""
        from safetensors.torch import load_file

        from echo2swarm.policy.manifest import sha256_hex

        versions = self.ctx.versions
        latest = versions.latest()
        manifest = versions.manifest(latest) if latest is not None else None
        if manifest is None or manifest.weights_file is None or any(t.sha256 is None for t in manifest.tensors):
            return
        keyframe_version = manifest.keyframe.version if manifest.keyframe is not None else manifest.version
        bases = []
        for v in (manifest.version, keyframe_version):
            data = versions.manifest_bytes(v)
            if data is None or not (versions.dir(v) / WEIGHTS_FILE).is_file():
                return
            tensors = load_file(str(versions.dir(v) / WEIGHTS_FILE))
            if set(tensors) != set(state) or any(tensors[k].dtype != state[k].dtype for k in state):
                return
            bases.append(DeltaBase(v, sha256_hex(data), tensors))
        self.previous, self.keyframe = bases
        logger.info("delta base after restart: v%d (keyframe v%d)", self.previous.version, self.keyframe.version)

    def head(self) -> HeadRecord | None:
        if self.published is None:
            return None
        overlay = self.ctx.overlay  # where followers reach us, as the supervisor advertised it
        return self.publisher.sign_head(self.published, self.config.overlay.record_ttl_s, overlay.chunk_url, overlay.maddrs)

    def _head_json(self) -> str | None:
        head = self.head()
        return head.model_dump_json() if head else None

    # -- training loop -------------------------------------------------------------------------
    async def _revoke_departed(self) -> None:
        """Re-issue at once the leases of peers whose cards vanished (dead), rather than at their timeout."""
        assert self.intake is not None
        holders = {lease.peer_id for lease in self.intake.leases.open.values()}
        if not holders:
            return
        cards, _ = await self.ctx.overlay.get_cards()
        alive = {c.peer_id for c in cards if c.state != "stopping"}
        for peer in holders - alive:
            n = self.intake.leases.drop_peer(peer)
            self.intake.work_freed()
            logger.info("peer %s left the swarm: re-issuing its %d open prompts", peer[-8:], n)

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

    async def run(self, stop: asyncio.Event) -> None:
        assert self.intake is not None and self.metrics is not None
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
        assert self.intake is not None and self.metrics is not None
        intake, train = self.intake, self.train
        while self.steps_done < train.steps and not stop.is_set():
            # Banned peers are out of the plan; `seen` is every peer that asked for work.
            self.activation.ensure_running(stop, self.ctx.overlay.get_cards, lambda: set(intake.seen) - set(intake.ledger.bans))
            step_started = time.monotonic()
            if not await self._wait_for_batch(stop):
                break
            waited = time.monotonic() - step_started
            groups = intake.buffer.take(self.version, train.prompts_per_step)
            # From here on the intake serves the next step: its slot is the one new work can still fill,
            # and a group too old for it is refused now rather than buffered only to go stale.
            intake.advance(self.version + 1)  # the batch left the buffer: held lease requests can be answered
            stats = await asyncio.to_thread(self.trainer.step, groups, self.version)
            refused = stats.pop("refused_groups", [])
            for peer, prompt_id, reason in refused:
                logger.warning("group %s from %s failed verification (%s): not trained on", prompt_id, peer, reason)
                if reason == "atypical_text":  # statistical, and honest samples reach its tail now and then
                    self.ledger.stats["verify_atypical"] += 1
                else:  # logprobs that do not match the behaviour version: a lie
                    intake.strike(peer, f"verify_{reason}")
            thrown = {(peer, prompt_id) for peer, prompt_id, _ in refused}
            intake.reissue([g for g in groups if (g.peer_id, g.prompt_id) in thrown])
            self.steps_done += 1
            trained_version = self.version
            self.version += 1
            t_publish = 0.0
            if self.steps_done % train.publish_every == 0:
                t_publish = await self._publish()
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
            self.metrics.write({
                "step": self.steps_done, "version": trained_version, "published_version": intake.published_version,
                "time_s": round(time.monotonic() - started, 3), **{k: _round(v) for k, v in stats.items()},
                "t_publish_s": round(t_publish, 4), "wait_s": round(waited, 4),
                "t_bcast_s": _round(self.broadcast.t_bcast_s),
                "bubble_ratio": round(waited / max(1e-9, waited + busy), 4),
                "bubble_ratio_total": round(self.wait_s / max(1e-9, self.wait_s + self.busy_s), 4),
                "staleness": [trained_version - g.version for g in groups], "inflight_cap": intake.capacity,
                "accepted": intake.accepted, "refused": dict(intake.refused), "dropped": dict(intake.buffer.dropped),
                "leases": dict(intake.leases.stats), "delivered": dict(intake.delivered),
                "tokens_per_s": round(stats["tokens"] / max(1e-9, time.monotonic() - step_started), 1),
                **self.activation.step_metrics(waited + busy),
            }, groups=groups)  # every metrics.samples_every steps a few decoded completions go with it
            if self.steps_done % train.checkpoint_every == 0:
                await self._checkpoint()
            if train.reward_target is not None and len(self.recent_rewards) == self.recent_rewards.maxlen \
                    and sum(self.recent_rewards) / len(self.recent_rewards) >= train.reward_target:
                logger.info("reward target %.3f reached at step %d", train.reward_target, self.steps_done)
                break
        if not stop.is_set():
            await self._finish()
            stop.set()  # training is over: the daemon shuts down cleanly

    async def _checkpoint(self) -> None:
        assert self.intake is not None
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
        assert self.intake is not None
        self.intake.finish()
        await self._checkpoint()
        final = await asyncio.to_thread(self.trainer.save_model_dir, self.run_dir / "final")
        logger.info("training finished after %d steps; final model at %s", self.steps_done, final)

    # -- daemon hooks --------------------------------------------------------------------------
    async def announce(self) -> None:
        head = self.head()
        if head is not None and not await self.ctx.overlay.store_head(head):
            logger.warning("no DHT peer accepted the head record for v%d", head.version)

    def signed_plan(self, version: int) -> bytes | None:
        return self.broadcast.get_plan(version)

    def http_routes(self) -> list[tuple[str, Handler]]:
        """The live swarm page and the JSON it reads (daemon/live_page.py)."""
        return live_page.routes(self)

    def card_fields(self) -> CardFields:
        t_bcast = self.broadcast.t_bcast_s
        bans = {peer: ban.reason for peer, ban in self.intake.ledger.bans.items()} if self.intake else {}
        return CardFields(version=self.published.version if self.published else None, state=self.state,
                          t_bcast_s=None if t_bcast is None else round(t_bcast, 3), bans=bans,
                          published=[{"version": p.version, "kind": p.kind, "dense_bytes": p.dense_bytes,
                                     "delta_bytes": p.delta_bytes} for p in list(self.history)[-8:]])

    def stats(self) -> Stats:
        out: dict[str, Any] = {"published_version": self.published.version if self.published else None,
                               "steps_done": self.steps_done, "t_bcast_s": _round(self.broadcast.t_bcast_s),
                               "t_bcast": {str(v): round(t, 3) for v, t in self.broadcast.t_bcast.items()},
                               # planned receivers left out of T_bcast(v) for never reporting v
                               "t_bcast_unreported": {str(v): n for v, n in self.broadcast.unreported.items()}}
        if self.intake is not None:
            out.update(accepted=self.intake.accepted, refused=dict(self.intake.refused),
                       dropped=dict(self.intake.buffer.dropped), leases=dict(self.intake.leases.stats),
                       peers=self.intake.ledger.snapshot())
        out["capacity"] = self.activation.snapshot()
        out["rollbacks"] = self.rollbacks
        # per version: dense or delta, dense bytes, delta bytes, ratio (dense / delta), composite bytes
        out["versions"] = {str(p.version): p.report() for p in self.history}
        if self.published is not None:  # the newest version's figures (gauges in /metrics)
            last = self.published.report()
            out["publish"] = {"dense_bytes": last["dense_bytes"], "delta_bytes": last["delta_bytes"],
                              "composite_bytes": last["composite_bytes"], "delta_ratio": last["ratio"],
                              "kinds": dict(self.published_kinds)}
        return out


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value
