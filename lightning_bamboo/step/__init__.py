"""One training step on one member: the step session with its one retry loop, clipping agreed before the
commit, tied weights, keyed random numbers, and the broadcasts that never pickle.
"""
