"""The daemon every participant runs: the supervisor and the role services it hosts.

It sits above the planes (overlay, policy, rollout, learner, control) and wires them together;
nothing below imports it. See docs/architecture.md for the layer order.
"""
