"""One pipeline step on one worker: the engine running a schedule's actions, the transfers between
stages, micro-batches, and the stage layout (which layers make each stage)."""
