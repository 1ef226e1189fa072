"""echo2swarm: a peer-to-peer swarm for RL post-training of LLMs (ECHO-2 design).

One learner trains with GRPO; many remote rollout peers generate; every participant runs the same
daemon on a hivemind DHT overlay. See ARCHITECTURE in the docs for the planes and the protocol.
"""

__version__ = "0.1.0"
