"""The learning plane: the learner as the swarm sees it. Training itself is in `train/`.

    intake.py             serves `rpc_lease` and `rpc_submit`: checks, rewards, buffers each group
    leases.py             which prompts each peer holds, and whether what it sends back is acceptable
    buffer.py             the version-tagged rollout buffer the trainer takes its batches from
    accountability.py     per-peer caps, strikes and bans (`PeerLedger`)
    activation_loop.py    measure, plan and gate which rollout peers get leases (control/ holds the maths)
    broadcast_tracker.py  each version's broadcast plan, and T_bcast measured
    publisher.py          a trained state as a signed version: chunks, manifest, head
    checkpoint.py         model, optimizer, RNG and prompt cursor, written atomically
    metrics.py            per-step metrics: metrics.jsonl, TensorBoard, W&B

`daemon/learner_service.py` hosts them beside a trainer from `train/`.
"""
