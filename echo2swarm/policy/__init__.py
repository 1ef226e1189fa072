"""Policy dissemination: signing keys, manifests, chunking, the chunk store, server and fetcher."""
