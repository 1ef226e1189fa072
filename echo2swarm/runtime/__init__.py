"""Process-level plumbing shared by every role: logging, the daemon supervisor, child processes."""
