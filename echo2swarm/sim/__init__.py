"""`echo2swarm simulate`: the swarm's control plane and broadcast at sizes no machine here can run.

The peers and their links are modelled (`population.py`); what the daemons decide is not: the card
shards and the depth the learner asks for (overlay/dht_keys.py, overlay/shards.py `ShardDepth`), the
broadcast plan (policy/broadcast_plan.py `plan_chains`, `BroadcastPlan.upstream`), the capacity
floor and the cheapest active set (control/capacity.py, control/activation.py) are the project's
own code, run on the modelled swarm. docs/benchmarks.md ("Simulated swarms") has the model's
assumptions and its results.
"""
