"""Messages both sides of an exchange speak, and how they are signed.

    signing.py    Ed25519 policy keys, canonical bytes, signature domains
    peer_keys.py  libp2p identity keys: peer ids, p2pd's key file, signatures by a peer id's owner
    records.py    DHT records: PeerCard, HeadRecord (the overlay stores them, every plane reads them)
    work.py       the learner <-> rollout RPC messages (lease, submit)
    sampling.py   the seeded sampler a lease names: its reference, in plain integers and floats
    reach.py      the dial-back probe's request and reply (overlay/reachability.py asks it)
    checks.py     the learner <-> verifier daemon exact-check messages
    ids.py        a peer id's text as messages, records and configs check it
    schema.py     the one-line description of a message that fails its schema
    surfaces.py   the RPC surfaces, declared once: verbs, call shapes, request and reply types

What a version is made of lives with the code that makes and checks it, in `policy/`: the signed
manifest (`policy/manifest.py`), the broadcast plan (`policy/broadcast_plan.py`) and the delta
format (`policy/delta.py`); only the policy plane and the learner's publisher use them. Nothing
here does I/O. It sits below the overlay and every plane, so neither side of an exchange imports
the other's package to learn the shape of a message.
"""
