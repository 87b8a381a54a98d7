"""What train.py trains: `train_copy` (--task=copy, the one-minute wiring
check) and `train_translation` (--task=translate)."""
