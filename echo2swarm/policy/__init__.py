"""Policy dissemination: signed versions, from the learner's store to every follower's.

Manifests and the delta format (`manifest.py`, `delta.py`, `catchup.py`), broadcast plans
(`broadcast_plan.py`), the chunk and version stores (`store.py`), the chunk service over HTTP and
libp2p (`server.py`, `p2p.py`, `budgets.py`, `limiter.py`, `uplink.py`), and the follower that
fetches, rebuilds, verifies and installs versions (`follower.py`, `installer.py`, `fetcher.py`,
`sources.py`, `pipeline.py`, `orders.py`, `trust.py`). Signing keys are in `wire/signing.py`.
"""
