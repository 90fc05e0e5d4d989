"""Parallel strategies: the mesh and its degrees (dims.py), each strategy's module (fsdp.py,
tensor.py, pipeline.py, context.py, expert.py, ...) and ``parallelize`` (apply.py), which applies
them to a plain model in one fixed order. Nothing is imported here, so that what only reads the
degrees (the launcher's checks, the planner) imports dims.py without DTensor, the pipelining
package and the compiler."""
