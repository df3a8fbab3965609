"""The decoding loop above the core: a generation's sessions, its steps and events (engine.py,
step.py), replay along a recorded trace (replay.py)."""
