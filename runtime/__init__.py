"""Below parallel/: the device and backend choice, a rank's process, the allocator, memory and metrics,
AC and compile. Knows no parallelism."""
