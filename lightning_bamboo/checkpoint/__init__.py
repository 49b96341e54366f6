"""Checkpoints: Lightning's sharded folders (:mod:`.sharded`) and the periodic snapshots the elastic runtime
falls back to (:mod:`.periodic`)."""
