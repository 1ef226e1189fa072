"""The DHT overlay: the only package that imports hivemind.

Node lifecycle (`node`), DHT keys (`keys`), record schemas (`records`), store-time validation
(`validation`) and the periodic announcer (`announcer`).
"""
