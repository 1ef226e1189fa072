"""Exact checks on verifier daemons (learner/verifiers.py, train/exact.py): the figures a verifier
computes from the wire's rows give the learner the verdicts its own forward gives; a verifier serves
only the learner whose head lists it; the learner asks by its offload rule and counts what happens.

Real tiny models, a real trainer and engine (helpers/verify_lab.py), the real `CheckServer` and the
wire's msgpack encoding; only the libp2p hop between the two is a direct call here (the swarm test,
tests/swarm/test_training.py, runs it over libp2p).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.verify_lab import Lab

from echo2swarm.config.models import CheckConfig
from echo2swarm.config.rl import VerifyConfig
from echo2swarm.learner.verifiers import CheckServer, RemoteVerifiers
from echo2swarm.models.tiny import write_tiny_model
from echo2swarm.overlay.rpc import decode, encode
from echo2swarm.rollout.engines.hf import TransformersEngine
from echo2swarm.train.verify import Verifier
from echo2swarm.wire.checks import CheckFigures, CheckRefused, CheckRequest

LEARNER = "12D3KooWJ6B2dR1cj3sPNvLxGcUW4bXJmXhAEc3X8aMdkQx4yWqb"
VERIFIER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
STRANGER = "12D3KooWHnrXGC5ULXxiX5bT5sFbQkTz7WQ9YpzDv9KaaxZHDmyb"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The daemon's event loop, in its own thread: the trainer's thread asks through it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


class WireStub:
    """`RpcStub`'s `check`, with the wire's encoding both ways and the real server behind it."""

    def __init__(self, server: CheckServer, caller: str = LEARNER):
        self.server, self.caller, self.calls = server, caller, 0

    async def check(self, request: CheckRequest, *, timeout: float) -> CheckFigures | CheckRefused:
        self.calls += 1
        sent = decode(encode(request), CheckRequest)
        reply = await asyncio.wait_for(self.server.rpc_check(sent, self.caller), timeout)
        kind = CheckFigures if isinstance(reply, CheckFigures) else CheckRefused
        return decode(encode(reply), kind)


def server_for(lab: Lab, listed: tuple[str, ...] = (VERIFIER,)) -> CheckServer:
    return CheckServer(CheckConfig(device="cpu", threads=1), VERIFIER, learner=lambda: (LEARNER, frozenset(listed)),
                       version_dir=lambda v: lab.dir(v) if lab.dir(v).is_dir() else None)


def remote_for(lab: Lab, loop: asyncio.AbstractEventLoop, server: CheckServer, free: int | None = 0,
               **config) -> RemoteVerifiers:
    remote = RemoteVerifiers(None, "t", VerifyConfig(verifiers=[VERIFIER], **config), loop,
                             free_bytes=lambda device: free)
    remote.stubs[VERIFIER] = WireStub(server)  # type: ignore[assignment]
    return remote


def remote_verifier(lab: Lab, remote: RemoteVerifiers | None, **config) -> Verifier:
    return Verifier(VerifyConfig(seed=0, **config), temperature=lab.config.temperature, top_p=lab.config.top_p,
                    weights_of=lab.weights_of, make_spare=lab.trainer._verify_spare, remote=remote)


def test_a_verifier_daemons_figures_give_the_learners_verdicts(peaked_model_dir: Path, tmp_path: Path,
                                                               loop: asyncio.AbstractEventLoop) -> None:
    lab = Lab(peaked_model_dir, tmp_path / "lab", publish_dtype=torch.bfloat16, verify=VerifyConfig(seed=0))
    honest = lab.generate(range(300, 306), 1, seed=21, seeded=True)
    greedy = lab.generate(range(310, 313), 1, seed=22, seeded=True, temperature=0.0, peer="greedy")
    other = TransformersEngine(write_tiny_model(tmp_path / "other", seed=1), threads=1)
    swapped = lab.generate(range(320, 323), 1, seed=23, seeded=True, engine=other, peer="swapped")
    for g in greedy + swapped:
        lab.true_logprobs(g, 1)  # exact logprobs: only the choices lie
        g.seed = 22 if g.peer_id == "greedy" else 23
    lab.train(lab.generate(range(100, 112), 1, seed=12, seeded=True))  # v2: the groups above are one version old
    groups = honest + greedy + swapped

    local = lab.check(remote_verifier(lab, None, sample_fraction=1.0), groups)
    server = server_for(lab)
    remote = remote_for(lab, loop, server, offload="always")
    result = lab.check(remote_verifier(lab, remote, sample_fraction=1.0), groups)

    assert result.exact == local.exact == len(groups) and result.remote == len(groups) and local.remote == 0
    assert [r.as_tuple() for r in result.refusals] == [r.as_tuple() for r in local.refusals]
    assert {r.peer_id for r in result.refusals} == {"greedy", "swapped"}  # and no honest group
    for mine, theirs in zip(local.evidence, result.evidence, strict=True):  # the per-peer tests' inputs agree
        assert mine.positions == theirs.positions
        assert mine.choice == pytest.approx(theirs.choice, abs=1e-3)
        assert mine.z == pytest.approx(theirs.z, abs=1e-3)
    assert server.stats["served"] == 1 and server.stats["rows"] == 8 * len(groups)  # one version, one call
    assert remote.stats["answered"] == 1 and remote.by_peer[VERIFIER]["answered"] == 1


def test_a_verifier_serves_only_the_learner_that_lists_it(peaked_model_dir: Path, tmp_path: Path) -> None:
    lab = Lab(peaked_model_dir, tmp_path / "lab", verify=VerifyConfig(seed=0))
    groups = lab.generate(range(300, 302), 1, seed=21, seeded=True)
    batch = lab.trainer.build_batch(groups)
    from echo2swarm.train.exact import ExactSettings, requests_of

    (request,) = requests_of(1, batch.input_ids, batch.attention_mask, batch.completion_mask, None,
                             ExactSettings(1.0, 1.0, True, 1.0, 0.25))

    def ask(server: CheckServer, caller: str, req: CheckRequest = request) -> CheckFigures | CheckRefused:
        return asyncio.run(server.rpc_check(req, caller))

    listed = server_for(lab)
    assert isinstance(ask(listed, LEARNER), CheckFigures)
    stranger = ask(listed, STRANGER)  # any other peer: no free compute for strangers
    assert isinstance(stranger, CheckRefused) and stranger.reason == "not_listed"
    unlisted = ask(server_for(lab, listed=()), LEARNER)  # the head does not list this verifier
    assert isinstance(unlisted, CheckRefused) and unlisted.reason == "not_listed"
    missing = ask(listed, LEARNER, request.model_copy(update={"version": 9}))
    assert isinstance(missing, CheckRefused) and missing.reason == "not_held"
    assert listed.stats["served"] == 1 and listed.stats["refused_not_listed"] == 1
    # Rows the version's model cannot take (an id past its vocabulary): refused as failed, not a crash.
    bad = request.model_copy(update={"rows": [request.rows[0].model_copy(update={"ids": [10**9] * 4,
                                                                                   "completion": 2})]})
    failed = ask(listed, LEARNER, bad)
    assert isinstance(failed, CheckRefused) and failed.reason == "failed"
    # A version whose forward gives NaN (damaged weights): no figures, so no honest peer is judged by them.
    import shutil

    from safetensors.torch import load_file, save_file

    nan_dir = tmp_path / "nan"
    shutil.copytree(lab.dir(1), nan_dir)
    tensors = load_file(nan_dir / "model.safetensors")
    name = next(n for n in tensors if n.endswith("norm.weight"))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(nan_dir / "model.safetensors"))
    broken = CheckServer(CheckConfig(device="cpu", threads=1), VERIFIER, learner=lambda: (LEARNER, frozenset([VERIFIER])),
                         version_dir=lambda v: nan_dir)
    nan = asyncio.run(broken.rpc_check(request, LEARNER))
    assert isinstance(nan, CheckRefused) and nan.reason == "failed" and "NaN" in nan.detail


def test_the_learner_offloads_by_its_rule_and_counts_what_it_could_not_check(
        peaked_model_dir: Path, tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    lab = Lab(peaked_model_dir, tmp_path / "lab", verify=VerifyConfig(seed=0))
    groups = lab.generate(range(300, 303), 1, seed=21, seeded=True)
    lab.train(lab.generate(range(100, 112), 1, seed=12, seeded=True))
    server = server_for(lab)

    roomy = remote_for(lab, loop, server, free=10**15)  # when_full, and room enough: computed here
    result = lab.check(remote_verifier(lab, roomy, sample_fraction=1.0), groups)
    assert result.exact == 3 and result.remote == 0 and roomy.stats["declined_room"] == 1
    assert server.stats["served"] == 0

    full = remote_for(lab, loop, server, free=1)  # no room: the verifier computes it
    result = lab.check(remote_verifier(lab, full, sample_fraction=1.0), groups)
    assert result.exact == 3 and result.remote == 3 and full.stats["no_room"] == 1 and server.stats["served"] == 1

    # No verifier answers (it does not list itself, say) and no room here: the check is unavailable,
    # counted, and the groups keep their plausibility verdicts; with `always`, the learner computes it.
    gone = server_for(lab, listed=())
    nowhere = remote_for(lab, loop, gone, free=1)
    result = lab.check(remote_verifier(lab, nowhere, sample_fraction=1.0), groups)
    assert result.unavailable == 3 and result.remote == 0 and result.refusals == []
    assert nowhere.stats["none_answered"] == 1 and nowhere.stats["refused_not_listed"] == 1
    fallback = remote_for(lab, loop, gone, offload="always")
    result = lab.check(remote_verifier(lab, fallback, sample_fraction=1.0), groups)
    assert result.exact == 3 and result.remote == 0 and result.unavailable == 0
    # What both sides count is exported on /metrics, every key of it.
    from echo2swarm.daemon.metric_names import unmapped

    assert unmapped({"role": "learner", "stats": {"verifiers": nowhere.snapshot()}}) == []
    assert unmapped({"role": "verifier", "stats": {"checks": gone.snapshot()}}) == []


def test_a_verifier_that_does_not_answer_rests_so_no_step_waits_on_it_again_soon(
        peaked_model_dir: Path, tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    from echo2swarm.learner.verifiers import REST_S
    from echo2swarm.overlay.rpc import RpcError

    lab = Lab(peaked_model_dir, tmp_path / "lab", verify=VerifyConfig(seed=0))
    groups = lab.generate(range(300, 302), 1, seed=21, seeded=True)
    lab.train(lab.generate(range(100, 112), 1, seed=12, seeded=True))

    class Gone:
        calls = 0

        async def check(self, request: CheckRequest, *, timeout: float) -> CheckFigures:
            Gone.calls += 1
            raise RpcError("connection refused")

    now = [1000.0]
    remote = remote_for(lab, loop, server_for(lab), offload="always")
    remote.stubs[VERIFIER] = Gone()  # type: ignore[assignment]
    remote.clock = lambda: now[0]
    for _ in range(2):  # computed here both times; the verifier asked once
        result = lab.check(remote_verifier(lab, remote, sample_fraction=1.0), groups)
        assert result.exact == 2 and result.remote == 0
    assert Gone.calls == 1 and remote.stats["failed"] == 1 and remote.stats["skipped"] == 1
    now[0] += REST_S + 1
    lab.check(remote_verifier(lab, remote, sample_fraction=1.0), groups)
    assert Gone.calls == 2
