"""What train.py trains: `copy` (the one-minute wiring check) and `translate`."""
