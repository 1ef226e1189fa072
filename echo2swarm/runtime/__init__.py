"""Leaf utilities shared by every role: logging, child processes, asyncio helpers and back-off, devices and cores."""
