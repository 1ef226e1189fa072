"""The rollout plane: lease prompts from the learner, generate with the current policy, send groups back.

    worker.py      `RolloutWorker`: the lease loop, the engine's queue, submission
    refit.py       `EngineWeights`: the engine and the version it holds, refitted in place
    throughput.py  µ, the rollouts per engine second a peer advertises
    engines/       transformers and vLLM behind one protocol, by default in a process of their own

`daemon/follower_service.py` hosts the worker beside the policy follower.
"""
