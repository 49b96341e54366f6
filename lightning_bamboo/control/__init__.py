"""The processes and store protocols outside training (no Lightning): the job's store and etcd, the
step commit, joins, drains and crashes as store protocols, the coordinator, supervisor, agents
and their workers.
"""
