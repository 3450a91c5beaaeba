"""CUDA-graph capture and replay for the GPU tests: every rank lines up on
the host before it captures or replays, since the captured kernels wait on
each other across ranks."""


def capture(stream, group, step):
    """``step()`` captured on ``stream`` into a CUDA graph, after a host barrier
    (run it once outside capture first, so that it compiles and allocates its
    pools). Returns (graph, what step returned: the captured outputs, which
    every replay rewrites)."""
    with stream:
        group.comm.Barrier()
        stream.begin_capture()
        out = step()
        graph = stream.end_capture()
    return graph, out


def replay(stream, group, graph, prepare=None) -> None:
    """``prepare()`` on ``stream`` (new inputs written into the captured ones,
    outputs poisoned), then the graph on every rank at once; raises what the
    kernels reported."""
    with stream:
        if prepare is not None:
            prepare()
        stream.synchronize()
        group.comm.Barrier()
        graph.launch(stream)
        stream.synchronize()
    group.check_errors()
