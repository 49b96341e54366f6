"""What makes the runtime elastic: the job's store, ownership maps, the supervisor, joins, drains, moving
layers between members, and the membership changes of the strategy (:mod:`.runtime`).

Imports nothing heavy: the supervisor (``python -m lightning_bamboo.launch``) runs without Lightning."""
