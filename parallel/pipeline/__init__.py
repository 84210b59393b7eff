"""Pipeline parallelism: the Block partition, the schedules as data, the runner, the split backward."""
