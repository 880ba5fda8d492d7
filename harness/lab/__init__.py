"""Lab tools beside the bench path: kernel and selection sweeps, step traces, a graph-launch probe,
selection replays and the tensor-parallel check. They answer "why" and "is it right" questions about
the kernels and the engine; the product path (plan -> runner -> worker -> session -> guards -> store)
never imports them."""
