"""The control plane (no Lightning): the agent of each machine, its workers, the election and leases of
the machines, and the coordinator that decides every generation. What it exchanges with the workers
through the store is :mod:`lightning_bamboo.protocol`.
"""
