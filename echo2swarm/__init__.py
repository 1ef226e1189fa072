"""echo2swarm: a peer-to-peer swarm for RL post-training of LLMs (ECHO-2 design).

One learner trains with GRPO; many remote rollout peers generate; every participant runs the same
daemon on a hivemind DHT overlay. See docs/architecture.md for the planes and docs/protocol.md for the wire protocol.
"""

__version__ = "0.1.0"
