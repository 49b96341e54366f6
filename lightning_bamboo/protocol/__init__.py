"""What the workers and the control plane exchange through the job's store (no Lightning): the store and
its keys (a TCPStore or etcd), the step commit, joins, drains, crashes and the workers' NCCL environment.
Both sides import it; neither imports the other.
"""
