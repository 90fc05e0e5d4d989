"""What the framework measures and how it counts: throughput, FLOPs and MFU (metrics.py; the
FLOPs counted on meta in flops.py), the datasheet peaks (datasheet.py), memory accounting and
activation checkpointing (memory.py), the peak probe (peak.py), communication accounting
(comm.py), profiler traces (profiling.py), and a sweep report's plots (plotting.py). Nothing is
re-exported here: import the module you need."""
