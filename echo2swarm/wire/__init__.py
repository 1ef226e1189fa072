"""What crosses the network, and how it is signed: the types both sides of every exchange speak.

    signing.py  Ed25519 policy keys, canonical bytes, signature domains
    records.py  DHT records: PeerCard, HeadRecord (the overlay stores them, every plane reads them)
    work.py     the learner <-> rollout RPC messages (lease, submit)
    reach.py    the dial-back probe's messages
    surfaces.py the RPC surfaces, declared once: verbs, call shapes, request and reply types

Nothing here does I/O. It sits below the overlay and every plane, so neither side of an exchange
imports the other's package to learn the shape of a message.
"""
