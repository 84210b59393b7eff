"""Data parallelism: bucketed DDP, the flat parameter, ZeRO-1/2/3 and HSDP."""
