"""Fails the whole run, loudly, if the native library did not build: importing ddpcomm.ops
loads ddpcomm._C and raises with the reason otherwise. Tests never fall back to
reference.py for the ops they check."""

import ddpcomm.ops  # noqa: F401
